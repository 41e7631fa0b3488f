// Hostile input on the command line: each of these crashed, hung or was accepted
// (issue 15, finding 5); each must now end at once with an error naming the constraint.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

#include "cli/run_command.h"
#include "test_paths.h"
#include "sanitizers.h"

namespace {

using CliRun = ferry_cli_test::CommandRun;

// Runs `ferry ARGS` under a 60 s `timeout` (a hang fails the test instead of stalling it).
CliRun ferry(const std::string& args) {
  // (stdout to /dev/null: workers a killed demo leaves behind must not hold the pipe open.)
  return ferry_cli_test::run_command("timeout -s KILL 60 " + std::string(FERRY_BIN) + " " + args + " >/dev/null");
}

const std::string kModel = std::string(FERRY_SOURCE_DIR) + "/configs/llama-3.1-8b.json";

TEST(InputCli, HugeLayoutIsRefusedNotBadAlloc) {
  CliRun r = ferry("plan --model " + kModel + " --trainer tp=100000,pp=100000");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("tp*pp = 10000000000 exceeds the limit of 1048576 ranks"), std::string::npos) << r.err;
  r = ferry("plan --model " + kModel + " --trainer fsdp=2147483647");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("exceeds the limit of 1048576 ranks"), std::string::npos) << r.err;
}

// Refused at once with exit code 2 and a message naming the flag (issue 49, finding 7):
// CLI11's own refusals (101-120 before), a negative size taken as 2^64 - 1, a delta
// fraction that ran dense, options that were silently ignored without the one they
// need, and a trace path that failed in every report instead of at the start.
TEST(InputCli, RefusalsExitTwoNamingTheFlag) {
  const std::string plan = "plan --model " + kModel + " --trainer tp=1 --inference tp=1 ";
  const std::string sim = "simulate --model " + kModel + " --trainer tp=1 --inference tp=1 --cluster " +
                          std::string(FERRY_SOURCE_DIR) + "/configs/clusters/emulated-2host-1gbit.json ";
  const struct {
    std::string args, flag;
  } cases[] = {
      {plan + "--no-such-flag", "--no-such-flag"},
      {plan + "--staging-budget -1", "--staging-budget"},
      {plan + "--staging-budget ' -5GiB'", "--staging-budget"},
      {plan + "--delta-block-bytes 4096", "--delta"},
      {plan + "--delta --delta-block-bytes 1", "--delta-block-bytes"},
      {"bench --delta --delta-block-bytes 63", "--delta-block-bytes"},
      {sim + "--changed-fraction nan", "--changed-fraction"},
      {sim + "--changed-fraction -0.5", "--changed-fraction"},
      {"demo --relay --inference tp=1", "--relay"},
      {"demo --syncs 2 --kill-sync 2", "--kill-sync 2 leaves no sync after it"},
      {"demo --quantize-on consumer", "--quantize"},
      {"bench --delta-block-bytes 4096", "--delta"},
      {"fetch --store tcp://127.0.0.1:1 --model " + kModel + " --trainer tp=1 --inference tp=1 --rank 0 --trace " +
           "/nonexistent-ferry-dir/t.json",
       "--trace"},
  };
  for (const auto& c : cases) {
    CliRun r = ferry(c.args);  // (a hang is killed by ferry()'s timeout and fails here)
    EXPECT_EQ(r.exit_code, 2) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.flag), std::string::npos) << c.args << ": " << r.err;
  }
}

TEST(InputCli, EmptyPipelineStagesAreRefused) {
  CliRun r = ferry("plan --model " + kModel + " --trainer pp=64");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("pp 64 leaves PP stage 32 without layers (the model has 32 layers"), std::string::npos) << r.err;
}

