#include "engine/unpack_worker.h"

#include <fmt/format.h>

#include "engine/clock.h"

namespace ferry::engine {

UnpackWorker::UnpackWorker(int slots, std::function<Status(const Job&)> unpack, std::function<Status(const Job&)> post,
                           std::function<void(const Job&)> done, std::function<void()> changed, SyncTrace* trace,
                           std::function<Status(const Job&)> commit)
    : unpack_(std::move(unpack)), post_(std::move(post)), commit_(std::move(commit)), done_(std::move(done)),
      changed_(std::move(changed)),
      slot_busy_(static_cast<size_t>(slots), false), trace_(trace) {}

UnpackWorker::~UnpackWorker() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void UnpackWorker::start() { thread_ = std::thread([this] { loop(); }); }

void UnpackWorker::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = jobs_.front();
      jobs_.pop_front();
      busy_ = true;
      running_ = job;
    }
    Status s;
    if (job.slot >= 0) {
      auto t = Clock::now();
      s = unpack_(job);
      if (trace_) trace_->record(TracePhase::kUnpack, job.group, -1, t, Clock::now());
      {
        std::lock_guard<std::mutex> lk(mu_);
        slot_busy_[static_cast<size_t>(job.slot)] = false;
        cv_.notify_all();
      }
      changed_();
    }
    if (s.ok()) {
      auto t = Clock::now();
      s = post_(job);
      if (trace_) trace_->record(TracePhase::kPost, job.group, -1, t, Clock::now());
    }
    if (s.ok() && commit_) s = commit_(job);
    if (s.ok() && done_) done_(job);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!s.ok() && status_.ok()) status_ = s;
      busy_ = false;
      cv_.notify_all();
    }
    changed_();
  }
}

Result<int> UnpackWorker::acquire(int slot, std::chrono::milliseconds timeout, const std::function<bool()>& stop_waiting,
                                  const std::string& who) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto s = static_cast<size_t>(slot);
  if (!cv_.wait_for(lk, timeout, [&] { return !slot_busy_[s] || !status_.ok() || stop_waiting(); }))
    return timeout_error("{}: receive slot not freed within {} ms", who, timeout.count());
  if (!status_.ok()) return status_;
  if (stop_waiting()) return cancelled("{}: stopped waiting for a receive slot", who);
  slot_busy_[s] = true;
  return slot;
}

void UnpackWorker::enqueue(const Job& job) {
  std::lock_guard<std::mutex> lk(mu_);
  jobs_.push_back(job);
  cv_.notify_all();
}

Status UnpackWorker::drain(std::chrono::milliseconds timeout, const std::string& who) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto deadline = Clock::now() + timeout;
  while ((!jobs_.empty() || busy_) && status_.ok()) {
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
      return timeout_error("{}: unpacking did not finish within {} ms", who, timeout.count());
  }
  return status_;
}

bool UnpackWorker::wait_idle_locked(std::unique_lock<std::mutex>& lk, std::chrono::milliseconds timeout) {
  return cv_.wait_for(lk, timeout, [&] { return jobs_.empty() && !busy_; });
}

void UnpackWorker::clear(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  wait_idle_locked(lk, timeout);
  jobs_.clear();
}

Status UnpackWorker::reset(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto start = std::chrono::steady_clock::now();
  if (!wait_idle_locked(lk, timeout)) {
    // Queued jobs never started: drop them and free their slots. The running one keeps
    // its slot (freed by the worker when its unpack ends): handing it back now let the
    // next attempt receive into a slot still being unpacked from.
    for (const Job& j : jobs_)
      if (j.slot >= 0) slot_busy_[static_cast<size_t>(j.slot)] = false;
    jobs_.clear();
    cv_.notify_all();
    if (busy_) {
      return timeout_error(
          "unpack worker: the job of sync {} group {} still runs after {} ms (a hook or an unpack that does not "
          "return); a new attempt cannot start while it may write{}",
          running_.version, running_.group,
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count(),
          running_.slot >= 0 && slot_busy_[static_cast<size_t>(running_.slot)]
              ? fmt::format(" (it holds receive slot {})", running_.slot)
              : std::string());
    }
  }
  jobs_.clear();
  status_ = Status::Ok();
  std::fill(slot_busy_.begin(), slot_busy_.end(), false);
  return Status::Ok();
}

void UnpackWorker::interrupt() {
  std::lock_guard<std::mutex> lk(mu_);
  cv_.notify_all();
}

Status UnpackWorker::status() const {
  std::lock_guard<std::mutex> lk(mu_);
  return status_;
}

}  // namespace ferry::engine
