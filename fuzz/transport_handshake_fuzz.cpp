// libFuzzer target: the transport's handshake frame decoder on arbitrary bytes — what an
// unauthenticated peer can send before it proved anything (the other wire decoders:
// fuzz_transport_wire). It must reject or accept without touching memory outside the
// input; an accepted frame must re-encode to exactly the same bytes (canonical).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "transport/wire.h"

using namespace ferry::transport_wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  if (auto h = decode_handshake(in); h.ok()) {
    const auto again = encode_handshake(*h);
    if (size != again.size() || std::memcmp(again.data(), data, size) != 0) __builtin_trap();
  }
  return 0;
}
