// The UCX backend's progress thread: commands, sleeping and spinning, and the
// table of operations in flight.
#include "transport/ucx/ucx_backend.h"

namespace ferry::detail::ucx {

bool UcxBackend::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    if (stop_) return false;
    cmds_.push_back(std::move(fn));
  }
  wake();
  return true;
}

// Wakes the progress thread if it sleeps (ucp_worker_signal is thread-safe).
void UcxBackend::wake() {
  if (!sleeping_.load()) return;
  if (efd_ >= 0) ucp_worker_signal(worker_);
  cmd_cv_.notify_one();
}

// After a caller posted an operation directly that is still in flight: the progress
// thread must progress it. Pairs with run()'s check before sleeping (both seq_cst):
// either it sees direct_posts_ move, or this sees sleeping_ and signals.
void UcxBackend::kick() {
  direct_posts_.fetch_add(1);
  if (!sleeping_.load()) return;
  if (efd_ >= 0) ucp_worker_signal(worker_);
  cmd_cv_.notify_one();
}

void UcxBackend::run() {
  progress_tid_ = std::this_thread::get_id();
  auto last_active = Clock::now();
  std::deque<std::function<void()>> batch;
  for (;;) {
    bool active = false, busy = false;
    {
      std::lock_guard<std::mutex> worker(worker_mu_);
      {
        std::lock_guard<std::mutex> lock(cmd_mu_);
        if (stop_) break;
        batch.swap(cmds_);
      }
      active = !batch.empty();
      for (auto& fn : batch) fn();
      batch.clear();
      if (watched_.load(std::memory_order_relaxed) > 0 && Clock::now() >= next_watch_) {
        next_watch_ = Clock::now() + kWatchInterval;
        check_watched_processes();
      }
      while (ucp_worker_progress(worker_) != 0) active = true;
      busy = !inflight_.empty();
    }
    const auto now = Clock::now();
    if (active) {
      last_active = now;
      continue;
    }
    // Nothing happened in this pass. With operations in flight, spin only briefly,
    // then sleep on the event fd like an idle worker (see kBusySpin, config.h).
    if (busy && (efd_ < 0 || now - last_active < cfg_.busy_spin)) continue;
    if (!busy && now - last_active < cfg_.spin) continue;
    const uint64_t posts_seen = direct_posts_.load();
    if (efd_ >= 0) {
      ucs_status_t st;
      {
        std::lock_guard<std::mutex> worker(worker_mu_);
        st = ucp_worker_arm(worker_);
      }
      if (st == UCS_ERR_BUSY) continue;  // events pending: progress again
      if (st == UCS_OK) {
        sleeping_.store(true);
        bool pending;
        {
          std::lock_guard<std::mutex> lock(cmd_mu_);
          // Posted before sleeping_ was visible.
          pending = stop_ || !cmds_.empty() || direct_posts_.load() != posts_seen;
        }
        if (!pending) {
          // Bounded: the process watch and stop_ are checked at least this often, and
          // an operation in flight is progressed at least every kBusySleep even if
          // some transport raised no event for it.
          auto limit = busy ? kBusySleep : watched_.load() > 0 ? kWatchInterval : kMaxSleep;
          pollfd p{efd_, POLLIN, 0};
          poll(&p, 1, int(std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()));
        }
        sleeping_.store(false);
        continue;
      }
    }
    std::unique_lock<std::mutex> lock(cmd_mu_);
    sleeping_.store(true);
    cmd_cv_.wait_for(lock, kIdleSleep, [&] { return stop_ || !cmds_.empty() || direct_posts_.load() != posts_seen; });
    sleeping_.store(false);
  }
  // Commands posted before stop still run (they complete their ops as cancelled or
  // post nothing new); the destructor finishes the shutdown on its own thread.
  std::lock_guard<std::mutex> worker(worker_mu_);
  std::deque<std::function<void()>> rest;
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    rest.swap(cmds_);
  }
  for (auto& fn : rest) fn();
}

// Registers a completion continuation; returns the id stored in the UCX request.
// `peer`: the operation is failed by ferry when that peer fails (UCX does not
// always complete requests of a mode-NONE endpoint); nullptr for internal ops.
uint64_t UcxBackend::track(const Peer* peer, std::function<void(ucs_status_t)> fn) {
  uint64_t id = next_op_++;
  inflight_.emplace(id, Inflight{peer, std::move(fn)});
  return id;
}

// Completes op `id` once; a later UCX callback for it finds nothing and is ignored.
void UcxBackend::finish(uint64_t id, ucs_status_t st) {
  am_reads_.erase(id);  // late chunks of a failed read must not land in the caller's buffer
  am_flushes_.erase(id);
  auto it = inflight_.find(id);
  if (it == inflight_.end()) return;
  auto fn = std::move(it->second.fn);
  inflight_.erase(it);
  fn(st);
}

void UcxBackend::fail_inflight(const Peer* peer) {
  std::vector<uint64_t> ids;
  for (auto& [id, op] : inflight_) {
    if (op.peer == peer) ids.push_back(id);
  }
  for (uint64_t id : ids) finish(id, UCS_ERR_CONNECTION_RESET);
}

// The immediate outcome of an nbx call.
void UcxBackend::settle(uint64_t op_id, ucs_status_ptr_t r) {
  if (r == nullptr) {
    finish(op_id, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    finish(op_id, UCS_PTR_STATUS(r));
  } else {
    *static_cast<uint64_t*>(r) = op_id;  // the request's user area (request_size)
  }
}

void UcxBackend::send_cb(void* request, ucs_status_t status, void* user_data) {
  auto* self = static_cast<UcxBackend*>(user_data);
  uint64_t id = *static_cast<uint64_t*>(request);
  ucp_request_free(request);
  self->finish(id, status);
}

Status UcxBackend::run_status(std::function<Status()> fn) {
  auto r = run_sync<bool>([fn = std::move(fn)]() -> Result<bool> {
    Status st = fn();
    if (!st.ok()) return st;
    return true;
  });
  return r.status();
}

}  // namespace ferry::detail::ucx
