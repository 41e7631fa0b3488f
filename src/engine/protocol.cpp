#include "engine/protocol.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <fmt/format.h>

namespace ferry::engine {

namespace {

constexpr uint32_t kMessageMagic = 0x46455235u;  // "FER5" (FER4 had no delta fields)
constexpr std::string_view kProducerLeaseMagic = "FPL1";
constexpr std::string_view kConsumerLeaseMagic = "FCL3";  // FCL1 had no versions, FCL2 no host

// The fields of each message, in wire order: one list serves encode and decode.
template <class M, class F>
void fields(M& m, F&& f) {
  using T = std::remove_const_t<M>;
  if constexpr (std::is_same_v<T, Announce>) {
    f(m.producer), f(m.version), f(m.routes), f(m.group), f(m.slot_offset), f(m.patch_base), f(m.patch_bytes),
        f(m.dense_offset), f(m.patch_offset), f(m.checksum);
  } else if constexpr (std::is_same_v<T, Release>) {
    f(m.consumer), f(m.version), f(m.routes), f(m.group), f(m.took);
  } else if constexpr (std::is_same_v<T, Ready>) {
    f(m.consumer), f(m.version), f(m.routes), f(m.group), f(m.recv_slot), f(m.landing), f(m.base);
  } else if constexpr (std::is_same_v<T, Pushed>) {
    f(m.producer), f(m.version), f(m.routes), f(m.group), f(m.recv_slot), f(m.patch_base), f(m.patch_bytes),
        f(m.dense_offset), f(m.checksum);
  } else if constexpr (std::is_same_v<T, Dropped>) {
    f(m.producer), f(m.version), f(m.routes), f(m.reason);
  } else if constexpr (std::is_same_v<T, Relay>) {
    f(m.consumer), f(m.version), f(m.routes), f(m.group), f(m.kind), f(m.offset);
  } else if constexpr (std::is_same_v<T, Replica>) {
    f(m.consumer), f(m.version), f(m.plan), f(m.kind), f(m.set), f(m.table);
  } else if constexpr (std::is_same_v<T, RoutesNotice> || std::is_same_v<T, Flushed>) {
    f(m.producer), f(m.version), f(m.routes);
  } else if constexpr (std::is_same_v<T, Abort>) {
    f(m.consumer), f(m.version), f(m.routes), f(m.reason);
  } else {
    static_assert(std::is_same_v<T, Done> || std::is_same_v<T, Failover> || std::is_same_v<T, Join> ||
                  std::is_same_v<T, Leave>);
    f(m.consumer), f(m.version), f(m.routes);
  }
}

struct Writer {
  std::vector<std::byte>& out;
  template <class T>
  void operator()(const T& v) {
    if constexpr (std::is_same_v<T, std::optional<uint64_t>>) {
      (*this)(static_cast<uint8_t>(v.has_value()));
      (*this)(v.value_or(0));
    } else if constexpr (std::is_same_v<T, std::string>) {
      const uint16_t n = static_cast<uint16_t>(std::min(v.size(), kMaxReasonBytes));
      (*this)(n);
      const size_t at = out.size();
      out.resize(at + n);
      std::memcpy(out.data() + at, v.data(), n);
    } else {
      static_assert(std::is_integral_v<T>);
      const size_t at = out.size();
      out.resize(at + sizeof(T));
      std::memcpy(out.data() + at, &v, sizeof(T));
    }
  }
};

struct Reader {
  std::span<const std::byte> in;
  size_t pos = 0;
  bool ok = true;
  template <class T>
  void operator()(T& v) {
    if constexpr (std::is_same_v<T, std::optional<uint64_t>>) {
      uint8_t has = 0;
      uint64_t x = 0;
      (*this)(has);
      (*this)(x);
      if (has > 1 || (!has && x != 0)) ok = false;  // one encoding per value
      v = has ? std::optional<uint64_t>(x) : std::nullopt;
    } else if constexpr (std::is_same_v<T, std::string>) {
      uint16_t n = 0;
      (*this)(n);
      if (!ok || n > kMaxReasonBytes || in.size() - pos < n) {
        ok = false;
        return;
      }
      v.assign(reinterpret_cast<const char*>(in.data() + pos), n);
      pos += n;
    } else {
      static_assert(std::is_integral_v<T>);
      if (!ok || in.size() - pos < sizeof(T)) {
        ok = false;
        return;
      }
      std::memcpy(&v, in.data() + pos, sizeof(T));
      pos += sizeof(T);
    }
  }
};

template <class M>
Result<Message> decode_as(std::span<const std::byte> bytes, size_t header) {
  M m;
  Reader r{bytes, header};
  fields(m, r);
  if (!r.ok) return corrupt("engine message {}: truncated or bad flag ({} bytes)", message_name(Message(m)), bytes.size());
  if (r.pos != bytes.size())
    return corrupt("engine message {} of {} bytes, expected {}", message_name(Message(m)), bytes.size(), r.pos);
  // One encoding per value: no patch fields without a patch base, flags 0/1.
  if constexpr (requires { m.patch_base; }) {
    if (!m.patch_base && m.patch_bytes != 0)
      return corrupt("engine message {}: patch bytes without a patch base", message_name(Message(m)));
    if (m.patch_base && m.patch_bytes == 0)
      return corrupt("engine message {}: a patch base with an empty patch", message_name(Message(m)));
  }
  if constexpr (requires { m.dense_offset; }) {
    if (!m.patch_base && m.dense_offset != 0)
      return corrupt("engine message {}: a dense offset without a patch", message_name(Message(m)));
  }
  if constexpr (requires { m.patch_offset; }) {
    if (!m.patch_base && m.patch_offset != 0)
      return corrupt("engine message {}: a patch offset without a patch", message_name(Message(m)));
  }
  if constexpr (requires { m.took; }) {
    if (m.took > Release::kRelayed) return corrupt("engine message {}: bad value {}", message_name(Message(m)), m.took);
  }
  if constexpr (std::is_same_v<M, Relay>) {
    if (m.kind > Relay::kMaxKind) return corrupt("engine message Relay: unknown kind {}", m.kind);
    if (m.kind != Relay::kOffer && m.offset != 0) return corrupt("engine message Relay: an offset without an offer");
  }
  if constexpr (std::is_same_v<M, Replica>) {
    if (m.kind > Replica::kMaxKind) return corrupt("engine message Replica: unknown kind {}", m.kind);
    if (m.set > 1) return corrupt("engine message Replica: set {} (0 or 1)", m.set);
    if (m.kind != Replica::kOffer && (m.set != 0 || m.table != 0))
      return corrupt("engine message Replica: a serving table without an offer");
  }
  return Message(std::move(m));
}

template <size_t I = 0>
Result<Message> decode_index(size_t index, std::span<const std::byte> bytes, size_t header) {
  if constexpr (I < std::variant_size_v<Message>) {
    if (index == I) return decode_as<std::variant_alternative_t<I, Message>>(bytes, header);
    return decode_index<I + 1>(index, bytes, header);
  } else {
    return corrupt("engine message of unknown type {}", index + 1);
  }
}

}  // namespace

uint32_t sender_of(const Message& m) {
  return std::visit(
      [](const auto& x) -> uint32_t {
        if constexpr (requires { x.producer; }) {
          return x.producer;
        } else {
          return x.consumer;
        }
      },
      m);
}

uint64_t version_of(const Message& m) {
  return std::visit([](const auto& x) { return x.version; }, m);
}

const char* message_name(const Message& m) {
  static constexpr const char* kNames[] = {"Announce", "Release", "Ready",    "Pushed",       "Dropped",
                                           "Abort",    "Done",    "Failover", "RoutesNotice", "Flushed",
                                           "Join",     "Relay",   "Leave",    "Replica"};
  static_assert(std::size(kNames) == std::variant_size_v<Message>);
  return kNames[m.index()];
}

std::vector<std::byte> encode_message(const Message& m) {
  std::vector<std::byte> out;
  out.reserve(48);
  Writer w{out};
  w(kMessageMagic);
  w(static_cast<uint8_t>(m.index() + 1));
  std::visit([&w](const auto& x) { fields(x, w); }, m);
  return out;
}

Result<Message> decode_message(std::span<const std::byte> bytes) {
  constexpr size_t kHeader = sizeof(uint32_t) + sizeof(uint8_t);
  if (bytes.size() < kHeader) return corrupt("engine message of {} bytes is shorter than its header", bytes.size());
  uint32_t magic;
  std::memcpy(&magic, bytes.data(), sizeof(magic));
  if (magic != kMessageMagic) return corrupt("engine message with bad magic {:#x}", magic);
  const auto type = static_cast<uint8_t>(bytes[sizeof(uint32_t)]);
  if (type == 0 || type > std::variant_size_v<Message>) return corrupt("engine message of unknown type {}", type);
  return decode_index(type - 1u, bytes, kHeader);
}

// ---------------------------------------------------------------------------------------

std::string encode_lease(const ProducerLease& l) {
  return encode_fields(
      {std::string(kProducerLeaseMagic), l.address, l.staging_key, u64_field(l.slot_bytes), l.in_place, l.cuda_ipc});
}

std::string encode_lease(const ConsumerLease& l) {
  auto version = [](const std::optional<uint64_t>& v) { return v ? u64_field(*v) : std::string(); };
  return encode_fields({std::string(kConsumerLeaseMagic), l.address, l.recv_key, u64_field(l.recv_slot_bytes), l.params,
                        version(l.committed), version(l.received), l.host});
}

Result<ProducerLease> decode_producer_lease(std::string_view blob) {
  auto f = decode_fields(blob, 6);
  if (!f.ok()) return f.status().with_context("producer lease");
  if ((*f)[0] != kProducerLeaseMagic) return corrupt("producer lease: not a producer lease");
  ProducerLease l;
  l.address = std::move((*f)[1]);
  l.staging_key = std::move((*f)[2]);
  auto slot = parse_u64_field((*f)[3]);
  if (!slot.ok()) return slot.status().with_context("producer lease slot_bytes");
  l.slot_bytes = *slot;
  l.in_place = std::move((*f)[4]);
  l.cuda_ipc = std::move((*f)[5]);
  return l;
}

std::string consumer_instance(std::string_view blob) {
  auto l = decode_consumer_lease(blob);
  return l.ok() ? encode_lease(l->instance()) : std::string(blob);
}

Result<ConsumerLease> decode_consumer_lease(std::string_view blob) {
  auto f = decode_fields(blob, 8);
  if (!f.ok()) return f.status().with_context("consumer lease");
  if ((*f)[0] != kConsumerLeaseMagic) return corrupt("consumer lease: not a consumer lease");
  ConsumerLease l;
  l.address = std::move((*f)[1]);
  l.recv_key = std::move((*f)[2]);
  auto slot = parse_u64_field((*f)[3]);
  if (!slot.ok()) return slot.status().with_context("consumer lease recv_slot_bytes");
  l.recv_slot_bytes = *slot;
  l.params = std::move((*f)[4]);
  for (auto [field, out] : {std::pair{5, &l.committed}, std::pair{6, &l.received}}) {
    if ((*f)[field].empty()) continue;
    auto v = parse_u64_field((*f)[field]);
    if (!v.ok()) return v.status().with_context(field == 5 ? "consumer lease committed" : "consumer lease received");
    *out = *v;
  }
  l.host = std::move((*f)[7]);
  return l;
}

// ---------------------------------------------------------------------------------------

namespace {
// A rank or size as the keys write it: a canonical decimal (no sign, no leading zero,
// no space) within int. nullopt for anything else, "1/meta" included.
std::optional<int> parse_decimal(std::string_view s) {
  if (s.empty() || s.size() > 10 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  if (!std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v > INT32_MAX) return std::nullopt;
  return static_cast<int>(v);
}
}  // namespace

Status JobKeys::check(std::string_view job) {
  if (job.empty()) return invalid_argument("job name is empty (it is the prefix of the job's store keys)");
  if (job.size() > kMaxJobBytes)
    return invalid_argument("job name of {} bytes is longer than {} bytes", job.size(), kMaxJobBytes);
  for (char c : job) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '/')
      return invalid_argument(
          "job name '{}' contains '/', the store key separator: its keys would lie under another job's (job "
          "'j/dead/1' writes j/dead/1/meta, which job 'j' reads as a dead mark); use e.g. '-' or '.'",
          job);
    if (u < 0x20 || u == 0x7f) return invalid_argument("job name contains the control character 0x{:02x}", u);
  }
  return Status::Ok();
}

