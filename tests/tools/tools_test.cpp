// Unit tests of the tools: the broadcast baseline; starting, waiting for, killing and
// reaping child processes (tools/subprocess.h).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "tools/percentile.h"
#include "tools/broadcast.h"
#include "tools/subprocess.h"
#include "tools/worker.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using tools::Child;
using tools::percentile;
using tools::ProcessSpec;

TensorDecl decl(std::string name, Shape shape, DType dt = DType::kBF16) { return TensorDecl{std::move(name), dt, std::move(shape)}; }

// A worker's pause points are each taken once (issue 49, finding 9: a relay member that
// fell back reached its pause point again, stopped itself a second time and was never
// resumed, so the demo hung for its timeout); a point listed twice pauses twice.
// The nearest-rank percentile against a direct count: the smallest value with at least p%
// of the sample at or below it.
TEST(Percentile, NearestRankOfEverySampleSize) {
  EXPECT_EQ(percentile({}, 50), 0);
  EXPECT_EQ(percentile({7}, 95), 7);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 50), 2);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 0), 1);
  EXPECT_EQ(percentile({4, 1, 3, 2}, 100), 4);
  for (size_t n = 1; n <= 40; ++n) {
    std::vector<double> v;
    for (size_t i = 0; i < n; ++i) v.push_back(static_cast<double>((i * 17) % n));  // a permutation of 0..n-1
    for (double p : {50.0, 95.0}) {
      const double got = percentile(v, p);
      size_t at_or_below = 0;
      for (double x : v) at_or_below += x <= got;
      EXPECT_GE(100.0 * static_cast<double>(at_or_below), p * static_cast<double>(n)) << n << " " << p;
      size_t below = 0;
      for (double x : v) below += x < got;
      EXPECT_LT(100.0 * static_cast<double>(below), p * static_cast<double>(n)) << n << " " << p;
    }
  }
}

TEST(PausePoints, EachIsTakenOnce) {
  auto points = tools::parse_pause_points("5:5,3:-2,3:-2");
  ASSERT_TRUE(points.ok()) << points.status().to_string();
  tools::PausePoints p(*points);
  EXPECT_FALSE(p.take(5, 4));
  EXPECT_FALSE(p.take(4, 5));
  EXPECT_TRUE(p.take(5, 5));
  EXPECT_FALSE(p.take(5, 5)) << "the same point of the same sync again (a fallback): no second pause";
  EXPECT_TRUE(p.take(3, -2));
  EXPECT_TRUE(p.take(3, -2));
  EXPECT_FALSE(p.take(3, -2));
  EXPECT_FALSE(tools::parse_pause_points("5").ok());
}

TEST(Broadcast, OneSenderPerStageToEveryConsumer) {
  std::vector<TensorDecl> meta = {decl("a", {10}), decl("b", {20}), decl("c", {30}, DType::kF32)};
  auto b = tools::broadcast_baseline(meta, {0, 1, 1}, 4);
  EXPECT_EQ(b.bytes, (20u + 40u + 120u) * 4u);
  EXPECT_EQ(b.max_consumer_bytes, 180u);
  EXPECT_EQ(b.max_producer_bytes, 160u * 4u);
  EXPECT_EQ(b.senders, 2);
}

std::string temp_log(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string("ferry-tools-test-") + std::to_string(::getpid()) + "-" + name))
      .string();
}

std::chrono::steady_clock::time_point in(std::chrono::milliseconds d) { return std::chrono::steady_clock::now() + d; }

TEST(Subprocess, RunsAPathNameWithTheGivenEnvironmentAndLog) {
  ProcessSpec ps;
  ps.name = "sh";
  ps.log = temp_log("env.log");
  ps.argv = {"sh", "-c", "echo out=$FERRY_TOOLS_TEST_VAR; echo err >&2; exit 3"};  // found on $PATH
  ::setenv("FERRY_TOOLS_TEST_VAR", "old", 1);
  ps.env = tools::environment_with("FERRY_TOOLS_TEST_VAR", "new");
  ::unsetenv("FERRY_TOOLS_TEST_VAR");
  auto c = tools::spawn(ps);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_GT(c->pid, 0);
  auto status = tools::wait_exit(*c, in(10s));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 3);
  EXPECT_EQ(c->pid, -1);
  EXPECT_EQ(tools::read_log(*c), "out=new\nerr\n");
  std::filesystem::remove(ps.log);
}

TEST(Subprocess, EnvironmentWithoutAName) {
  ::setenv("FERRY_TOOLS_TEST_VAR", "x", 1);
  for (const auto& e : tools::environment_with("FERRY_TOOLS_TEST_VAR", "")) EXPECT_NE(e.rfind("FERRY_TOOLS_TEST_VAR=", 0), 0u);
  ::unsetenv("FERRY_TOOLS_TEST_VAR");
}