TEST(InputCli, NonFiniteAndNegativeNumbersAreRefused) {
  for (const std::string v : {"nan", "-nan", "inf", "-1", "1e999", "x"}) {
    CliRun r = ferry("check --model " + kModel + " --max-gib " + v);
    EXPECT_NE(r.exit_code, 0) << v;
    EXPECT_NE(r.exit_code, -1) << v;
    EXPECT_NE(r.err.find("--max-gib"), std::string::npos) << v << ": " << r.err;
    EXPECT_EQ(r.err.find("a random checkpoint"), std::string::npos) << v << ": " << r.err;
  }
  CliRun r = ferry("check --model " + kModel + " --seed -1");
  EXPECT_NE(r.err.find("--seed: '-1' is outside [0, "), std::string::npos) << r.err;
  r = ferry("demo --syncs -3");
  EXPECT_NE(r.err.find("--syncs: '-3' is outside [1, 1048576]"), std::string::npos) << r.err;
  r = ferry("demo --kill-rank nan");
  EXPECT_NE(r.err.find("--kill-rank: 'nan' is not a finite number"), std::string::npos) << r.err;
}

// Workers that fail at once are reported at once (with their error), not after the
// driver's whole wait (60 s by default).
TEST(InputCli, DemoReportsAWorkerThatExitedAtOnce) {
  CliRun r = ferry("demo --model " + std::string(FERRY_SOURCE_DIR) + "/configs/qwen3-30b-a3b.json --mode bogus --syncs 1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("exited with status 2 while the driver waited"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sync mode 'bogus': expected pull or push"), std::string::npos) << r.err;
}

// --cut needs emulated hosts, and a host and a sync that the run has; each refusal comes
// before any host is made (no root needed) and names the cut, the range and the option.
// One worker program: `ferry worker --bench` is a bench rank, which takes only the
// options bench ranks have; the demo's options and the bench's do not mix.
TEST(InputCli, BenchWorkerOptionsAreTheBenchRanks) {
  const std::string rank = "worker --role producer --rank 0 --model " + kModel +
                           " --trainer tp=1 --inference tp=1 --store tcp://127.0.0.1:1";
  CliRun r = ferry(rank + " --bench --job j --checksums");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--checksums is not a bench rank's option"), std::string::npos) << r.err;
  r = ferry(rank + " --bench");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--job is required"), std::string::npos) << r.err;
  r = ferry(rank + " --tls tcp,self");  // a bench rank's option without --bench
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--tls requires --bench"), std::string::npos) << r.err;
  r = ferry("bench-worker --role producer");  // the old name is gone
  EXPECT_NE(r.exit_code, 0) << r.err;
}

// A small dense model: 2 layers, so 4 layer groups (embedding, 2 layers, final).
const std::string kSmallDemo = "demo --model " + kModel +
                               " --config-overrides '{\"num_hidden_layers\": 2, \"hidden_size\": 256, "
                               "\"intermediate_size\": 512, \"vocab_size\": 1024, \"num_attention_heads\": 4, "
                               "\"num_key_value_heads\": 2, \"head_dim\": 64}' --trainer tp=2 --inference tp=2 ";

// --kill-point past the last point of a sync failed only after the driver's whole wait
// (67 s, issue 30): refused before any process starts, naming the number of groups.
TEST(InputCli, DemoKillPointPastTheLastGroupIsRefusedAtOnce) {
  const auto t0 = std::chrono::steady_clock::now();
  const CliRun r = ferry(kSmallDemo + "--syncs 3 --kill-sync 2 --kill-point 100000");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--kill-point 100000 is past the last point of a sync: the model has 4 layer groups, so an "
                       "inference rank's points are 0..15"),
            std::string::npos)
      << r.err;
  EXPECT_LT(s, 10.0) << "refused only after " << s << " s";
  // The default demo (the MoE model shrunk) ran 79 s before failing.
  const auto t1 = std::chrono::steady_clock::now();
  const CliRun d = ferry("demo --kill-point 100000");
  const double s1 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  EXPECT_EQ(d.exit_code, 2) << d.err;
  EXPECT_NE(d.err.find("--kill-point 100000 is past the last point of a sync: the model has "), std::string::npos)
      << d.err;
  EXPECT_LT(s1, 10.0) << "refused only after " << s1 << " s";
}

