// The UCX backend's reads, writes and flushes by active message (where UCX would
// emulate get/put itself, see "RMA by message" below).
#include "transport/ucx/ucx_backend.h"

namespace ferry::detail::ucx {

// An eager active-message send completing through send_cb (op id in the request).
// Always with UCX's reply ep: the receiver may answer on it, and it is what the token
// handshake binds a peer's identity to (handshake.cpp).
ucp_request_param_t UcxBackend::eager_params() {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  prm.cb.send = &UcxBackend::send_cb;
  prm.user_data = this;
  prm.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  return prm;
}

// Caller holds the worker. Returns true (the read is in flight).
bool UcxBackend::start_read_by_message(const RmaOp& r) {
  uint64_t op_id = track(r.peer.get(), [this, r](ucs_status_t st) { rma_done(r, st); });
  am_reads_.emplace(op_id, AmRead{r.peer->id, static_cast<std::byte*>(r.local), r.length, 0});
  auto req = std::make_shared<ReadReq>(ReadReq{kReadMagic, 0, op_id, id_, r.region_id, r.remote_addr, r.length});
  ucp_request_param_t prm = eager_params();
  uint64_t send_id = track(r.peer.get(), [this, op_id, req](ucs_status_t st) {
    if (st != UCS_OK) finish(op_id, st);  // the request never left: fail the read
  });
  settle(send_id, ucp_am_send_nbx(r.peer->ep, kAmReadReq, req.get(), sizeof(ReadReq), nullptr, 0, &prm));
  return true;
}

// Target: a READ_REQ arrived (progress thread, inside ucp_worker_progress).
ucs_status_t UcxBackend::read_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  ReadReq q{};
  if (header_length != sizeof q || length != 0) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  std::memcpy(&q, header, sizeof q);
  if (q.magic != kReadMagic) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  auto reply = std::make_shared<ReadReply>();
  reply->op = q.op;
  reply->region = q.region;
  reply->addr = q.addr;
  reply->length = q.length;
  if (!self->authorized(param, q.reader)) {
    // Answered with a refusal (on UCX's reply ep only), so a misconfigured reader fails
    // at once instead of timing out; nothing of the region is read.
    reply->refusal = int32_t(UCS_ERR_REJECTED);
    reply->ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
    if (reply->ep != nullptr) self->pump_reply(reply);
    return UCS_OK;
  }
  std::tie(reply->ep, reply->peer) = self->answer_ep(q.reader, param);
  if (reply->ep == nullptr) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  self->pump_reply(reply);
  return UCS_OK;
}

// Target: sends the next chunks of `rp` (progress thread).
void UcxBackend::pump_reply(const std::shared_ptr<ReadReply>& rp) {
  // A send that completes inside its post (the socket took it all) runs its
  // completion, which calls this again: that inner call returns at once and this loop
  // goes on. Recursing instead nested a call per chunk — 16 000 for a 1 GiB read —
  // and overflowed the progress thread's stack (seen under ASan).
  if (rp->pumping) return;
  rp->pumping = true;
  while (!rp->stopped && rp->in_flight < kReadWindow && (rp->sent < rp->length || rp->length == 0)) {
    if (rp->peer && !peer_usable(*rp->peer)) {
      rp->stopped = true;
      break;
    }
    auto buf = std::make_shared<std::vector<std::byte>>();
    ReadData d{kReadMagic, 0, id_, rp->op, rp->sent, 0};
    // Checked again for every chunk: the region may have been deregistered since (only
    // by a command of this thread, so not during the send below).
    const TargetRange t = rp->refusal != 0 ? TargetRange{rp->refusal} : check_target_range(rp->region, rp->addr, rp->length);
    d.status = t.status;
    const std::byte* src = nullptr;
    if (d.status == 0) {
      d.length = std::min(kReadChunk, rp->length - rp->sent);
      src = reinterpret_cast<const std::byte*>(rp->addr + rp->sent);
      if (!t.allocated) {
        // The caller's memory (register_memory) must be free to go once
        // deregister_memory returns, which may be called on this thread and cannot
        // wait for a send: copy.
        buf->assign(src, src + d.length);
        src = buf->data();
      }
    }
    const bool zero_copy = d.length > 0 && buf->empty();
    auto hdr = std::make_shared<ReadData>(d);
    rp->sent += d.length;
    rp->in_flight++;
    if (d.status != 0 || rp->length == 0) rp->stopped = true;  // the last message of this request
    ucp_request_param_t prm = eager_params();
    if (zero_copy) {
      // Sent straight from the region: it stays mapped until UCX has completed the send
      // (region_sends_, see deregister_memory).
      region_sends_[rp->region]++;
    }
    // A zero-copy send is tracked without its peer: only UCX's own completion (an
    // error once the reader failed) may release the region, not ferry's early failing
    // of a dead peer's operations.
    uint64_t id = track(zero_copy ? nullptr : rp->peer.get(),
                        [this, rp, hdr, buf, zero_copy, region = rp->region](ucs_status_t st) {
      rp->in_flight--;
      if (zero_copy) region_send_done(region);
      if (st != UCS_OK) {
        rp->stopped = true;  // the reader is gone or unreachable: nothing to answer
        return;
      }
      pump_reply(rp);
    });
    settle(id, ucp_am_send_nbx(rp->ep, kAmReadData, hdr.get(), sizeof(ReadData), src, d.length, &prm));
  }
  rp->pumping = false;
}

