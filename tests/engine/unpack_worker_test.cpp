// The consumer's background worker (engine/unpack_worker.h) on its own. Issue 30:
// reset() freed every receive slot even when its wait for the worker to go idle timed
// out, so a new attempt could receive into a slot a job was still unpacking from. Every
// wait here is bounded, and none decides pass or fail by timing: the blocked job stays
// blocked until the test releases it.
#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>

#include "engine/unpack_worker.h"

namespace ferry::engine {
namespace {

using std::chrono::milliseconds;

// A gate the worker's unpack blocks on until the test opens it.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool entered = false, open = false;
  void block() {
    std::unique_lock<std::mutex> lk(mu);
    entered = true;
    cv.notify_all();
    cv.wait(lk, [&] { return open; });
  }
  bool wait_entered(milliseconds bound) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, bound, [&] { return entered; });
  }
  void release() {
    std::lock_guard<std::mutex> lk(mu);
    open = true;
    cv.notify_all();
  }
};

TEST(UnpackWorker, ResetThatTimesOutKeepsTheRunningJobsSlot) {
  Gate gate;
  UnpackWorker w(
      2, [&](const UnpackWorker::Job&) { gate.block(); return Status::Ok(); },
      [](const UnpackWorker::Job&) { return Status::Ok(); }, nullptr, [] {});
  w.start();
  const auto never = [] { return false; };
  ASSERT_TRUE(w.acquire(0, milliseconds(10000), never, "test").ok());
  ASSERT_TRUE(w.acquire(1, milliseconds(10000), never, "test").ok());
  w.enqueue({7, 3, 0});  // runs and blocks in its unpack, holding slot 0
  w.enqueue({7, 4, 1});  // queued behind it, holding slot 1
  ASSERT_TRUE(gate.wait_entered(milliseconds(60000)));

  // The job blocks past the timeout: reset says so and hands back only the slot of the
  // job that never started.
  Status r = w.reset(milliseconds(50));
  ASSERT_EQ(r.code(), StatusCode::kTimeout) << r.to_string();
  EXPECT_NE(r.message().find("group 3"), std::string::npos) << r.to_string();
  EXPECT_NE(r.message().find("receive slot 0"), std::string::npos) << r.to_string();
  auto taken = w.acquire(0, milliseconds(50), never, "test");
  EXPECT_EQ(taken.status().code(), StatusCode::kTimeout) << "slot 0 was handed back while its job still runs";
  EXPECT_TRUE(w.acquire(1, milliseconds(10000), never, "test").ok());  // the dropped job's slot

  // Once the job ends, its slot comes back, and a reset completes.
  gate.release();
  EXPECT_TRUE(w.acquire(0, milliseconds(60000), never, "test").ok());
  EXPECT_TRUE(w.reset(milliseconds(60000)).ok());
  EXPECT_TRUE(w.acquire(0, milliseconds(10000), never, "test").ok());
  EXPECT_TRUE(w.acquire(1, milliseconds(10000), never, "test").ok());
}

TEST(UnpackWorker, ResetOfAnIdleWorkerFreesEverySlotAndForgetsTheFailure) {
  UnpackWorker w(
      1, [](const UnpackWorker::Job&) { return Status(StatusCode::kInternal, "unpack failed"); },
      [](const UnpackWorker::Job&) { return Status::Ok(); }, nullptr, [] {});
  w.start();
  const auto never = [] { return false; };
  ASSERT_TRUE(w.acquire(0, milliseconds(10000), never, "test").ok());
  w.enqueue({1, 0, 0});
  EXPECT_EQ(w.drain(milliseconds(60000), "test").code(), StatusCode::kInternal);
  EXPECT_EQ(w.status().code(), StatusCode::kInternal);
  EXPECT_TRUE(w.reset(milliseconds(60000)).ok());
  EXPECT_TRUE(w.status().ok());
  EXPECT_TRUE(w.acquire(0, milliseconds(10000), never, "test").ok());
}

}  // namespace
}  // namespace ferry::engine
