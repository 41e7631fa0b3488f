// Untrusted bytes as engine messages, producer and consumer leases and in-place tables:
// decoding never reads outside the input, whatever decodes re-encodes to the same bytes,
// and an in-place table that decodes places no box past the end of the 64-bit range.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/in_place.h"
#include "engine/protocol.h"

using namespace ferry::engine;
using ferry::Box;
using ferry::DType;
using ferry::HeldBox;
using ferry::Holdings;

namespace {
// A producer's holdings as a consumer knows them, from the input: `boxes` boxes of one
// bf16 tensor, of sizes taken from the input (up to 2^40 elements: offsets near the top
// of the range must be refused, never wrap).
Holdings holdings_of(size_t boxes, const uint8_t* data, size_t size) {
  Holdings h;
  h.tensors.push_back({"t", DType::kBF16, {int64_t{1} << 40}});
  for (size_t i = 0; i < boxes; ++i) {
    const int64_t n = size ? int64_t{data[i % size]} << (data[(i + 1) % size] % 33) : 0;
    h.boxes.push_back(HeldBox{0, Box{{0}, {n}}});
  }
  return h;
}

// Every box in place ends inside the 64-bit range (decode's bound).
void check_bounds(const InPlaceTable& t, const Holdings& h) {
  if (t.boxes.size() != h.boxes.size()) std::abort();
  for (size_t i = 0; i < t.boxes.size(); ++i) {
    if (t.boxes[i].region < 0) continue;
    const uint64_t bytes = static_cast<uint64_t>(h.boxes[i].box.numel()) * 2;
    if (t.boxes[i].offset + bytes < t.boxes[i].offset) std::abort();
  }
}
}  // namespace

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
    const Holdings h = holdings_of(boxes, data, size);
    // (An empty table, nothing served in place, has no boxes.)
    if (auto t = InPlaceTable::decode(l->in_place, h); t.ok() && !l->in_place.empty()) check_bounds(*t, h);
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
  const Holdings h = holdings_of(size % 64, data, size);
  if (auto t = InPlaceTable::decode(text, h); t.ok() && size > 0) check_bounds(*t, h);
  return 0;
}