// Whether [addr, addr + length) lies inside registered region `region`, one this
// transport exported (a peer may name any id: only a key we handed out is a right to
// it). Counts a refusal.
TargetRange UcxBackend::check_target_range(uint64_t region, uint64_t addr, uint64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(region);
  if (it == regions_.end() || !it->second.exported) {
    stats_.refused_region++;
    return {int32_t(UCS_ERR_NO_ELEM)};
  }
  const uint64_t base = uint64_t(reinterpret_cast<uintptr_t>(it->second.base));
  if (addr < base || length > it->second.length || addr - base > it->second.length - length) {
    stats_.refused_bounds++;
    return {int32_t(UCS_ERR_OUT_OF_RANGE)};
  }
  return {0, it->second.allocated};
}

// A zero-copy READ_DATA send from `region` completed (progress thread, possibly inside
// a UCX callback): the last one of a deregistered region unmaps it, from a command
// (not inside the callback).
void UcxBackend::region_send_done(uint64_t region) {
  auto it = region_sends_.find(region);
  if (it == region_sends_.end() || --it->second > 0) return;
  region_sends_.erase(it);
  if (!dying_.contains(region)) return;
  post([this, region] {
    auto d = dying_.find(region);
    if (d == dying_.end() || region_sends_.contains(region)) return;
    ucp_mem_unmap(ctx_, d->second);
    dying_.erase(d);
  });  // if the transport is stopping, shutdown() unmaps it
}

// Caller holds the worker. Returns true (in flight, or already completed).
bool UcxBackend::start_write_by_message(const RmaOp& r) {
  uint64_t op_id = track(r.peer.get(), [this, r](ucs_status_t st) { rma_done(r, st); });
  const uint64_t chunks = (r.length + kWriteChunk - 1) / kWriteChunk;
  auto left = std::make_shared<uint64_t>(chunks);
  for (uint64_t i = 0; i < chunks; ++i) {
    const uint64_t off = i * kWriteChunk;
    const uint64_t len = std::min(kWriteChunk, r.length - off);
    auto hdr = std::make_shared<WriteData>(WriteData{kReadMagic, 0, id_, r.region_id, r.remote_addr + off, len});
    ucp_request_param_t prm = eager_params();
    uint64_t send_id = track(r.peer.get(), [this, op_id, left, hdr](ucs_status_t st) {
      if (st != UCS_OK) return finish(op_id, st);
      if (--*left == 0) finish(op_id, UCS_OK);
    });
    settle(send_id, ucp_am_send_nbx(r.peer->ep, kAmWrite, hdr.get(), sizeof(WriteData),
                                    static_cast<const std::byte*>(r.local) + off, len, &prm));
  }
  return true;
}

// Target: a WRITE chunk arrived (progress thread).
ucs_status_t UcxBackend::write_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  WriteData w{};
  if (header_length != sizeof w || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  std::memcpy(&w, header, sizeof w);
  if (w.magic != kReadMagic || w.length != length) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  // Dropped without a trace kept for the writer: a refusal remembered per claimed
  // writer id would let anyone grow refused_writes_ (its flush is refused anyway).
  if (!self->authorized(param, w.writer)) return UCS_OK;
  const int32_t refused = self->check_target_range(w.region, w.addr, w.length).status;
  if (refused != 0) {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->refused_writes_[w.writer] = ucs_status_t(refused);
    return UCS_OK;
  }
  // Regions are deregistered only by commands of this (the progress) thread.
  std::memcpy(reinterpret_cast<void*>(w.addr), data, length);
  return UCS_OK;
}

