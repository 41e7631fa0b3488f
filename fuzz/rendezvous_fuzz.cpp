// Untrusted store values as the trainer's metadata and a rank's holdings (JSON,
// src/engine/rendezvous.h): decoding never crashes, and whatever decodes re-encodes to
// text that decodes to the same value.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "engine/rendezvous.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto d = engine::decode_decls(text); d.ok()) {
    auto again = engine::decode_decls(engine::encode_decls(*d));
    if (!again.ok() || *again != *d) std::abort();
  }
  if (auto h = engine::decode_holdings(text); h.ok()) {
    auto again = engine::decode_holdings(engine::encode_holdings(*h));
    if (!again.ok() || !(*again == *h)) std::abort();
  }
  return 0;
}
