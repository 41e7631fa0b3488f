// The UCX backend's token handshake (TransportOptions::token; docs/transport.md,
// "Authentication"). The connector runs it inside connect(), over its control endpoint:
//   HELLO(connector nonce) -> CHALLENGE(acceptor nonce, acceptor proof)
//   -> PROOF(connector proof) -> ACCEPT | REFUSE
// Identity is the endpoint, not what a message claims: every active message ferry
// sends carries UCX's reply endpoint (UCP_AM_SEND_FLAG_REPLY), and a receiver serves a
// message only if it arrived on an endpoint that finished a handshake, and only for the
// instance id proved there (authenticated_eps_). Everything here runs on the progress
// thread (UCX callbacks, or commands).
#include <cstdio>

#include "transport/ucx/ucx_backend.h"

namespace ferry::detail::ucx {

namespace auth = ferry::transport_auth;

namespace {

ucp_ep_h reply_ep_of(const ucp_am_recv_param_t* param) {
  if (param == nullptr || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return nullptr;
  return param->reply_ep;
}

}  // namespace

// Caller thread (connect), never the progress thread: waits for the verdict.
Status UcxBackend::handshake(PeerId id) {
  auto state = std::make_shared<OpState>(CompletionCallback{}, &progress_tid_);
  bool posted = post([this, id, state] {
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(id);
      if (it != peers_.end() && !it->second->failed && it->second->ep != nullptr) peer = it->second;
    }
    if (!peer) {
      state->complete(peer_failed("connect: peer {:#x} failed before the token handshake", id));
      return;
    }
    if (peer->authenticated) {
      state->complete(Status::Ok());
      return;
    }
    if (auto it = connects_.find(id); it != connects_.end()) {
      // Another connect() of the same peer is running the handshake: share its verdict.
      it->second.waiters.push_back(state);
      return;
    }
    Result<auth::Nonce> nonce = auth::random_nonce();
    if (!nonce.ok()) {
      state->complete(nonce.status());
      return;
    }
    connects_[id] = PendingConnect{*nonce, false, {state}};
    wire::Handshake hello{wire::HandshakeStep::kHello, id_, id, *nonce, {}};
    send_handshake(peer->ep, hello, peer);
  });
  if (!posted) return cancelled("connect: the transport is shutting down");
  Status st = Completion(state).wait(kControlTimeout);
  if (st.code() == StatusCode::kTimeout) {
    (void)run_status([this, id]() -> Status {
      end_connect(id, timeout_error("connect: peer {:#x} did not finish the token handshake within {} s", id,
                                    kControlTimeout.count()));
      return Status::Ok();
    });
    st = Completion(state).status();
  }
  return st;
}

void UcxBackend::send_handshake(ucp_ep_h ep, const wire::Handshake& h, const std::shared_ptr<Peer>& peer) {
  auto frame = std::make_shared<std::array<std::byte, wire::kHandshakeSize>>(wire::encode_handshake(h));
  ucp_request_param_t prm = eager_params();
  const PeerId to = h.receiver_id;
  const bool connecting = h.step == wire::HandshakeStep::kHello || h.step == wire::HandshakeStep::kProof;
  uint64_t op = track(peer.get(), [this, frame, to, connecting](ucs_status_t st) {
    if (st != UCS_OK && connecting) end_connect(to, from_ucs(st, fmt::format("connect: token handshake with peer {:#x}", to)));
  });
  settle(op, ucp_am_send_nbx(ep, kAmHandshake, frame->data(), frame->size(), nullptr, 0, &prm));
}

// The connect of `id` is over (verdict, failure or timeout).
void UcxBackend::end_connect(PeerId id, Status st) {
  auto it = connects_.find(id);
  if (it == connects_.end()) return;
  auto waiters = std::move(it->second.waiters);
  connects_.erase(it);
  if (st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto p = peers_.find(id); p != peers_.end()) p->second->authenticated = true;
  } else {
    forget_authentication(id);
  }
  for (auto& w : waiters) w->complete(st);
}

ucs_status_t UcxBackend::handshake_cb(void* arg, const void* header, size_t header_length, void*, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  auto h = wire::decode_handshake(std::span<const std::byte>(static_cast<const std::byte*>(header), header_length));
  if (!h.ok() || length != 0 || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->stats_.malformed_messages++;
    return UCS_OK;
  }
  ucp_ep_h reply = reply_ep_of(param);
  if (reply == nullptr || h->receiver_id != self->id_) {
    // No endpoint to bind the proof to, or meant for another transport (an older
    // incarnation at the same address): refused.
    self->stats_.refused_unauthenticated++;
    return UCS_OK;
  }
  switch (h->step) {
    case wire::HandshakeStep::kHello: self->on_hello(*h, reply); break;
    case wire::HandshakeStep::kProof: self->on_proof(*h, reply); break;
    case wire::HandshakeStep::kChallenge: self->on_challenge(*h, reply); break;
    case wire::HandshakeStep::kAccept:
    case wire::HandshakeStep::kRefuse: self->on_verdict(*h, reply); break;
  }
  return UCS_OK;
}

