#include "engine/common.h"

#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

namespace ferry::engine {

std::vector<std::byte> encode_msg(const Msg& m) {
  std::vector<std::byte> out(sizeof(Msg));
  std::memcpy(out.data(), &m, sizeof(Msg));
  return out;
}

Result<Msg> decode_msg(std::span<const std::byte> bytes) {
  if (bytes.size() != sizeof(Msg)) return corrupt("engine message of {} bytes, expected {}", bytes.size(), sizeof(Msg));
  Msg m;
  std::memcpy(&m, bytes.data(), sizeof(Msg));
  if (m.magic != kMagic) return corrupt("engine message with bad magic {:#x}", m.magic);
  if (m.type < 1 || m.type > 10) return corrupt("engine message of unknown type {}", m.type);
  return m;
}

std::string encode_fields(const std::vector<std::string>& fields) {
  std::string out;
  for (const auto& f : fields) {
    const uint64_t n = f.size();
    out.append(reinterpret_cast<const char*>(&n), sizeof(n));
    out += f;
  }
  return out;
}

Result<std::vector<std::string>> decode_fields(std::string_view blob, size_t expected) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < blob.size()) {
    uint64_t n = 0;
    if (blob.size() - pos < sizeof(n)) return corrupt("store blob truncated at byte {}", pos);
    std::memcpy(&n, blob.data() + pos, sizeof(n));
    pos += sizeof(n);
    if (n > blob.size() - pos) return corrupt("store blob field of {} bytes overruns the blob", n);
    out.emplace_back(blob.substr(pos, n));
    pos += n;
  }
  if (out.size() != expected) return corrupt("store blob has {} fields, expected {}", out.size(), expected);
  return out;
}

std::string u64_field(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }
Result<uint64_t> parse_u64_field(std::string_view s) {
  if (s.size() != 8) return corrupt("u64 field of {} bytes", s.size());
  uint64_t v;
  std::memcpy(&v, s.data(), 8);
  return v;
}

namespace {
nlohmann::json decl_json(const TensorDecl& d) {
  return nlohmann::json{{"name", d.name}, {"dtype", std::string(dtype_name(d.dtype))}, {"shape", d.shape}};
}
Result<TensorDecl> json_decl(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("name") || !j.contains("dtype") || !j.contains("shape"))
    return corrupt("tensor declaration must have name, dtype and shape");
  TensorDecl d;
  d.name = j["name"].get<std::string>();
  FERRY_ASSIGN_OR_RETURN(d.dtype, parse_dtype(j["dtype"].get<std::string>()));
  d.shape = j["shape"].get<Shape>();
  return d;
}
}  // namespace

std::string encode_decls(const std::vector<TensorDecl>& decls) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& d : decls) a.push_back(decl_json(d));
  return a.dump();
}

Result<std::vector<TensorDecl>> decode_decls(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_array()) return corrupt("metadata is not a JSON array");
    std::vector<TensorDecl> out;
    for (const auto& e : j) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      out.push_back(std::move(d));
    }
    return out;
  } catch (const std::exception& e) {
    return corrupt("metadata JSON: {}", e.what());
  }
}

std::string encode_holdings(const Holdings& h) {
  nlohmann::json t = nlohmann::json::array();
  for (const auto& d : h.tensors) t.push_back(decl_json(d));
  nlohmann::json b = nlohmann::json::array();
  for (const auto& x : h.boxes) b.push_back(nlohmann::json{{"t", x.tensor}, {"start", x.box.start}, {"size", x.box.size}});
  return nlohmann::json{{"tensors", t}, {"boxes", b}}.dump();
}

Result<Holdings> decode_holdings(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    Holdings h;
    for (const auto& e : j.at("tensors")) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      h.tensors.push_back(std::move(d));
    }
    for (const auto& e : j.at("boxes")) {
      HeldBox b;
      b.tensor = e.at("t").get<uint32_t>();
      if (b.tensor >= h.tensors.size()) return corrupt("holdings box names tensor {} of {}", b.tensor, h.tensors.size());
      b.box.start = e.at("start").get<Shape>();
      b.box.size = e.at("size").get<Shape>();
      h.boxes.push_back(std::move(b));
    }
    return h;
  } catch (const std::exception& e) {
    return corrupt("holdings JSON: {}", e.what());
  }
}

