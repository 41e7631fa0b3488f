#include "transport/wire.h"

#include "common/host.h"


#include <cstring>
#include <limits>
#include <string>

namespace ferry::transport_wire {
namespace {

constexpr uint32_t kAddressMagic = 0x44415246;  // "FRAD" little-endian
constexpr uint32_t kKeyMagic = 0x4b525246;      // "FRRK"
constexpr uint32_t kMessageMagic = 0x534d5246;  // "FRMS"
constexpr uint32_t kHandshakeMagic = 0x53485246;  // "FRHS"
constexpr size_t kAddressFixed = 32;
constexpr size_t kKeyFixed = 44;

class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(std::byte{v}); }
  void u16(uint16_t v) { le(v, 2); }
  void u32(uint32_t v) { le(v, 4); }
  void u64(uint64_t v) { le(v, 8); }
  void bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }

 private:
  void le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(std::byte(uint8_t(v >> (8 * i))));
  }
  std::vector<std::byte>& out_;
};

// Reads fixed-size fields; every read is bounds-checked (a failed read sets !ok()).
class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  bool ok() const { return ok_; }
  size_t remaining() const { return in_.size() - pos_; }
  uint8_t u8() { return uint8_t(le(1)); }
  uint16_t u16() { return uint16_t(le(2)); }
  uint32_t u32() { return uint32_t(le(4)); }
  uint64_t u64() { return le(8); }
  std::vector<std::byte> bytes(size_t n) {
    if (!ok_ || n > remaining()) {
      ok_ = false;
      return {};
    }
    std::vector<std::byte> v(in_.begin() + pos_, in_.begin() + pos_ + n);
    pos_ += n;
    return v;
  }

 private:
  uint64_t le(size_t n) {
    if (!ok_ || n > remaining()) {
      ok_ = false;
      return 0;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= uint64_t(uint8_t(in_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }
  std::span<const std::byte> in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

Status check_backend(uint8_t b, Backend expect, const char* what) {
  if (b != uint8_t(Backend::kUcx) && b != uint8_t(Backend::kInproc)) {
    return corrupt("{}: unknown backend byte {}", what, b);
  }
  if (b != uint8_t(expect)) {
    return invalid_argument("{}: made by the {} backend, this transport is {}", what,
                            backend_name(Backend(b)), backend_name(expect));
  }
  return Status::Ok();
}

}  // namespace

uint64_t local_host_tag() { return common::process_space_tag(); }

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kUcx: return "ucx";
    case Backend::kInproc: return "inproc";
  }
  return "unknown";
}

std::vector<std::byte> encode_address(const Address& a) {
  std::vector<std::byte> out;
  out.reserve(kAddressFixed + a.payload.size());
  Writer w(out);
  w.u32(kAddressMagic);
  w.u8(kVersion);
  w.u8(uint8_t(a.backend));
  w.u16(0);
  w.u64(a.instance_id);
  w.u32(a.pid);
  w.u64(a.host_tag);
  w.u32(uint32_t(a.payload.size()));
  w.bytes(a.payload);
  return out;
}

Result<Address> decode_address(std::span<const std::byte> bytes, Backend expect) {
  if (bytes.size() < kAddressFixed) {
    return corrupt("transport address: {} bytes, shorter than the {}-byte header", bytes.size(), kAddressFixed);
  }
  Reader r(bytes);
  uint32_t magic = r.u32();
  if (magic != kAddressMagic) return corrupt("transport address: bad magic {:#x}", magic);
  uint8_t version = r.u8();
  if (version != kVersion) return corrupt("transport address: unsupported version {}", version);
  FERRY_RETURN_IF_ERROR(check_backend(r.u8(), expect, "transport address"));
  uint16_t reserved = r.u16();
  if (reserved != 0) return corrupt("transport address: reserved field is {}", reserved);
  Address a;
  a.backend = expect;
  a.instance_id = r.u64();
  a.pid = r.u32();
  a.host_tag = r.u64();
  uint32_t n = r.u32();
  if (n > kMaxAddressPayload) return corrupt("transport address: payload of {} bytes exceeds {}", n, kMaxAddressPayload);
  if (n != r.remaining()) {
    return corrupt("transport address: header says {} payload bytes, {} present", n, r.remaining());
  }
  a.payload = r.bytes(n);
  if (!r.ok()) return corrupt("transport address: truncated");
  if (a.instance_id == 0) return corrupt("transport address: instance id 0");
  return a;
}

std::vector<std::byte> encode_key(const Key& k) {
  std::vector<std::byte> out;
  out.reserve(kKeyFixed + k.payload.size());
  Writer w(out);
  w.u32(kKeyMagic);
  w.u8(kVersion);
  w.u8(uint8_t(k.backend));
  w.u8(uint8_t(k.kind));
  w.u8(0);
  w.u64(k.owner_id);
  w.u64(k.region_id);
  w.u64(k.base);
  w.u64(k.length);
  w.u32(uint32_t(k.payload.size()));
  w.bytes(k.payload);
  return out;
}