TEST(Subprocess, AFailedExecIsLoggedAndExits127) {
  for (const char* exe : {"/nonexistent/ferry-tools-test", "ferry-tools-test-not-on-path"}) {
    ProcessSpec ps;
    ps.name = "missing";
    ps.log = temp_log("missing.log");
    ps.argv = {exe, "--help"};
    auto c = tools::spawn(ps);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    auto status = tools::wait_exit(*c, in(10s));
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status));
    EXPECT_EQ(WEXITSTATUS(*status), 127);
    EXPECT_EQ(tools::read_log(*c), std::string("exec ") + exe + ": No such file or directory\n");
    std::filesystem::remove(ps.log);
  }
  EXPECT_FALSE(tools::is_executable("ferry-tools-test-not-on-path"));
  EXPECT_TRUE(tools::is_executable("sh"));
}

TEST(Subprocess, WaitsAreBoundedAndKillReaps) {
  ProcessSpec ps;
  ps.name = "sleep";
  ps.argv = {"sleep", "30"};
  auto c = tools::spawn(ps);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  // (no exit status: the wait ended at its bound, not when sleep exited 30 s on)
  EXPECT_FALSE(tools::wait_exit(*c, in(50ms)).has_value());
  EXPECT_GT(c->pid, 0);  // still running, still ours
  const pid_t pid = c->pid;
  tools::kill_now(*c);
  EXPECT_EQ(c->pid, -1);
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1);  // reaped
  tools::kill_now(*c);  // no-op
  EXPECT_FALSE(tools::wait_exit(*c, in(0ms)).has_value());
}

TEST(Subprocess, ReapGivesTheExitCodeOrKillsAtTheTimeout) {
  ProcessSpec quick;
  quick.name = "true";
  quick.argv = {"sh", "-c", "exit 5"};
  auto a = tools::spawn(quick);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(tools::reap(*a, 10s), 5);
  EXPECT_EQ(a->pid, -1);

  ProcessSpec slow;
  slow.name = "sleep";
  slow.argv = {"sleep", "30"};
  auto b = tools::spawn(slow);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(tools::reap(*b, 100ms), -1);  // killed at the bound (sleep's own exit would be 0)
  EXPECT_EQ(b->pid, -1);

  auto t = tools::spawn(slow);
  ASSERT_TRUE(t.ok());
  tools::terminate(*t, 10s);  // sleep dies of SIGTERM
  EXPECT_EQ(t->pid, -1);
}

TEST(Subprocess, ProcessFiguresOfThisProcess) {
  auto [rss, fds] = tools::proc_usage(::getpid());
  EXPECT_GT(rss, 0);
  EXPECT_GT(fds, 0);
}

// This process's own CPU clock (user + system, every thread): what proc_cpu reads
// from /proc by another way.
double own_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Spins until this process has used `seconds` more CPU: bounded by CPU consumed, not
// by wall time, so a loaded machine only makes it take longer.
void burn_cpu(double seconds) {
  const double until = own_cpu_seconds() + seconds;
  volatile uint64_t x = 1;
  while (own_cpu_seconds() < until)
    for (int i = 0; i < 100000; ++i) x = x * 6364136223846793005ull + 1442695040888963407ull;
}

constexpr double kBurnSeconds = 0.5;
// /proc counts in clock ticks (1/100 s here); the figures must show most of the burn.
constexpr double kSeenSeconds = 0.4;

// Against an independent oracle, this process's CPU clock read before and after each
// /proc read: what proc_cpu says lies between them, to /proc's resolution (clock ticks
// of 1/100 s, two of them for user and system). CPU time, not wall time: a loaded
// machine changes neither side.
TEST(Subprocess, ProcCpuIsThisProcessesCpuClock) {
  constexpr double kTicks = 0.021;
  for (int i = 0; i < 3; ++i) {
    const double lo = own_cpu_seconds();
    const double seen = tools::proc_cpu(::getpid());
    const double hi = own_cpu_seconds();
    EXPECT_GE(seen, lo - kTicks) << "read " << i;
    EXPECT_LE(seen, hi + kTicks) << "read " << i;
    burn_cpu(kBurnSeconds);
  }
}

TEST(Subprocess, TreeCpuAddsTheCpuOfALiveChild) {
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // burns, says so, then stays alive until released
    ::close(ready[0]);
    ::close(release[1]);  // else its own copy keeps the read below from ever ending
    burn_cpu(kBurnSeconds);
    char c = 1;
    if (::write(ready[1], &c, 1) != 1) ::_exit(2);
    if (::read(release[0], &c, 1) < 0) ::_exit(3);
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(release[0]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const double own = tools::proc_cpu(::getpid());
  const double child_cpu = tools::proc_cpu(child);
  const double tree = tools::tree_cpu(::getpid());
  EXPECT_GE(child_cpu, kSeenSeconds);
  EXPECT_GE(tree - own, kSeenSeconds) << "tree " << tree << " s, this process " << own << " s";
  EXPECT_GE(tools::tree_cpu(child), child_cpu);  // the child has no children of its own
  ::close(release[1]);  // the child's read returns: it exits
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(ready[0]);
  EXPECT_EQ(tools::proc_cpu(child), 0.0);  // reaped: gone from /proc
}

}  // namespace
}  // namespace ferry
