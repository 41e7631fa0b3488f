// The same 4-host job started only through the rank entry points (`ferry serve`, `ferry
// fetch`; tools/rank_entry.h): once from a shell loop (rank per process in FERRY_RANK),
// once by mpirun (OMPI_COMM_WORLD_RANK over one world of trainer + inference ranks).
// Trainer ranks 0, 1 on hosts 0, 1 serve a safetensors checkpoint from its mapping;
// inference ranks 0-3 on hosts 2, 3 fetch their shards, verify them bit for bit against
// a direct load of the checkpoint and write them as safetensors. The store (`ferry
// store`) runs on host 0.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "multihost/hosts_or_skip.h"
#include "ferry/models.h"
#include "ferry/safetensors.h"
#include "tools/job_model.h"
#include "tools/subprocess.h"
#include "test_paths.h"

namespace ferry::tools {
namespace {

constexpr const char* kTrainer = "tp=2";
constexpr const char* kInference = "tp=2,replicas=2";

struct Job {
  std::string dir;         // config.json + model.safetensors
  std::string out;         // where fetch writes
  std::string token;
  std::vector<std::string> consumer_params;  // names inference rank 0 holds
};

Job make_job() {
  Job j;
  char tmpl[] = "/tmp/ferry-launch-XXXXXX";
  j.dir = ::mkdtemp(tmpl);
  j.out = j.dir + "/out";
  auto m = make_job_model(std::string(FERRY_SOURCE_DIR) + "/configs/llama-3.1-8b.json", kTrainer, kInference,
                                 true, R"({"num_hidden_layers": 2})");
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  if (!m.ok()) return j;
  std::ofstream(j.dir + "/config.json") << m->config.dump();
  auto ckpt = random_checkpoint(m->metadata, 7);
  EXPECT_TRUE(ckpt.ok());
  std::vector<SafetensorsEntry> entries;
  for (const auto& d : m->metadata) entries.push_back({d.name, ckpt->at(d.name)});
  EXPECT_TRUE(write_safetensors(j.dir + "/model.safetensors", entries).ok());
  std::random_device rd;
  j.token = fmt::format("{:08x}{:08x}{:08x}", rd(), rd(), rd());
  auto rl = m->loader->rank(0);
  EXPECT_TRUE(rl.ok());
  for (const TensorDecl& d : (*rl)->final_params()) j.consumer_params.push_back(d.name);
  return j;
}

std::vector<std::string> common_args(const EmulatedHosts& h) {
  return {"--store", fmt::format("tcp://{}:29500", h.address(0)), "--trainer", kTrainer, "--inference", kInference,
          "--job", "launch", "--timeout", "20000", "--rendezvous-timeout", "30000"};
}

std::vector<std::string> serve_args(const EmulatedHosts& h, const Job& j) {
  std::vector<std::string> a = {FERRY_BINARY, "serve"};
  for (auto& s : common_args(h)) a.push_back(s);
  a.insert(a.end(), {"--checkpoint", j.dir});
  return a;
}

std::vector<std::string> fetch_args(const EmulatedHosts& h, const Job& j) {
  std::vector<std::string> a = {FERRY_BINARY, "fetch"};
  for (auto& s : common_args(h)) a.push_back(s);
  a.insert(a.end(), {"--model", j.dir + "/config.json", "--verify", j.dir, "--output", j.out});
  return a;
}

std::string quoted(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "'" : " '") + a + "'";
  return s;
}

// Runs `cmd` (the launcher) with the store running on host 0, bounded; checks every
// rank's JSON line and the files written. `rank_output`: a directory the launcher writes
// each rank's stdout under (mpirun --output-filename), read instead of the launcher's
// own stdout, where mpirun interleaves the ranks' lines in pieces (a 1.7 KB report
// line cut in the middle by another rank's: seen once in five runs).
void run_job(const EmulatedHosts& h, const Job& j, const std::vector<std::string>& launcher,
             const std::string& rank_output = "") {
  ProcessSpec store;
  store.argv = h.exec_prefix(0);
  store.argv.insert(store.argv.end(), {FERRY_BINARY, "store", "--host", h.address(0), "--port", "29500"});
  store.env = environment_with("FERRY_TOKEN", j.token);
  store.log = j.dir + "/store.log";
  store.name = "store";
  auto st = spawn(store);
  ASSERT_TRUE(st.ok());
  ProcessSpec ps;
  ps.argv = launcher;
  ps.env = environment_with("FERRY_TOKEN", j.token);
  ps.log = j.dir + "/launcher.log";
  ps.name = "launcher";
  auto job = spawn(ps);
  ASSERT_TRUE(job.ok());
  const auto status = wait_exit(*job, std::chrono::steady_clock::now() + std::chrono::seconds(90));
  const std::string log = read_log(*job);
  if (!status) terminate(*job, std::chrono::milliseconds(3000));
  terminate(*st, std::chrono::milliseconds(3000));
  ASSERT_TRUE(status.has_value()) << "the job did not finish within 90 s:\n" << log;
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status << ":\n" << log;
  std::string out = log;
  if (!rank_output.empty()) {
    ASSERT_TRUE(std::filesystem::is_directory(rank_output)) << "the launcher wrote no " << rank_output << ":\n" << log;
    out.clear();
    for (const auto& e : std::filesystem::recursive_directory_iterator(rank_output)) {
      if (e.is_regular_file() && e.path().filename() == "stdout") {
        std::ifstream f(e.path());
        out += std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()) + "\n";
      }
    }
  }
  int trainers = 0, inference = 0;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    auto r = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(r.is_discarded()) << line;
    EXPECT_TRUE(r.value("ok", false)) << line;
    EXPECT_GT(r.value("bytes", uint64_t{0}), 0u) << line;
    if (r.value("role", "") == "trainer") {
      ++trainers;
    } else {
      ++inference;
      EXPECT_TRUE(r.value("verified", false)) << line;
      // Inference hosts hold no trainer rank: every byte came over tcp.
      EXPECT_EQ(r["transport"]["reads"], r["transport"]["reads_by_message"]) << line;
    }
  }
  EXPECT_EQ(trainers, 2) << log;
  EXPECT_EQ(inference, 4) << log;
  for (int r = 0; r < 4; ++r) {
    auto f = SafetensorsFile::open(fmt::format("{}/rank-{}.safetensors", j.out, r));
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_EQ(f->size(), j.consumer_params.size());
    for (const auto& name : j.consumer_params) EXPECT_TRUE(f->contains(name)) << name;
  }
}