// --kill-sync beside another fault was silently dropped (with --store-restart-sync the
// demo ran without the kill, issue 30): the combination is refused, naming both.
TEST(InputCli, DemoKillWithAnotherFaultIsRefused) {
  CliRun r = ferry(kSmallDemo + "--syncs 3 --kill-sync 2 --store-restart-sync 2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--kill-sync 2 and --store-restart-sync are two faults"), std::string::npos) << r.err;
  r = ferry(kSmallDemo + "--syncs 3 --kill-sync 3 --pause-role consumer --pause-ms 100");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--kill-sync 3 and --pause-role are two faults"), std::string::npos) << r.err;
}

// The demo's table has a torn column (inference ranks whose failed sync left their
// params of two versions; the rows hid it, issue 30).
TEST(InputCli, DemoTableShowsTorn) {
  const auto r = ferry_cli_test::run_command("timeout -s KILL 120 " + std::string(FERRY_BIN) + " " + kSmallDemo +
                                             "--syncs 1 --kill-sync 0");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("verified  torn"), std::string::npos) << r.out;
  unsigned long long version = 0, bytes = 0, broadcast = 0;
  double seconds = 0, gbps = 0;
  int verified = 0, expected = 0, torn = -1;
  bool row = false;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    row = row || std::sscanf(line.c_str(), " %llu %llu %lf %lf %llu %d/%d %d", &version, &bytes, &seconds, &gbps,
                             &broadcast, &verified, &expected, &torn) == 8;
  }
  ASSERT_TRUE(row) << r.out;
  EXPECT_EQ(version, 1u);
  EXPECT_EQ(verified, 2);
  EXPECT_EQ(torn, 0);
}

// fetch --output was checked only when the params were written, after the last sync
// (issue 30): an unusable directory is refused first, before the store is reached.
TEST(InputCli, FetchOutputIsCheckedBeforeAnySync) {
  const std::string fetch = "fetch --store tcp://127.0.0.1:1 --trainer tp=1 --inference tp=1 --rank 0 --model " +
                            kModel + " --output ";
  CliRun r = ferry(fetch + "/proc/ferry-cannot-write-here");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("fetch: --output /proc/ferry-cannot-write-here: cannot create it"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("127.0.0.1:1"), std::string::npos) << "the store was reached first: " << r.err;
  r = ferry(fetch + kModel);  // a file, not a directory
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("fetch: --output " + kModel + ": "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("127.0.0.1:1"), std::string::npos) << "the store was reached first: " << r.err;
}

TEST(InputCli, DemoTimeoutsAreBounded) {
  for (const char* bad : {"--rank-timeout-ms 0", "--stall-ms 5", "--stall-ms nan", "--rank-timeout-ms -1"}) {
    const CliRun r = ferry(std::string("demo ") + bad);
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.exit_code, -1) << bad;
    EXPECT_NE(r.err.find(bad[2] == 'r' ? "--rank-timeout-ms: '" : "--stall-ms: '"), std::string::npos) << r.err;
  }
}

TEST(InputCli, DemoCutIsRefusedWithoutHostsOrOutOfRange) {
  const std::string demo = "demo --model " + kModel + " --trainer tp=2 --inference tp=2,replicas=2 --syncs 3 ";
  CliRun r = ferry(demo + "--cut 1:2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--cut takes an emulated host's link down: give --hosts too"), std::string::npos) << r.err;
  r = ferry(demo + "--hosts 2 --cut 2:2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--cut 2:2: host 2 is outside 0..1 (--hosts 2)"), std::string::npos) << r.err;
  r = ferry(demo + "--hosts 2 --cut 1:1 --cut 1:4:4:500");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--cut 1:4:4:500: sync 4 is outside 1..3 (--syncs 3)"), std::string::npos) << r.err;
  for (const char* bad : {"1", "1:2:x", "1:2:4:", "a:2", "1:2:4:500:9"}) {
    r = ferry(demo + "--hosts 2 --cut " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("expected HOST:SYNC[:POINT[:MS]]"), std::string::npos) << bad << ": " << r.err;
  }
}