Result<Key> decode_key(std::span<const std::byte> bytes, Backend expect) {
  if (bytes.size() < kKeyFixed) {
    return corrupt("remote key: {} bytes, shorter than the {}-byte header", bytes.size(), kKeyFixed);
  }
  Reader r(bytes);
  uint32_t magic = r.u32();
  if (magic != kKeyMagic) return corrupt("remote key: bad magic {:#x}", magic);
  uint8_t version = r.u8();
  if (version != kVersion) return corrupt("remote key: unsupported version {}", version);
  FERRY_RETURN_IF_ERROR(check_backend(r.u8(), expect, "remote key"));
  Key k;
  k.backend = expect;
  uint8_t kind = r.u8();
  if (kind > uint8_t(MemoryKind::kCuda)) return corrupt("remote key: unknown memory kind {}", kind);
  k.kind = MemoryKind(kind);
  uint8_t reserved = r.u8();
  if (reserved != 0) return corrupt("remote key: reserved field is {}", reserved);
  k.owner_id = r.u64();
  k.region_id = r.u64();
  k.base = r.u64();
  k.length = r.u64();
  uint32_t n = r.u32();
  if (n > kMaxKeyPayload) return corrupt("remote key: payload of {} bytes exceeds {}", n, kMaxKeyPayload);
  if (n != r.remaining()) return corrupt("remote key: header says {} payload bytes, {} present", n, r.remaining());
  k.payload = r.bytes(n);
  if (!r.ok()) return corrupt("remote key: truncated");
  if (k.owner_id == 0) return corrupt("remote key: owner id 0");
  if (k.region_id == 0) return corrupt("remote key: region id 0");
  if (k.length == 0) return corrupt("remote key: region length 0");
  if (k.base > std::numeric_limits<uint64_t>::max() - k.length) {
    return corrupt("remote key: region base {:#x} + length {} wraps around", k.base, k.length);
  }
  return k;
}

void encode_message_header(const MessageHeader& h, std::byte out[kMessageHeaderSize]) {
  std::vector<std::byte> v;
  v.reserve(kMessageHeaderSize);
  Writer w(v);
  w.u32(kMessageMagic);
  w.u8(kVersion);
  w.u8(0);
  w.u16(0);
  w.u64(h.sender_id);
  w.u32(h.tag);
  w.u32(h.payload_len);
  std::memcpy(out, v.data(), kMessageHeaderSize);
}

Result<MessageHeader> decode_message_header(std::span<const std::byte> header, size_t payload_size,
                                            size_t max_payload) {
  if (header.size() != kMessageHeaderSize) {
    return corrupt("message: header of {} bytes, expected {}", header.size(), kMessageHeaderSize);
  }
  Reader r(header);
  uint32_t magic = r.u32();
  if (magic != kMessageMagic) return corrupt("message: bad magic {:#x}", magic);
  uint8_t version = r.u8();
  if (version != kVersion) return corrupt("message: unsupported version {}", version);
  uint8_t r1 = r.u8();
  uint16_t r2 = r.u16();
  if (r1 != 0 || r2 != 0) return corrupt("message: reserved bytes are not zero");
  MessageHeader h;
  h.sender_id = r.u64();
  h.tag = r.u32();
  h.payload_len = r.u32();
  if (!r.ok()) return corrupt("message: truncated header");
  if (h.sender_id == 0) return corrupt("message: sender id 0");
  if (h.payload_len != payload_size) {
    return corrupt("message: header says {} payload bytes, {} arrived", h.payload_len, payload_size);
  }
  if (payload_size > max_payload) {
    return corrupt("message: payload of {} bytes exceeds the limit {}", payload_size, max_payload);
  }
  return h;
}

const char* handshake_step_name(HandshakeStep step) {
  switch (step) {
    case HandshakeStep::kHello: return "hello";
    case HandshakeStep::kChallenge: return "challenge";
    case HandshakeStep::kProof: return "proof";
    case HandshakeStep::kAccept: return "accept";
    case HandshakeStep::kRefuse: return "refuse";
  }
  return "unknown";
}

std::array<std::byte, kHandshakeSize> encode_handshake(const Handshake& h) {
  std::vector<std::byte> out;
  out.reserve(kHandshakeSize);
  Writer w(out);
  w.u32(kHandshakeMagic);
  w.u8(kVersion);
  w.u8(uint8_t(h.step));
  w.u16(0);
  w.u64(h.sender_id);
  w.u64(h.receiver_id);
  w.bytes(std::as_bytes(std::span(h.nonce)));
  w.bytes(std::as_bytes(std::span(h.mac)));
  std::array<std::byte, kHandshakeSize> frame{};
  std::memcpy(frame.data(), out.data(), kHandshakeSize);
  return frame;
}

Result<Handshake> decode_handshake(std::span<const std::byte> bytes) {
  if (bytes.size() != kHandshakeSize) {
    return corrupt("transport handshake: {} bytes, expected {}", bytes.size(), kHandshakeSize);
  }
  Reader r(bytes);
  uint32_t magic = r.u32();
  if (magic != kHandshakeMagic) return corrupt("transport handshake: bad magic {:#x}", magic);
  uint8_t version = r.u8();
  if (version != kVersion) return corrupt("transport handshake: unsupported version {}", version);
  uint8_t step = r.u8();
  if (step < uint8_t(HandshakeStep::kHello) || step > uint8_t(HandshakeStep::kRefuse)) {
    return corrupt("transport handshake: unknown step {}", step);
  }
  if (r.u16() != 0) return corrupt("transport handshake: reserved bytes are not zero");
  Handshake h;
  h.step = HandshakeStep(step);
  h.sender_id = r.u64();
  h.receiver_id = r.u64();
  std::vector<std::byte> nonce = r.bytes(h.nonce.size());
  std::vector<std::byte> mac = r.bytes(h.mac.size());
  if (!r.ok()) return corrupt("transport handshake: truncated");
  if (h.sender_id == 0 || h.receiver_id == 0) return corrupt("transport handshake: instance id 0");
  std::memcpy(h.nonce.data(), nonce.data(), h.nonce.size());
  std::memcpy(h.mac.data(), mac.data(), h.mac.size());
  return h;
}

}  // namespace ferry::transport_wire
