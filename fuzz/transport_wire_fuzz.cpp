// Untrusted bytes as a peer's transport address, remote key and message header
// (src/transport/wire.h): decoding never reads outside the input, and whatever decodes
// re-encodes to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "transport/wire.h"

using namespace ferry::transport_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto same = [&](const std::vector<std::byte>& again) {
    if (again.size() != size || (size && std::memcmp(again.data(), data, size) != 0)) std::abort();
  };
  for (Backend b : {Backend::kUcx, Backend::kInproc}) {
    if (auto a = decode_address(bytes, b); a.ok()) {
      if (a->backend != b || a->payload.size() > kMaxAddressPayload) std::abort();
      same(encode_address(*a));
    }
    if (auto k = decode_key(bytes, b); k.ok()) {
      if (k->length == 0 || k->base + k->length < k->base || k->payload.size() > kMaxKeyPayload) std::abort();
      same(encode_key(*k));
    }
  }
  // A header: the first 24 bytes; the rest is its payload, bounded by the first byte.
  if (size >= kMessageHeaderSize) {
    const size_t payload = size - kMessageHeaderSize;
    const size_t max_payload = static_cast<size_t>(data[0]) * 16;
    if (auto h = decode_message_header(bytes.first(kMessageHeaderSize), payload, max_payload); h.ok()) {
      if (h->payload_len != payload || payload > max_payload) std::abort();
      std::byte out[kMessageHeaderSize];
      encode_message_header(*h, out);
      if (std::memcmp(out, data, kMessageHeaderSize) != 0) std::abort();
    }
  }
  return 0;
}