// `ferry checkpoint` writes config.json and model.safetensors that serve takes as they
// are (every tensor of the model, at its dtype and shape); a bad model or an unwritable
// directory is an error naming it (exit 2).
TEST(CheckpointCli, WritesACheckpointOfTheModel) {
  char tmpl[] = "/tmp/ferry-ckpt-cli-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto r = ferry_cli_test::run_command(std::string(FERRY_BIN) + " checkpoint --model " + kModel +
                                       " --shrink --config-overrides '{\"num_hidden_layers\": 1}' --seed 3 --out " + dir +
                                       "/c");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("model.safetensors"), std::string::npos) << r.out;
  // serve's own checks (every tensor present, dtype and shape) pass: it gets as far as
  // the store, which is not there.
  r = ferry_cli_test::run_command("FERRY_TOKEN=ferry-cli-test-token-0123 timeout -s KILL 60 " + std::string(FERRY_BIN) +
                                  " serve --store tcp://127.0.0.1:1 " +
                                  "--trainer tp=1 --inference tp=1 --rank 0 --rendezvous-timeout 1000 --checkpoint " +
                                  dir + "/c");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.find("has no tensor"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("127.0.0.1:1"), std::string::npos) << r.err;
  r = ferry("checkpoint --model /nonexistent/config.json --out " + dir + "/d");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/nonexistent/config.json"), std::string::npos) << r.err;
  r = ferry("checkpoint --model " + kModel + " --shrink --out /proc/ferry-cannot-write-here");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("/proc/ferry-cannot-write-here"), std::string::npos) << r.err;
  std::system(("rm -rf " + dir).c_str());
}

// Inputs that ran away (issue 30): each is now refused before the work starts, saying
// what it would need, with exit 2 and never a signal. Run under `ulimit -v` (4 GiB, or
// the 6 GiB of the report), so a regression ends in an allocation failure instead of
// taking the machine's memory: num_experts 1e9 used 5.5-8 GB for 40 s; intermediate_size
// 2^40 and a 70B checkpoint under ulimit -v 6G died of bad_alloc (SIGABRT).
TEST(CheckpointCli, RunawaySizesAreRefusedBeforeTheWork) {
#if FERRY_TEST_SANITIZED
  // The ferry binary under test is sanitized too: it reserves terabytes of shadow memory
  // at start, so no `ulimit -v` can apply to it. The first two sizes are refused by
  // arithmetic before any allocation, with or without a limit; the third is about the
  // limit itself and is checked in the plain build only.
  constexpr bool kSanitized = true;
#else
  constexpr bool kSanitized = false;
#endif
  char tmpl[] = "/tmp/ferry-ckpt-runaway-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  auto checkpoint = [&](const std::string& ulimit_kb, const std::string& args) {
    // (refused before the work: the exit code and message say so, and the cap on the
    // address space turns an allocation of the runaway size into a failure, not a wait)
    return ferry_cli_test::run_command("ulimit -v " + ulimit_kb + "; timeout -s KILL 120 " + std::string(FERRY_BIN) +
                                       " checkpoint --out " + dir + "/c " + args + " >/dev/null");
  };
  const std::string configs = std::string(FERRY_SOURCE_DIR) + "/configs/";
  const std::string cap = kSanitized ? "unlimited" : "4194304";
  auto r = checkpoint(cap, "--model " + configs + "qwen3-30b-a3b.json --config-overrides '{\"num_experts\": 1e9}'");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("field 'num_experts' = 1000000000 is implausible"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("would declare 144000000000 checkpoint tensors"), std::string::npos) << r.err;
  r = checkpoint(cap, "--model " + kModel + " --config-overrides '{\"intermediate_size\": 1099511627776}'");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("over ferry's limit of 1125899906842624 bytes (1 PiB)"), std::string::npos) << r.err;
  if (kSanitized) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "the 70B checkpoint against ulimit -v: plain build only (sanitizers reserve terabytes)";
  }
  r = checkpoint("6291456", "--model " + configs + "llama-3.1-70b.json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("the checkpoint is 141.1 GB (141107412992 bytes), built in memory before it is written: it "
                       "needs 141.1 GB of memory, and this process's address-space limit (ulimit -v) of 6.4 GB leaves"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/c/model.safetensors"));
  std::filesystem::remove_all(dir);
}