TEST(MultiHostLaunch, ShellLoop) {
  MAKE_HOSTS_OR_SKIP(hosts, 4, (LinkShape{"1gbit", 0}));
  Job j = make_job();
  ASSERT_FALSE(HasFailure());
  // One line per rank, the rank in the launcher's variable.
  std::string script;
  for (int r = 0; r < 2; ++r) {
    script += fmt::format("FERRY_RANK={} {} {} & pids=\"$pids $!\"\n", r, quoted(hosts->exec_prefix(r)),
                          quoted(serve_args(*hosts, j)));
  }
  for (int r = 0; r < 4; ++r) {
    script += fmt::format("FERRY_RANK={} {} {} & pids=\"$pids $!\"\n", r, quoted(hosts->exec_prefix(2 + r / 2)),
                          quoted(fetch_args(*hosts, j)));
  }
  script += "fail=0; for p in $pids; do wait $p || fail=1; done; exit $fail\n";
  run_job(*hosts, j, {"/bin/sh", "-c", script});
  std::filesystem::remove_all(j.dir);
}

TEST(MultiHostLaunch, Mpirun) {
  if (!is_executable("mpirun")) GTEST_SKIP() << "mpirun (OpenMPI) is not installed";
  MAKE_HOSTS_OR_SKIP(hosts, 4, (LinkShape{"1gbit", 0}));
  Job j = make_job();
  ASSERT_FALSE(HasFailure());
  // One world of 6 (2 trainer + 4 inference ranks), an app context per host: ferry
  // derives each rank of its role from OMPI_COMM_WORLD_RANK / _SIZE.
  std::vector<std::string> argv = {"mpirun", "--oversubscribe", "-x", "FERRY_TOKEN"};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  // Each rank's stdout in a file of its own (mpirun forwards the ranks' output to its
  // own in pieces that interleave).
  const std::string rank_output = j.dir + "/mpirun-output";
  argv.insert(argv.end(), {"--output-filename", rank_output});
  for (int h = 0; h < 4; ++h) {
    if (h > 0) argv.push_back(":");
    argv.insert(argv.end(), {"-np", h < 2 ? "1" : "2"});
    for (auto& a : hosts->exec_prefix(h)) argv.push_back(a);
    for (auto& a : h < 2 ? serve_args(*hosts, j) : fetch_args(*hosts, j)) argv.push_back(a);
  }
  run_job(*hosts, j, argv, rank_output);
  std::filesystem::remove_all(j.dir);
}

}  // namespace
}  // namespace ferry::tools
