// The producer's straggler policy (engine/straggler.h) on its own, on made-up time points:
// who lags, from when, by which bound, and the reason a straggler is dropped with.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "engine/straggler.h"

namespace ferry::engine {
namespace {

using std::chrono::milliseconds;

struct Known {
  std::map<int, uint64_t> declared;
  std::map<int, Clock::time_point> joined;
  RoutesKnown at(uint64_t current, std::optional<uint64_t> undeclared) const {
    return RoutesKnown{current, &declared, &joined, undeclared};
  }
};

const Clock::time_point t0{};  // the slot's announcement
const SlotPace kSlot{3, 0xAB, t0, t0 + milliseconds(100)};

TEST(Straggler, BoundIsTheFloorOrTheOthersTimesTheFactor) {
  EXPECT_EQ(straggler_bound({milliseconds(50), 2, true}, kSlot), milliseconds(200));
  EXPECT_EQ(straggler_bound({milliseconds(500), 2, true}, kSlot), milliseconds(500));
}

TEST(Straggler, OnlyAConsumerKnownToReadTheSlotsRoutesLags) {
  Known k;
  k.declared = {{1, 0xAB}, {2, 0xCD}};
  k.joined = {{1, t0 + milliseconds(300)}, {2, t0}};
  // Undeclared consumers read the sync's first routes when those are known.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, 0xAB), 0), (Lag{t0 + milliseconds(100), true}));
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, std::nullopt), 0), std::nullopt);
  // One that moved to these routes lags from when it moved, if after the last release.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, std::nullopt), 1), (Lag{t0 + milliseconds(300), true}));
  // One that declared other routes, or any in a slot of routes the producer abandoned: never.
  EXPECT_EQ(lag_start(kSlot, k.at(0xAB, 0xAB), 2), std::nullopt);
  EXPECT_EQ(lag_start(kSlot, k.at(0xEF, 0xAB), 0), std::nullopt);
}

// Issue 49, finding 2: the bound is what the user set, with any number of producers (a
// consumer another producer holds up JOINs this one instead).
TEST(Straggler, BoundIsWhatTheUserSet) {
  StragglerPolicy p{milliseconds(2000), 8, true};
  p.join_window = milliseconds(2000);
  EXPECT_EQ(straggler_bound(p, kSlot), milliseconds(2000));
  EXPECT_EQ(lag_bound(p, straggler_bound(p, kSlot), Lag{t0, false}), milliseconds(2000));
}

// RL timing: a consumer that keeps moving lags only from its own last progress; one that
// has not entered the sync yet only meets the join window, and is named "absent".
TEST(Straggler, LagCountsFromOwnProgressAndAbsentOnesMeetTheJoinWindow) {
  Known k;
  std::map<int, Clock::time_point> progress{{0, t0 + milliseconds(900)}, {1, t0 + milliseconds(50)}};
  RoutesKnown known = k.at(0xAB, 0xAB);
  known.progress = &progress;
  // Consumer 0 released its previous slot at 900 ms, after the others' last release here.
  EXPECT_EQ(lag_start(kSlot, known, 0), (Lag{t0 + milliseconds(900), true}));
  // Consumer 1's progress is older than the others' release: lag from the release.
  EXPECT_EQ(lag_start(kSlot, known, 1), (Lag{t0 + milliseconds(100), true}));
  // Consumer 2 never entered.
  EXPECT_EQ(lag_start(kSlot, known, 2), (Lag{t0 + milliseconds(100), false}));

  StragglerPolicy p{milliseconds(50), 2, true};
  p.join_window = milliseconds(5000);
  const auto bound = straggler_bound(p, kSlot);  // 200 ms
  EXPECT_EQ(lag_bound(p, bound, Lag{t0, true}), milliseconds(200));
  EXPECT_EQ(lag_bound(p, bound, Lag{t0, false}), milliseconds(5000));
  const auto deadline = t0 + milliseconds(30000);
  EXPECT_EQ(next_straggler(p, bound, kSlot, known, {0}, deadline), t0 + milliseconds(1100));
  EXPECT_EQ(next_straggler(p, bound, kSlot, known, {2}, deadline), t0 + milliseconds(5100));
  // At 1200 ms: 0 and 1 are stragglers, 2 (absent) is not yet.
  auto out = stragglers(p, bound, kSlot, known, {0, 1, 2}, t0 + milliseconds(1200));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not released 1100 ms after the other consumers, 300 ms after its last progress in "
            "this sync (100 ms after it was announced; bound: max(straggler_floor 50 ms, 2 x 100 ms))");
  EXPECT_EQ(out[1].first, 1);
  out = stragglers(p, bound, kSlot, known, {2}, t0 + milliseconds(5100));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].second,
            "absent: did not enter the sync 5000 ms after the other consumers released group 3 (join_window 5000 ms)");
}

