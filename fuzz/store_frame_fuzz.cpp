// libFuzzer target: the embedded TCP store's frame splitter and message decoders on
// arbitrary bytes — what a hostile client can send the server (and a hostile server the
// client). Every decoder must reject or accept without touching memory outside the
// input; whatever it accepts must re-encode to exactly the same bytes (the encoding is
// canonical) and survive validate_request.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "store/tcp/protocol.h"

using namespace ferry::store_tcp;

namespace {

void check_payload(ByteSpan payload) {
  const auto same = [&](const Bytes& frame) {
    return frame.size() == payload.size() + kFrameHeaderBytes &&
           std::memcmp(frame.data() + kFrameHeaderBytes, payload.data(), payload.size()) == 0;
  };
  if (auto q = decode_request(payload); q.ok()) {
    (void)validate_request(*q).ok();
    if (!same(encode_request(*q))) __builtin_trap();
  }
  if (auto r = decode_response(payload); r.ok()) {
    if (!same(encode_response(*r))) __builtin_trap();
  }
  if (auto c = decode_challenge(payload); c.ok()) {
    if (!same(encode_challenge(*c))) __builtin_trap();
  }
  if (auto a = decode_auth(payload); a.ok()) {
    if (!same(encode_auth(*a))) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ByteSpan in(data, size);
  // The input as one payload.
  check_payload(in);
  // The input as a stream of frames, as the server reads it (both limits).
  for (size_t max : {kMaxHandshakeFrameBytes, kMaxFrameBytes}) {
    ByteSpan rest = in;
    while (!rest.empty()) {
      auto split = split_frame(rest, max);
      if (!split.ok()) break;                 // malformed stream: the server hangs up
      if (split->consumed == 0) break;        // needs more bytes
      if (split->consumed > rest.size() || split->payload.size() + kFrameHeaderBytes != split->consumed) {
        __builtin_trap();
      }
      check_payload(split->payload);
      rest = rest.subspan(split->consumed);
    }
  }
  return 0;
}