// plan --every-rank records a plan per inference rank: 400,000 replicas ran 21-46 s and
// then out of memory (issue 49, finding 7). Refused before recording, from rank 0's plan
// against what the process can allocate: here its ulimit -v (8 GiB), so the refusal does
// not depend on the machine's memory.
TEST(InputCli, EveryRankRecordingThatCannotFitIsRefusedFirst) {
#if FERRY_TEST_SANITIZED
  GTEST_SKIP() << "ulimit -v: plain build only (a sanitized ferry reserves terabytes of shadow memory at start)";
#endif
  CliRun r = ferry_cli_test::run_command(
      "ulimit -v 8388608; timeout -s KILL 60 " + std::string(FERRY_BIN) + " plan --model " + kModel +
      " --trainer tp=1 --inference tp=1,replicas=400000 --every-rank >/dev/null");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--every-rank records a plan per inference rank: 400000 plans"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("address-space limit (ulimit -v)"), std::string::npos) << r.err;
}

// serve / fetch --device: a device that cannot be used, a malformed one, and GPU staging
// without GPU weights end at once, naming them (exit 2), before any store is reached.
TEST(InputCli, RankDeviceOptionsAreCheckedFirst) {
  const std::string common = " --store tcp://127.0.0.1:1 --trainer tp=1 --inference tp=1 --rank 0 --model " + kModel;
  CliRun r = ferry("fetch" + common + " --device gpu0");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("gpu0"), std::string::npos) << r.err;
  r = ferry("serve" + common + " --checkpoint /tmp --gpu-staging");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--gpu-staging needs the weights on a GPU"), std::string::npos) << r.err;
  r = ferry("fetch" + common + " --device cuda:7");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--device cuda:7 cannot be used here"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("127.0.0.1:1"), std::string::npos) << "the store was reached first: " << r.err;
}

// `ferry devices --bandwidth`: without a device it says nothing was measured; on the
// emulated plugin (a device over host memory) it prints the three copy rates.
TEST(DevicesCli, BandwidthIsMeasuredWhereThereIsADevice) {
  auto r = ferry_cli_test::run_command("FERRY_CUDA_PLUGIN=/nonexistent/libferry_cuda.so " + std::string(FERRY_BIN) +
                                       " devices --bandwidth 1000000");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("copy rates: no usable CUDA device, nothing measured"), std::string::npos) << r.out;
#ifdef FERRY_HAVE_EMULATED_CUDA_PLUGIN
  r = ferry_cli_test::run_command(std::string("FERRY_CUDA_PLUGIN=") + ::ferry::test_paths::emulated_cuda_plugin() + " " + FERRY_BIN +
                                  " devices --json --bandwidth 1000000");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* key : {"\"d2d_gbps\":", "\"h2d_gbps\":", "\"d2h_gbps\":"})
    EXPECT_NE(r.out.find(key), std::string::npos) << key << " in " << r.out;
#endif
}

}  // namespace

// `ferry devices` says where the CUDA plugin is (built here when nvcc was found) and,
// when no device can be used, why; a plugin path that does not exist is named.
TEST(DevicesCli, SaysWhatCudaCanDoAndWhy) {
  auto r = ferry_cli_test::run_command(std::string(FERRY_BIN) + " devices --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"host\":true"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"cuda_usable\":"), std::string::npos) << r.out;
  // Which memory each transport moves itself (TransportMemory.CudaSupportIsWhatUcxInfoLists
  // checks the answer against ucx_info).
  EXPECT_NE(r.out.find("\"transports\":{"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"inproc\":{\"cuda_memory\":false"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"ucx\":{\"cuda_memory\":"), std::string::npos) << r.out;
#ifdef FERRY_TEST_HAVE_CUDA
  EXPECT_NE(r.out.find("libferry_cuda.so"), std::string::npos) << r.out;
#endif
  r = ferry_cli_test::run_command("FERRY_CUDA_PLUGIN=/nonexistent/libferry_cuda.so " + std::string(FERRY_BIN) + " devices");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("cuda plugin: none"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("transport ucx moves: host"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/libferry_cuda.so (absent)"), std::string::npos) << r.out;
}
