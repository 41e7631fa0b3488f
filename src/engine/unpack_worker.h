// engine/unpack_worker.h — the consumer's background thread (internal). The sync thread
// reads layer group g+1 while this thread unpacks group g from its receive slot into the
// params and runs the post-processing groups g completes, in order.
//
// Ownership and threading: owned by the Consumer; every method is called from the
// consumer's sync thread. The worker runs every callback (`unpack`, `post`, `done`,
// `changed` after each state change: a slot freed, a job finished, a failure) on its
// own thread with its own lock released, so callbacks may take the consumer's lock and
// the consumer may call status()/interrupt() while holding it: the only lock order is
// consumer -> worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/sync_trace.h"
#include "ferry/status.h"

namespace ferry::engine {

class UnpackWorker {
 public:
  struct Job {
    uint64_t version = 0;
    int group = 0;
    int slot = -1;  // receive slot holding the group; -1: nothing to unpack (post-process only)
  };
  // `unpack(job)` runs for jobs with a slot, which is freed right after; then, unless it
  // failed, `post(job)`, then (untimed; the consumer's after_group hook) `done(job)`.
  // All run on the worker thread. Each unpack and post is recorded in `trace` (kUnpack,
  // kPost; the caller's, alive longer than the worker) when given.
  // `commit` (optional; CommitPolicy::kGroups): runs after `post` and before `done`, untimed
  // by the worker (the consumer records what it copies), its failure the job's.
  UnpackWorker(int slots, std::function<Status(const Job&)> unpack, std::function<Status(const Job&)> post,
               std::function<void(const Job&)> done, std::function<void()> changed, SyncTrace* trace = nullptr,
               std::function<Status(const Job&)> commit = {});
  ~UnpackWorker();  // stops after the current job and joins
  UnpackWorker(const UnpackWorker&) = delete;
  UnpackWorker& operator=(const UnpackWorker&) = delete;

  void start();
  // Waits (at most `timeout`) until receive slot `slot` is free and takes it. Fails with
  // the worker's error, kCancelled when `stop_waiting()` becomes true (wake it with
  // interrupt()), kTimeout otherwise; `who` names the consumer in errors.
  Result<int> acquire(int slot, std::chrono::milliseconds timeout, const std::function<bool()>& stop_waiting,
                      const std::string& who);
  void enqueue(const Job& job);
  // Waits until every queued job ran or one failed: the first failure, or kTimeout.
  Status drain(std::chrono::milliseconds timeout, const std::string& who);
  // clear(): waits (at most `timeout`) until idle, then drops queued jobs. reset(): the
  // same, and frees every slot and forgets the failure (a new attempt) -- only when it
  // went idle. When a job still runs after `timeout` (a hook blocked, an unpack stuck),
  // reset() drops the queued jobs and frees their slots but leaves the running job's slot
  // held (the worker frees it when the job ends) and the failure kept, and returns
  // kTimeout: no new attempt may start while that job may still write.
  void clear(std::chrono::milliseconds timeout);
  Status reset(std::chrono::milliseconds timeout);
  void interrupt();  // wakes acquire()

  Status status() const;  // OK, or the first failure since reset()

 private:
  void loop();
  bool wait_idle_locked(std::unique_lock<std::mutex>& lk, std::chrono::milliseconds timeout);

  const std::function<Status(const Job&)> unpack_, post_, commit_;
  const std::function<void(const Job&)> done_;
  const std::function<void()> changed_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::vector<bool> slot_busy_;
  bool busy_ = false;
  Job running_;  // the job the worker runs while busy_
  bool stop_ = false;
  Status status_;
  SyncTrace* const trace_;
  std::thread thread_;
};

}  // namespace ferry::engine
