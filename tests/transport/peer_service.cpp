#include "transport/peer_service.h"

#include <algorithm>
#include <chrono>

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
  stop_reading_ = true;
  if (reader_.joinable()) reader_.join();
  if (copier_.joinable()) copier_.join();
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
    case kCopy: {
      uint64_t a[3] = {};
      const bool ok = payload.size() > 24 && unpack_u64s(payload.first(24), 3, a) && a[2] <= bytes_;
      if (!ok) {
        t_.send(from, kCopyReply, pack_u64s({0u, 0u, 0u})).status().ignore();
        break;
      }
      // On a thread of its own: this (the progress) thread cannot wait for the operation.
      // Joining the previous one here cannot deadlock: the parent sends the next kCopy
      // only after that one's reply, its last step (send() does not wait).
      if (copier_.joinable()) copier_.join();
      copier_ = std::thread([this, write = a[0] != 0, offset = a[1], length = a[2],
                             key = std::vector<std::byte>(payload.begin() + 24, payload.end())] {
        auto by_message = [&] {
          const TransportStats s = t_.stats();
          return write ? s.writes_by_message : s.reads_by_message;
        };
        const uint64_t before = by_message();
        const bool done = copy(key, write, offset, length).ok();
        const uint64_t h = done ? hash_bytes(mem_, length) : 0;
        const uint64_t moved = by_message() != before ? 1u : 0u;
        t_.send(parent_, kCopyReply, pack_u64s({done ? 1u : 0u, h, moved})).status().ignore();
      });
      break;
    }
    case kExit:
      exit_ = true;
      break;
    case kReadLoop:
    case kWriteLoop:
    case kWideReadLoop:
    case kSendLoop:
      // One loop at a time; a loop that has ended (an op failed) makes room for the next
      // (joined here only once it has returned: it waits for this thread until then).
      if (reader_.joinable() && loop_done_) reader_.join();
      if (!reader_.joinable()) {
        loop_done_ = false;
        reader_ = std::thread(
            [this, write = tag == kWriteLoop, wide = tag == kWideReadLoop, flood = tag == kSendLoop,
             key = std::vector<std::byte>(payload.begin(), payload.end())]() mutable {
              if (flood) {
                send_loop();
              } else {
                rma_loop(std::move(key), write, wide);
              }
              loop_done_ = true;
            });
      }
      break;
    default:
      break;
  }
}

// kCopy: one read or write between the parent's region (`key`) and ours (a thread of
// its own; bounded waits).
Status PeerService::copy(std::span<const std::byte> key, bool write, uint64_t offset, uint64_t length) {
  auto remote = t_.import_key(key);
  if (!remote.ok()) return remote.status();
  auto c = write ? t_.write(region_, 0, *remote, offset, length) : t_.read(region_, 0, *remote, offset, length);
  Status result = c.ok() ? c->wait(std::chrono::seconds(30)) : c.status();
  if (result.ok() && write) {
    auto f = t_.flush(parent_);
    result = f.ok() ? f->wait(std::chrono::seconds(30)) : f.status();
  }
  Status released = t_.release_key(*remote);
  return result.ok() ? released : result;
}

// kSendLoop: floods the parent with messages until one fails or the service stops.
// Bounded by the test: the parent kills this process or stops the service.
void PeerService::send_loop() {
  constexpr int kInFlight = 16;
  std::vector<Completion> ring(kInFlight);
  const std::vector<std::byte> payload(64, std::byte{0x5a});
  for (uint64_t i = 0; !stop_reading_; ++i) {
    Completion& slot = ring[i % kInFlight];
    if (slot.valid() && !slot.wait(std::chrono::seconds(30)).ok()) break;
    auto c = t_.send(parent_, kFlood, payload);
    if (!c.ok()) break;
    slot = *c;
    if (i == 256) t_.send(parent_, kReadLoopStarted, {}).status().ignore();
  }
  for (auto& c : ring) {
    if (c.valid()) c.wait(std::chrono::seconds(30)).ignore();
  }
}

// Reads (or writes) the parent's region over and over (the parent is the *target*: over
// UCX tcp its worker serves emulated gets/puts) until an op fails or the service stops.
// Bounded by the test: the parent kills this process or stops the service.
void PeerService::rma_loop(std::vector<std::byte> key, bool write, bool wide) {
  auto remote = t_.import_key(key);
  if (!remote.ok()) return;
  const uint64_t kChunk = wide ? 1 << 20 : 64 << 10;
  const uint64_t kInFlight = wide ? 16 : 8;
  auto local = t_.allocate_memory(kChunk * kInFlight);
  if (!local.ok()) return;
  const uint64_t chunks = std::max<uint64_t>(1, remote->length / kChunk);
  std::vector<Completion> ring(kInFlight);
  bool announced = false;
  for (uint64_t i = 0; !stop_reading_; ++i) {
    Completion& slot = ring[i % kInFlight];
    if (slot.valid() && !slot.wait(std::chrono::seconds(30)).ok()) break;
    if (write && i % kInFlight == 0 && i > 0) {
      auto f = t_.flush(parent_);
      if (!f.ok() || !f->wait(std::chrono::seconds(30)).ok()) break;
    }
    const uint64_t len = std::min(kChunk, remote->length);
    const uint64_t off = (i % chunks) * kChunk % (remote->length - len + 1);
    auto c = write ? t_.write(*local, (i % kInFlight) * kChunk, *remote, off, len)
                   : t_.read(*local, (i % kInFlight) * kChunk, *remote, off, len);
    if (!c.ok()) break;
    slot = *c;
    if (!announced && i == 2 * kInFlight) {
      announced = true;
      t_.send(parent_, kReadLoopStarted, {}).status().ignore();
    }
  }
  for (auto& c : ring) {
    if (c.valid()) c.wait(std::chrono::seconds(30)).ignore();
  }
  t_.deregister_memory(*local).ignore();
}

}  // namespace ferry::transport_test