TEST(Straggler, NextIsTheEarliestBeforeTheDeadline) {
  Known k;
  k.declared = {{1, 0xAB}};
  k.joined = {{1, t0 + milliseconds(300)}};
  const StragglerPolicy on{milliseconds(50), 2, true};
  const auto bound = straggler_bound(on, kSlot);
  const auto deadline = t0 + milliseconds(10000);
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {0, 1}, deadline), t0 + milliseconds(300));
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {1}, deadline), t0 + milliseconds(500));
  // Not past the stall deadline (stall_timeout applies), not with the policy off, not
  // before anyone released.
  EXPECT_EQ(next_straggler(on, bound, kSlot, k.at(0xAB, 0xAB), {0}, t0 + milliseconds(300)), std::nullopt);
  EXPECT_EQ(next_straggler({milliseconds(0), 2, true}, bound, kSlot, k.at(0xAB, 0xAB), {0}, deadline), std::nullopt);
  SlotPace unreleased = kSlot;
  unreleased.last_release.reset();
  EXPECT_EQ(next_straggler(on, bound, unreleased, k.at(0xAB, 0xAB), {0}, deadline), std::nullopt);
}

TEST(Straggler, ReasonNamesTheGroupTheLagAndTheBound) {
  Known k;
  k.declared = {{1, 0xAB}};
  k.joined = {{1, t0 + milliseconds(300)}};
  const StragglerPolicy pull{milliseconds(50), 2, true};
  const auto bound = straggler_bound(pull, kSlot);
  // At 350 ms consumer 0 (lagging since 100 ms) is one; consumer 1 (since 300 ms) not yet.
  auto out = stragglers(pull, bound, kSlot, k.at(0xAB, 0xAB), {0, 1}, t0 + milliseconds(350));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].first, 0);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not released 250 ms after the other consumers (100 ms after it was announced; "
            "bound: max(straggler_floor 50 ms, 2 x 100 ms))");
  const StragglerPolicy push{milliseconds(50), 2, false};
  out = stragglers(push, bound, kSlot, k.at(0xAB, 0xAB), {1}, t0 + milliseconds(500));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not requested 400 ms after the other consumers, 200 ms after it moved to these "
            "routes (100 ms after it was announced; bound: max(straggler_floor 50 ms, 2 x 100 ms))");
}

// The rotated order's paced service (issue 26): a consumer whose turn at the slot has not
// come (its wave not open) is not late; one whose turn came lags from then, if later than
// the others' last release, and is named with it.
TEST(Straggler, PacedLagCountsFromTheConsumersTurn) {
  Known k;
  std::map<int, Clock::time_point> opened{{0, t0 + milliseconds(50)}, {1, t0 + milliseconds(400)}};
  RoutesKnown known = k.at(0xAB, 0xAB);
  known.opened = &opened;
  EXPECT_EQ(lag_start(kSlot, known, 0), (Lag{t0 + milliseconds(100), true}));
  EXPECT_EQ(lag_start(kSlot, known, 1), (Lag{t0 + milliseconds(400), true}));
  EXPECT_EQ(lag_start(kSlot, known, 2), std::nullopt) << "its wave has not opened";
  const StragglerPolicy p{milliseconds(200), 0, true};
  const auto bound = straggler_bound(p, kSlot);
  EXPECT_EQ(next_straggler(p, bound, kSlot, known, {1, 2}, t0 + milliseconds(5000)), t0 + milliseconds(600));
  auto out = stragglers(p, bound, kSlot, known, {0, 1, 2}, t0 + milliseconds(650));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].first, 0);
  EXPECT_EQ(out[1].first, 1);
  EXPECT_NE(out[1].second.find("its turn came"), std::string::npos) << out[1].second;
}