// Caller holds the worker (a flush command on the progress thread).
void UcxBackend::start_flush_by_message(const std::shared_ptr<Peer>& peer, std::function<void(ucs_status_t)> done) {
  peer->wrote_by_message = false;
  uint64_t op_id = track(peer.get(), std::move(done));
  am_flushes_.insert(op_id);
  auto msg = std::make_shared<FlushMsg>(FlushMsg{kReadMagic, 0, op_id, id_});
  ucp_request_param_t prm = eager_params();
  uint64_t send_id = track(peer.get(), [this, op_id, msg](ucs_status_t st) {
    if (st != UCS_OK) finish(op_id, st);
  });
  settle(send_id, ucp_am_send_nbx(peer->ep, kAmFlushReq, msg.get(), sizeof(FlushMsg), nullptr, 0, &prm));
}

// The endpoint to answer `sender` on: ours when connected to it, else UCX's reply ep.
std::pair<ucp_ep_h, std::shared_ptr<Peer>> UcxBackend::answer_ep(uint64_t sender, const ucp_am_recv_param_t* param) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peers_.find(sender);
    // With a token, our own endpoint only once our handshake with the sender finished:
    // before that the sender would not accept answers on it (its reply ep is the one
    // it authenticated).
    if (it != peers_.end() && !it->second->failed && it->second->ep != nullptr &&
        (opt_.token.empty() || it->second->authenticated)) {
      return {it->second->ep, it->second};
    }
  }
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) && param->reply_ep != nullptr) return {param->reply_ep, nullptr};
  return {nullptr, nullptr};
}

// Target: FLUSH_REQ (progress thread). Every earlier WRITE of this sender is applied.
ucs_status_t UcxBackend::flush_req_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                 const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  FlushMsg f{};
  if (header_length != sizeof f || length != 0) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  std::memcpy(&f, header, sizeof f);
  if (f.magic != kReadMagic) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  const bool authorized = self->authorized(param, f.sender);
  auto [ep, peer] = authorized ? self->answer_ep(f.sender, param)
                               : std::pair<ucp_ep_h, std::shared_ptr<Peer>>{
                                     (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr,
                                     nullptr};
  if (ep == nullptr) {
    if (authorized) self->stats_.malformed_messages++;
    return UCS_OK;
  }
  ucs_status_t refused = authorized ? UCS_OK : UCS_ERR_REJECTED;
  if (authorized) {
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->refused_writes_.find(f.sender);
    if (it != self->refused_writes_.end()) {
      refused = it->second;
      self->refused_writes_.erase(it);
    }
  }
  auto ack = std::make_shared<FlushMsg>(FlushMsg{kReadMagic, int32_t(refused), f.op, self->id_});
  ucp_request_param_t prm = self->eager_params();
  uint64_t id = self->track(peer.get(), [ack](ucs_status_t) {});
  self->settle(id, ucp_am_send_nbx(ep, kAmFlushAck, ack.get(), sizeof(FlushMsg), nullptr, 0, &prm));
  return UCS_OK;
}

// Flusher: FLUSH_ACK (progress thread).
ucs_status_t UcxBackend::flush_ack_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                 const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  FlushMsg f{};
  if (header_length != sizeof f || length != 0) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  std::memcpy(&f, header, sizeof f);
  if (f.magic != kReadMagic) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  if (!self->authorized(param, f.sender)) return UCS_OK;
  if (self->am_flushes_.erase(f.op) == 0) return UCS_OK;  // a flush already failed: drop
  self->finish(f.op, f.status == 0 ? UCS_OK : ucs_status_t(f.status));
  return UCS_OK;
}

// Reader: a chunk of a read arrived (progress thread).
ucs_status_t UcxBackend::read_data_cb(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  ReadData d{};
  if (header_length != sizeof d || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  std::memcpy(&d, header, sizeof d);
  if (d.magic == kReadMagic && !self->authorized(param, d.target)) return UCS_OK;
  auto it = self->am_reads_.find(d.op);
  if (d.magic != kReadMagic || it == self->am_reads_.end() || it->second.target != d.target) {
    if (d.magic != kReadMagic) self->stats_.malformed_messages++;
    return UCS_OK;  // a read that already failed (or never was): drop
  }
  AmRead& rd = it->second;
  if (d.status != 0) {
    self->finish(d.op, ucs_status_t(d.status));
    return UCS_OK;
  }
  if (d.length != length || d.offset > rd.length || d.length > rd.length - d.offset) {
    self->stats_.malformed_messages++;
    self->finish(d.op, UCS_ERR_IO_ERROR);
    return UCS_OK;
  }
  std::memcpy(rd.dst + d.offset, data, length);
  rd.got += length;
  if (rd.got >= rd.length) self->finish(d.op, UCS_OK);
  return UCS_OK;
}

}  // namespace ferry::detail::ucx
