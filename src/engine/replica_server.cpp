#include "engine/replica_server.h"

#include <algorithm>

namespace ferry::engine {

size_t catch_up_parent(size_t holders, size_t i) {
  const size_t p = holders + i;
  size_t n = holders;
  while (p >= 2 * n) n *= 2;
  return p - n;
}

ReplicaServer::ReplicaServer(int rank, uint64_t plan, Connect connect, Send send)
    : rank_(rank), plan_(plan), connect_(std::move(connect)), send_(std::move(send)) {
  thread_ = std::thread([this] { loop(); });
}

ReplicaServer::~ReplicaServer() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ReplicaServer::serve(uint64_t version, uint8_t set, uint64_t table) {
  std::lock_guard<std::mutex> lk(mu_);
  open_ = true;
  version_ = version;
  set_ = set;
  table_ = table;
}

std::vector<int> ReplicaServer::close(Clock::duration bound) {
  std::unique_lock<std::mutex> lk(mu_);
  open_ = false;
  cv_.wait_for(lk, bound, [&] { return holds_.empty() || stopping_; });
  std::vector<int> revoked;
  for (const auto& [peer, joiner] : holds_) revoked.push_back(joiner);
  holds_.clear();  // (their DONE finds no hold: answered revoked)
  return revoked;
}

uint64_t ReplicaServer::table() const {
  std::lock_guard<std::mutex> lk(mu_);
  return table_;
}

size_t ReplicaServer::holds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return holds_.size();
}

void ReplicaServer::on_message(PeerId from, const Replica& m) {
  std::lock_guard<std::mutex> lk(mu_);
  if (m.kind == Replica::kAsk || m.kind == Replica::kDone) {
    if (queue_.size() >= 1024) return;  // (a flood: the joiner times out and tries another source)
    queue_.emplace_back(from, m);
  } else {
    auto& q = answers_[from];
    if (q.size() >= 16) q.pop_front();
    q.push_back(m);
  }
  cv_.notify_all();
}

void ReplicaServer::peer_failed(PeerId peer, const Status& why) {
  std::lock_guard<std::mutex> lk(mu_);
  holds_.erase(peer);
  failed_.insert_or_assign(peer, why);
  cv_.notify_all();
}

void ReplicaServer::forget(PeerId peer) {
  std::lock_guard<std::mutex> lk(mu_);
  answers_.erase(peer);
}

Result<Replica> ReplicaServer::await_answer(PeerId peer, std::initializer_list<uint8_t> kinds,
                                            Clock::time_point deadline, const std::function<Status()>& stop) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    auto q = answers_.find(peer);
    if (q != answers_.end()) {
      while (!q->second.empty()) {
        Replica m = q->second.front();
        q->second.pop_front();
        if (std::find(kinds.begin(), kinds.end(), m.kind) != kinds.end()) return m;
      }
    }
    if (auto f = failed_.find(peer); f != failed_.end()) return f->second;
    if (stopping_) return cancelled("consumer {}: closed while waiting for a replica's answer", rank_);
    if (Clock::now() >= deadline) return timeout_error("consumer {}: no answer from the replica in time", rank_);
    lk.unlock();
    Status st = stop ? stop() : Status::Ok();
    lk.lock();
    if (!st.ok()) return st;
    cv_.wait_until(lk, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
  }
}

void ReplicaServer::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    auto [from, m] = queue_.front();
    queue_.pop_front();
    lk.unlock();
    answer(from, m);
    lk.lock();
  }
}

void ReplicaServer::answer(PeerId from, const Replica& m) {
  // The joiner is answered on our own connection to it (the one its lease names): a
  // message's sender id is that instance's, so the two must agree.
  auto to = connect_(static_cast<int>(m.consumer));
  if (!to.ok() || *to != from) return;  // (not its live instance: nobody to answer)
  Replica reply{static_cast<uint32_t>(rank_), m.version, plan_, Replica::kRefuse, 0, 0};
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (m.kind == Replica::kAsk) {
      if (open_ && m.version == version_ && m.plan == plan_ && !failed_.count(from)) {
        holds_[from] = static_cast<int>(m.consumer);
        reply.kind = Replica::kOffer;
        reply.set = set_;
        reply.table = table_;
      }
    } else {  // kDone
      reply.kind = holds_.erase(from) ? Replica::kIntact : Replica::kRevoked;
      cv_.notify_all();
    }
  }
  if (!send_(from, reply).ok() && reply.kind == Replica::kOffer) {
    std::lock_guard<std::mutex> lk(mu_);
    holds_.erase(from);
    cv_.notify_all();
  }
}

}  // namespace ferry::engine