// Issue 49, finding 1: a producer's own stop is held against no consumer. Its last resume
// starts every lag, of a consumer that entered and of one that did not (the join window
// counts from it too), and a straggler dropped after it is told so.
TEST(Straggler, LagCountsFromTheProducersOwnResume) {
  Known k;
  std::map<int, Clock::time_point> progress{{0, t0 + milliseconds(50)}};
  RoutesKnown known = k.at(0xAB, 0xAB);
  known.progress = &progress;
  known.resumed = t0 + milliseconds(6000);
  EXPECT_EQ(lag_start(kSlot, known, 0), (Lag{t0 + milliseconds(6000), true}));
  EXPECT_EQ(lag_start(kSlot, known, 1), (Lag{t0 + milliseconds(6000), false}));
  StragglerPolicy p{milliseconds(2000), 8, true};
  p.join_window = milliseconds(4000);
  const auto bound = straggler_bound(p, kSlot);  // 2000 ms
  // Without the resume both would be dropped by 6000 ms; with it, not before 8000 / 10000.
  EXPECT_TRUE(stragglers(p, bound, kSlot, known, {0, 1}, t0 + milliseconds(7999)).empty());
  EXPECT_EQ(next_straggler(p, bound, kSlot, known, {0, 1}, t0 + milliseconds(30000)), t0 + milliseconds(8000));
  auto out = stragglers(p, bound, kSlot, known, {0, 1}, t0 + milliseconds(8000));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].second,
            "straggler: group 3 not released 7900 ms after the other consumers, 2000 ms after this producer resumed "
            "from a stop of its own (100 ms after it was announced; bound: max(straggler_floor 2000 ms, 8 x 100 ms))");
  out = stragglers(p, bound, kSlot, known, {1}, t0 + milliseconds(10000));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].first, 1);
}

// A stop whose end the watcher has not seen yet — right after SIGCONT the caller's thread
// may run before the watcher's — counts as ending now: here the watcher sleeps 10 s
// between wakes, so 400 ms after the last one the gap (300 ms) is open.
TEST(PauseWatch, AGapTheWatcherHasNotClosedEndsNow) {
  PauseWatch w(std::chrono::seconds(10), milliseconds(300));
  std::this_thread::sleep_for(milliseconds(400));
  const auto before = Clock::now();
  const auto r = w.last_resume();
  ASSERT_TRUE(r.has_value());
  EXPECT_GE(*r, before);
}

// PauseWatch notices that its process was stopped: a child process runs one (20 ms
// ticks, 300 ms gap) and is SIGSTOPped for 1.5 s, then continued; the last resume it
// reports is no earlier than the SIGCONT (CLOCK_MONOTONIC: one clock for both).
TEST(PauseWatch, NoticesThatItsProcessWasStopped) {
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int64_t out = -1;
    {
      PauseWatch w(std::chrono::milliseconds(20), std::chrono::milliseconds(300));
      char b = 1;
      if (write(ready[1], &b, 1) != 1) _exit(2);
      if (read(go[0], &b, 1) != 1) _exit(3);  // stopped and continued meanwhile
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      if (auto r = w.last_resume()) out = r->time_since_epoch().count();
    }
    if (write(ready[1], &out, sizeof out) != static_cast<ssize_t>(sizeof out)) _exit(4);
    _exit(0);
  }
  char b;
  ASSERT_EQ(read(ready[0], &b, 1), 1);
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  const auto continued = Clock::now();
  ASSERT_EQ(kill(pid, SIGCONT), 0);
  ASSERT_EQ(write(go[1], &b, 1), 1);
  int64_t resumed = 0;
  ASSERT_EQ(read(ready[0], &resumed, sizeof resumed), static_cast<ssize_t>(sizeof resumed));
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_GT(resumed, 0) << "no pause seen";
  EXPECT_GE(resumed, continued.time_since_epoch().count());
  for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
}

}  // namespace
}  // namespace ferry::engine