std::optional<int> JobKeys::dead_rank(std::string_view key) const {
  const std::string prefix = dead_prefix();
  if (!key.starts_with(prefix)) return std::nullopt;
  return parse_decimal(key.substr(prefix.size()));
}

std::optional<JobKeys::World> JobKeys::world_of(std::string_view key) const {
  const std::string prefix = world_prefix();
  if (!key.starts_with(prefix)) return std::nullopt;
  std::string_view rest = key.substr(prefix.size());
  std::string_view parts[5];
  for (int i = 0; i < 5; ++i) {
    const size_t slash = rest.find('/');
    if ((slash == std::string_view::npos) != (i == 4)) return std::nullopt;
    parts[i] = rest.substr(0, slash);
    rest = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
  }
  if (parts[0] != "producer" && parts[0] != "consumer") return std::nullopt;
  const auto rank = parse_decimal(parts[1]), np = parse_decimal(parts[2]), nc = parse_decimal(parts[3]);
  if (!rank || !np || !nc || parts[4].empty()) return std::nullopt;
  return World{std::string(parts[0]), *rank, *np, *nc, std::string(parts[4])};
}

std::optional<JobKeys::Failed> JobKeys::failed_of(std::string_view key) const {
  const std::string prefix = failed_prefix();
  if (!key.starts_with(prefix)) return std::nullopt;
  std::string_view rest = key.substr(prefix.size());
  const size_t slash = rest.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  const std::string_view role = rest.substr(0, slash);
  std::string_view digits = rest.substr(slash + 1);
  if (role != "producer" && role != "consumer") return std::nullopt;
  // A rank outside the world fails and is named too: "-1" (canonical: not "-0").
  const bool negative = digits.starts_with('-');
  if (negative) digits.remove_prefix(1);
  const auto rank = parse_decimal(digits);
  if (!rank || (negative && *rank == 0)) return std::nullopt;
  return Failed{std::string(role), negative ? -*rank : *rank};
}

