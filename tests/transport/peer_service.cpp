#include "transport/peer_service.h"

#include "transport/protocol.h"

namespace ferry::transport_test {

Result<std::unique_ptr<PeerService>> PeerService::start(Transport& t, uint64_t bytes,
                                                        std::span<const std::byte> parent_address) {
  std::unique_ptr<PeerService> s(new PeerService(t));
  // Transport-allocated, as a producer's staging buffer would be.
  FERRY_ASSIGN_OR_RETURN(s->region_, t.allocate_memory(bytes));
  s->mem_ = static_cast<std::byte*>(s->region_.base);
  s->bytes_ = bytes;
  fill_pattern(s->mem_, 0, bytes, 1);
  FERRY_ASSIGN_OR_RETURN(s->key_, t.export_key(s->region_));
  FERRY_ASSIGN_OR_RETURN(s->parent_, t.connect(parent_address));
  PeerService* raw = s.get();
  t.set_message_handler([raw](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
    raw->on_message(from, tag, payload);
  });
  return s;
}

PeerService::~PeerService() {
  t_.set_message_handler({});
  if (region_.id != 0) t_.deregister_memory(region_).ignore();
}

void PeerService::on_message(PeerId from, uint32_t tag, std::span<const std::byte> payload) {
  if (from != parent_) return;  // only the parent talks to us
  switch (tag) {
    case kEcho:
      t_.send(from, kEchoReply, payload).status().ignore();
      break;
    case kHash: {
      uint64_t a[2] = {};
      bool ok = unpack_u64s(payload, 2, a) && a[0] <= bytes_ && a[1] <= bytes_ - a[0];
      uint64_t h = ok ? hash_bytes(mem_ + a[0], a[1]) : 0;
      t_.send(from, kHashReply, pack_u64s({a[0], a[1], h, ok ? 1u : 0u})).status().ignore();
      break;
    }
    case kFill: {
      uint64_t a[3] = {};
      bool ok = unpack_u64s(payload, 3, a) && a[0] <= bytes_ && a[1] <= bytes_ - a[0];
      if (ok) fill_pattern(mem_ + a[0], a[0], a[1], a[2]);
      t_.send(from, kFillReply, pack_u64s({a[0], a[1], ok ? 1u : 0u})).status().ignore();
      break;
    }
    case kExit:
      exit_ = true;
      break;
    default:
      break;
  }
}

}  // namespace ferry::transport_test