std::string key_meta(const std::string& job) { return job + "/meta"; }
std::string key_holdings(const std::string& job, int p) { return fmt::format("{}/holdings/{}", job, p); }
std::string key_plan(const std::string& job, int c) { return fmt::format("{}/plan/{}", job, c); }
std::string key_producer(const std::string& job, int p) { return fmt::format("{}/producer/{}", job, p); }
std::string key_consumer(const std::string& job, int c) { return fmt::format("{}/consumer/{}", job, c); }

std::string key_dead(const std::string& job, int p) { return fmt::format("{}/dead/{}", job, p); }
std::string key_dead_prefix(const std::string& job) { return job + "/dead/"; }

Result<RouteInputs> rendezvous_inputs(Store& store, const EngineOptions& o, const std::vector<TensorDecl>& metadata) {
  std::vector<std::string> keys;
  for (int p = 0; p < o.num_producers; ++p) keys.push_back(key_holdings(o.job, p));
  for (int c = 0; c < o.num_consumers; ++c) keys.push_back(key_plan(o.job, c));
  FERRY_RETURN_IF_ERROR(store.wait(keys, o.rendezvous_timeout).with_context("engine rendezvous"));
  RouteInputs in;
  in.metadata = metadata;
  for (int p = 0; p < o.num_producers; ++p) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(key_holdings(o.job, p)));
    auto h = decode_holdings(text);
    if (!h.ok()) return h.status().with_context(fmt::format("holdings of producer {}", p));
    in.holdings.push_back(std::move(*h));
  }
  for (int c = 0; c < o.num_consumers; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(key_plan(o.job, c)));
    auto plan = Plan::decode(text);
    if (!plan.ok()) return plan.status().with_context(fmt::format("plan of consumer {}", c));
    in.plans.push_back(std::move(*plan));
  }
  return in;
}

Result<Routes> build_routes_excluding(const RouteInputs& inputs, const std::set<int>& dead) {
  RouterInput in;
  in.metadata = inputs.metadata;
  in.producers = inputs.holdings;
  for (int p : dead) {
    if (p >= 0 && static_cast<size_t>(p) < in.producers.size()) in.producers[static_cast<size_t>(p)] = Holdings{};
  }
  for (const auto& p : inputs.plans) in.consumers.push_back(&p);
  auto routes = build_routes(in);
  if (!routes.ok()) return routes.status().with_context("building routes");
  FERRY_RETURN_IF_ERROR(routes->validate());
  return routes;
}

Result<std::set<int>> read_dead(Store& store, const std::string& job) {
  const std::string prefix = key_dead_prefix(job);
  FERRY_ASSIGN_OR_RETURN(auto keys, store.list(prefix));
  std::set<int> out;
  for (const auto& k : keys) {
    try {
      out.insert(std::stoi(k.substr(prefix.size())));
    } catch (const std::exception&) {
    }
  }
  return out;
}

Status RegisteredBuffer::allocate(Transport& t, uint64_t n) {
  reset();
  n = align_up(std::max<uint64_t>(n, 64), 4096);
  // Transport-allocated: over UCX shared memory, peers map it and copy directly.
  auto r = t.allocate_memory(n);
  if (!r.ok()) return r.status().with_context(fmt::format("allocating {} registered bytes", n));
  transport = &t;
  data = static_cast<std::byte*>(r->base);
  bytes = n;
  region = *r;
  std::memset(data, 0, n);
  return Status::Ok();
}

void RegisteredBuffer::reset() {
  if (data && transport) transport->deregister_memory(region).ignore();
  data = nullptr;
  bytes = 0;
  transport = nullptr;
}

}  // namespace ferry::engine

namespace ferry {

Result<SyncMode> parse_sync_mode(std::string_view text) {
  if (text == "pull") return SyncMode::kPull;
  if (text == "push") return SyncMode::kPush;
  return invalid_argument("sync mode '{}': expected pull or push", text);
}
std::string_view sync_mode_name(SyncMode mode) { return mode == SyncMode::kPull ? "pull" : "push"; }

std::string SyncReport::to_string() const {
  std::string s = fmt::format("version {}: {}, {} bytes in {:.3f} s", version, status.ok() ? "ok" : status.to_string(),
                              bytes, seconds);
  for (const auto& f : failures) s += "; " + f;
  return s;
}

}  // namespace ferry