std::string JobKeys::meta() const { return job_ + "/meta"; }
std::string JobKeys::holdings(int p) const { return fmt::format("{}/holdings/{}", job_, p); }
std::string JobKeys::plan(int c) const { return fmt::format("{}/plan/{}", job_, c); }
std::string JobKeys::relays(int c) const { return fmt::format("{}/relays/{}", job_, c); }
std::string JobKeys::host(std::string_view role, int rank) const { return fmt::format("{}/host/{}/{}", job_, role, rank); }
std::string JobKeys::producer(int p) const { return fmt::format("{}/producer/{}", job_, p); }
std::string JobKeys::consumer(int c) const { return fmt::format("{}/consumer/{}", job_, c); }
std::string JobKeys::dead(int p) const { return fmt::format("{}/dead/{}", job_, p); }
std::string JobKeys::left(int c) const { return fmt::format("{}/left/consumer/{}", job_, c); }
std::string JobKeys::serving(int c) const { return fmt::format("{}/serving/consumer/{}", job_, c); }
std::string JobKeys::catching_up(int c) const { return fmt::format("{}/catching-up/consumer/{}", job_, c); }
std::string JobKeys::dead_prefix() const { return job_ + "/dead/"; }
std::string JobKeys::world(std::string_view role, int rank, int num_producers, int num_consumers,
                           std::string_view routing) const {
  return fmt::format("{}/world/{}/{}/{}/{}/{}", job_, role, rank, num_producers, num_consumers, routing);
}
std::string JobKeys::world_prefix() const { return job_ + "/world/"; }
std::string JobKeys::committed(int c) const { return fmt::format("{}/committed/{}", job_, c); }
std::string JobKeys::digest(int p) const { return fmt::format("{}/digest/{}", job_, p); }
std::string JobKeys::instance(std::string_view role, int rank) const {
  return fmt::format("{}/instance/{}/{}", job_, role, rank);
}
std::string JobKeys::failed(std::string_view role, int rank) const {
  return fmt::format("{}/failed/{}/{}", job_, role, rank);
}
std::string JobKeys::failed_prefix() const { return job_ + "/failed/"; }

}  // namespace ferry::engine