// Acceptor: a connector says hello. Answered by anyone (the challenge proves our token
// to the connector); nothing is served on that endpoint until its PROOF.
void UcxBackend::on_hello(const wire::Handshake& h, ucp_ep_h reply_ep) {
  Result<auth::Nonce> nonce = auth::random_nonce();
  if (!nonce.ok()) return;
  if (accepts_.size() >= kMaxPendingAccepts && !accepts_.contains(reply_ep)) {
    auto oldest = std::min_element(accepts_.begin(), accepts_.end(),
                                   [](const auto& a, const auto& b) { return a.second.seq < b.second.seq; });
    accepts_.erase(oldest);
    stats_.refused_unauthenticated++;  // a handshake left unfinished
  }
  accepts_[reply_ep] = PendingAccept{h.sender_id, h.nonce, *nonce, accept_seq_++};
  wire::Handshake challenge{wire::HandshakeStep::kChallenge, id_, h.sender_id, *nonce,
                            auth::acceptor_proof(opt_.token, h.sender_id, id_, h.nonce, *nonce)};
  send_handshake(reply_ep, challenge, nullptr);
}

// Acceptor: the connector's proof.
void UcxBackend::on_proof(const wire::Handshake& h, ucp_ep_h reply_ep) {
  auto it = accepts_.find(reply_ep);
  const bool ok = it != accepts_.end() && it->second.connector == h.sender_id &&
                  it->second.acceptor_nonce == h.nonce &&
                  auth::macs_equal(h.mac, auth::connector_proof(opt_.token, h.sender_id, id_,
                                                                it->second.connector_nonce, h.nonce));
  if (it != accepts_.end()) accepts_.erase(it);
  if (ok) {
    authenticated_eps_[reply_ep] = h.sender_id;
    stats_.authenticated_peers++;
  } else {
    stats_.refused_unauthenticated++;
    note_wrong_proof(h.sender_id);
  }
  wire::Handshake verdict{ok ? wire::HandshakeStep::kAccept : wire::HandshakeStep::kRefuse, id_, h.sender_id, {}, {}};
  send_handshake(reply_ep, verdict, nullptr);
}

void UcxBackend::note_wrong_proof(uint64_t claimed_sender) {
  ++wrong_proofs_unlogged_;
  const auto now = std::chrono::steady_clock::now();
  if (wrong_proofs_logged_ != std::chrono::steady_clock::time_point{} && now - wrong_proofs_logged_ < kWrongProofLogEvery)
    return;
  std::fprintf(stderr,
               "ferry transport %#llx: %llu wrong token proof(s) since the last such line (refused; the last from a "
               "peer calling itself %#llx): a peer with another job's token, or guessing\n",
               static_cast<unsigned long long>(id_), static_cast<unsigned long long>(wrong_proofs_unlogged_),
               static_cast<unsigned long long>(claimed_sender));
  wrong_proofs_unlogged_ = 0;
  wrong_proofs_logged_ = now;
}

// Connector: the acceptor's challenge, with its proof of the token.
void UcxBackend::on_challenge(const wire::Handshake& h, ucp_ep_h reply_ep) {
  auto it = connects_.find(h.sender_id);
  if (it == connects_.end() || it->second.proved) {
    stats_.refused_unauthenticated++;  // a challenge nobody asked for
    return;
  }
  if (!auth::macs_equal(h.mac, auth::acceptor_proof(opt_.token, id_, h.sender_id, it->second.nonce, h.nonce))) {
    stats_.refused_unauthenticated++;
    end_connect(h.sender_id, permission_denied("connect: peer {:#x} did not prove the job's token (its transport "
                                               "has another token, or none)", h.sender_id));
    return;
  }
  std::shared_ptr<Peer> peer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto p = peers_.find(h.sender_id);
    if (p != peers_.end() && !p->second->failed && p->second->ep != nullptr) peer = p->second;
  }
  if (!peer) return end_connect(h.sender_id, peer_failed("connect: peer {:#x} failed during the token handshake", h.sender_id));
  it->second.proved = true;
  // The acceptor answers our requests on the endpoint this challenge came on.
  authenticated_eps_[reply_ep] = h.sender_id;
  wire::Handshake proof{wire::HandshakeStep::kProof, id_, h.sender_id, h.nonce,
                        auth::connector_proof(opt_.token, id_, h.sender_id, it->second.nonce, h.nonce)};
  send_handshake(peer->ep, proof, peer);
}

// Connector: ACCEPT or REFUSE.
void UcxBackend::on_verdict(const wire::Handshake& h, ucp_ep_h) {
  auto it = connects_.find(h.sender_id);
  if (it == connects_.end() || !it->second.proved) {
    stats_.refused_unauthenticated++;
    return;
  }
  if (h.step == wire::HandshakeStep::kAccept) return end_connect(h.sender_id, Status::Ok());
  end_connect(h.sender_id, permission_denied("connect: peer {:#x} refused this transport's proof of the job's token "
                                             "(the two transports have different tokens)", h.sender_id));
}

bool UcxBackend::authorized(const ucp_am_recv_param_t* param, uint64_t claimed) {
  if (opt_.token.empty()) return true;
  ucp_ep_h ep = reply_ep_of(param);
  auto it = ep == nullptr ? authenticated_eps_.end() : authenticated_eps_.find(ep);
  if (it != authenticated_eps_.end() && it->second == claimed) return true;
  stats_.refused_unauthenticated++;
  return false;
}

// A peer disconnected or failed: its endpoints prove nothing any more (UCX may reuse
// the handles).
void UcxBackend::forget_authentication(PeerId id) {
  std::erase_if(authenticated_eps_, [id](const auto& e) { return e.second == id; });
  std::erase_if(accepts_, [id](const auto& e) { return e.second.connector == id; });
  std::lock_guard<std::mutex> lock(mu_);
  if (auto p = peers_.find(id); p != peers_.end()) p->second->authenticated = false;
}

}  // namespace ferry::detail::ucx
