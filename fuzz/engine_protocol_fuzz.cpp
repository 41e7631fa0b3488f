// Untrusted bytes as engine messages, producer and consumer leases and in-place tables:
// decoding never reads outside the input, and whatever decodes re-encodes to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/in_place.h"
#include "engine/protocol.h"

using namespace ferry::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto m = decode_message(bytes); m.ok()) {
    const auto again = encode_message(*m);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
    (void)sender_of(*m);
    (void)message_name(*m);
  }
  if (auto l = decode_producer_lease(text); l.ok()) {
    if (encode_lease(*l) != text) std::abort();
    // The lease's table is checked against a holdings count taken from the input itself.
    const size_t boxes = size ? data[0] : 0;
    // (An empty table, nothing served in place, has no boxes.)
    if (auto t = InPlaceTable::decode(l->in_place, boxes); t.ok() && !l->in_place.empty()) {
      if (t->boxes.size() != boxes) std::abort();
    }
  }
  if (auto l = decode_consumer_lease(text); l.ok()) {
    if (encode_lease(*l) != text) std::abort();
    if (auto t = ParamTable::decode(l->params); t.ok()) {
      for (const auto& [name, p] : t->params)
        if (p.key >= t->keys.size()) std::abort();
    }
  }
  if (auto t = ParamTable::decode(text); t.ok() && !text.empty()) {
    if (ParamTable::decode(t->encode()).value().params.size() != t->params.size()) std::abort();
  }
  for (size_t expected : {1, 3, 4}) (void)decode_fields(text, expected);
  if (auto t = InPlaceTable::decode(text, size % 64); t.ok() && size > 0) {
    if (t->boxes.size() != size % 64) std::abort();
  }
  return 0;
}
