#include "tools/demo.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/clock.h"
#include "ferry/engine.h"
#include "tools/broadcast.h"
#include "tools/job_model.h"
#include "tools/subprocess.h"
#include "tools/transport_options.h"
#include "tools/worker.h"

namespace ferry::tools {
namespace {

using engine::Clock;
using engine::seconds_since;

// Starts one rank's `ferry worker` process; its log is {dir}/{role}{rank}-from{first_version}.log.
Result<Child> spawn_worker(const DemoSpec& d, const std::string& tls, const std::string& config_path,
                           const std::string& store_url, const std::string& job, const std::string& dir,
                           const std::string& role, int rank, int first_version, int crash_version,
                           int crash_point) {
  ProcessSpec ps;
  ps.name = fmt::format("{} {}", role, rank);
  ps.log = fmt::format("{}/{}{}-from{}.log", dir, role, rank, first_version);
  ps.argv = {d.worker_binary, "worker", "--role", role, "--rank", std::to_string(rank),
             "--model", config_path, "--trainer", d.trainer, "--inference", d.inference,
             "--store", store_url, "--job", job, "--backend", d.backend, "--mode", d.mode,
             "--seed", std::to_string(d.seed), "--first-version", std::to_string(first_version),
             "--last-version", std::to_string(d.syncs), "--crash-version",
             std::to_string(crash_version), "--crash-point", std::to_string(crash_point)};
  if (d.checksums) ps.argv.push_back("--checksums");
  // The worker's UCX_TLS (see DemoSpec::ucx_tls); none when `tls` is empty.
  ps.env = environment_with("FERRY_UCX_TLS", tls);
  return spawn(ps);
}

}  // namespace

DemoResult run_demo(const DemoSpec& d) {
  DemoResult res;
  auto say = [&](const std::string& s) {
    if (!d.quiet) {
      std::fputs(s.c_str(), stdout);
      std::fflush(stdout);
    }
  };
  auto fail = [&](const std::string& e) {
    res.error = e;
    return res;
  };
  auto model = make_job_model(d.model, d.trainer, d.inference, d.shrink, d.overrides);
  if (!model.ok()) return fail(model.status().to_string());
  const JobModel& m = *model;
  const int P = m.trainer.world_size(), C = m.inference.world_size();
  char tmpl[] = "/tmp/ferry-demo-XXXXXX";
  if (!::mkdtemp(tmpl)) return fail("mkdtemp failed");
  const std::string dir = tmpl;
  const std::string config_path = dir + "/config.json";
  {
    std::ofstream f(config_path);
    f << m.config.dump();
  }
  std::unique_ptr<StoreServer> server;
  std::string store_url = d.store;
  if (store_url.empty()) {
    std::random_device rd;
    const std::string token = fmt::format("{:08x}{:08x}", rd(), rd());
    ::setenv("FERRY_TOKEN", token.c_str(), 1);
    StoreServerOptions so;
    so.token = token;
    auto s = StoreServer::start(so);
    if (!s.ok()) return fail(s.status().to_string());
    server = std::move(*s);
    store_url = server->url();
  }
  auto store = Store::open(store_url);
  if (!store.ok()) return fail(store.status().to_string());
  Store& st = **store;
  const std::string job = fmt::format("demo-{}-{}", ::getpid(), std::chrono::steady_clock::now().time_since_epoch().count());
  const int groups = Groups(m.metadata).size();
  std::mt19937_64 rng(d.seed * 7919 + 1);
  std::vector<std::pair<int, int>> kills = d.kills;
  const bool kill_producer = d.kill_role == "producer";
  if (!kill_producer && d.kill_role != "consumer") return fail("kill role must be consumer or producer, not " + d.kill_role);
  const int points = kill_producer ? groups : groups * 4;
  for (auto& k : kills) {
    if (k.second < 0) k.second = static_cast<int>(rng() % static_cast<uint64_t>(points));
  }
  size_t next_kill = 0;
  auto victim_crash = [&](int from_version) -> std::pair<int, int> {
    while (next_kill < kills.size() && kills[next_kill].first < from_version) ++next_kill;
    if (next_kill < kills.size()) return kills[next_kill];
    return {-1, 0};
  };
  auto rinfo = m.inference.rank(0);
  say(fmt::format("ferry demo: {} ({}), checkpoint {:.1f} MB, {} tensors, {} groups\n", m.config.architecture(),
                  d.model, static_cast<double>(m.checkpoint_bytes) / 1e6, m.metadata.size(), groups));
  // Workers' UCX_TLS (see DemoSpec::ucx_tls).
  std::string tls = d.ucx_tls.empty() ? default_worker_tls(d.backend) : d.ucx_tls;
  res.ucx_tls = tls;
  say(fmt::format("  trainer {} ({} ranks) -> inference {} ({} ranks), mode {}, transport {}{}, store {}\n",
                  m.trainer.to_string(), P, m.inference.to_string(), C, d.mode, d.backend,
                  tls.empty() ? std::string() : fmt::format(" (UCX_TLS {})", tls),
                  st.url()));

  std::vector<Child> children;
  auto kill_all = [&] {
    for (auto& c : children) kill_now(c);
  };
  auto logs_of = [&](const Child& c) { return read_log(c); };
  auto ready_key = [&](const std::string& role, int r) { return worker_ready_key(job, role, r); };
  int victim = -1;
  for (int i = 0; i < P + C; ++i) {
    const bool producer = i < P;
    const int r = producer ? i : i - P;
    const bool is_victim = producer == kill_producer && r == d.kill_rank && !kills.empty();
    auto [cv, cp] = is_victim ? victim_crash(1) : std::pair<int, int>{-1, 0};
    auto c = spawn_worker(d, tls, config_path, store_url, job, dir, producer ? "producer" : "consumer", r, 1, cv, cp);
    if (!c.ok()) return kill_all(), fail(c.status().to_string());
    if (is_victim) victim = static_cast<int>(children.size());
    children.push_back(*c);
  }
  if (!kills.empty() && victim < 0) return kill_all(), fail(fmt::format("no {} rank {} to kill", d.kill_role, d.kill_rank));
  auto wait_ready = [&](std::vector<std::string> keys) -> Status {
    return st.wait(keys, std::chrono::milliseconds(d.timeout_ms));
  };
  const auto t_start = Clock::now();
  {
    std::vector<std::string> keys;
    for (int p = 0; p < P; ++p) keys.push_back(ready_key("producer", p));
    for (int r = 0; r < C; ++r) keys.push_back(ready_key("consumer", r));
    if (Status s = wait_ready(keys); !s.ok()) {
      std::string logs;
      for (auto& c : children) logs += logs_of(c);
      kill_all();
      return fail("ranks did not become ready: " + s.to_string() + "\n" + logs);
    }
  }
  say(fmt::format("  {} trainer + {} inference processes ready in {:.2f} s (plans recorded, routes built)\n", P, C,
                  seconds_since(t_start)));
  const auto bc = broadcast_baseline(m.metadata, m.tensor_stage, C);
  bool all_ok = true;
  bool killed_prev = false;
  const int soak_base = std::max(1, std::min(10, d.syncs / 4));
  std::map<pid_t, std::pair<int64_t, int64_t>> base_usage;
  for (int v = 1; v <= d.syncs; ++v) {
    DemoSyncRow row;
    row.version = v;
    row.broadcast_bytes = bc.bytes;
    row.producer_bytes.assign(static_cast<size_t>(P), 0);
    const auto crash = victim >= 0 ? victim_crash(v) : std::pair<int, int>{-1, 0};
    const bool killing = victim >= 0 && crash.first == v;
    if (auto s = st.set(worker_go_key(job, v), "1"); !s.ok()) return kill_all(), fail(s.to_string());
    std::vector<std::string> keys;
    for (int p = 0; p < P; ++p) {
      if (killing && kill_producer && p == d.kill_rank) continue;
      keys.push_back(worker_result_key(job, v, "producer", p));
    }
    for (int r = 0; r < C; ++r) {
      if (killing && !kill_producer && r == d.kill_rank) continue;
      keys.push_back(worker_result_key(job, v, "consumer", r));
    }
    if (Status s = st.wait(keys, std::chrono::milliseconds(d.timeout_ms)); !s.ok()) {
      if (std::getenv("FERRY_DEMO_GDB")) {
        for (auto& c : children) {
          if (c.pid <= 0) continue;
          const std::string cmd = fmt::format("gdb -p {} -batch -ex 'thread apply all bt' >> {} 2>&1", c.pid, c.log);
          (void)!std::system(cmd.c_str());
        }
      }
      std::string logs;
      for (auto& c : children) logs += fmt::format("--- {}\n{}", c.name, logs_of(c));
      kill_all();
      return fail(fmt::format("sync {}: {}\n{}", v, s.to_string(), logs));
    }
    double secs = 0;
    std::vector<std::string> notes;
    for (const auto& k : keys) {
      auto text = st.get(k);
      if (!text.ok()) return kill_all(), fail(text.status().to_string());
      auto j = nlohmann::json::parse(*text, nullptr, false);
      const bool is_consumer = k.find("consumer") != std::string::npos;
      if (is_consumer && j.value("torn", false)) ++row.torn;
      if (!j.value("ok", false)) {
        const std::string e = fmt::format("{}: {}", k.substr(k.rfind('/') + 1), j.value("error", std::string("?")));
        notes.push_back(e);
        if (is_consumer) {
          all_ok = false;
          ++row.expected;
          ++row.failed;
          row.errors.push_back(e);
        }
        continue;
      }
      secs = std::max(secs, j.value("seconds", 0.0));
      if (!is_consumer) {
        const int pr = std::atoi(k.c_str() + k.rfind("producer") + 8);
        if (pr >= 0 && pr < P) row.producer_bytes[static_cast<size_t>(pr)] = j.value("bytes", uint64_t{0});
      }
      if (d.verbose && j.contains("phases")) {
        std::string ph;
        for (auto& [name, val] : j["phases"].items()) {
          if (val.get<double>() > 0) ph += fmt::format(" {} {:.3f}", name, val.get<double>());
        }
        notes.push_back(fmt::format("{}: {:.3f} s:{}", k.substr(k.rfind('/') + 1), j.value("seconds", 0.0), ph));
      }
      for (const auto& f : j.value("failures", std::vector<std::string>{})) {
        notes.push_back(f);
        row.failures.push_back(f);
      }
      if (is_consumer) {
        row.bytes += j.value("bytes", uint64_t{0});
        ++row.expected;
        if (j.value("verified", false)) {
          ++row.verified;
        } else {
          all_ok = false;
          notes.push_back(fmt::format("{}: NOT verified: {}", k.substr(k.rfind('/') + 1), j.value("mismatch", "")));
        }
      }
    }
    row.seconds = secs;
    std::string killed;
    if (killing) {
      // The victim SIGKILLed itself at its crash point; reap it and restart it.
      Child& vc = children[static_cast<size_t>(victim)];
      const auto status = wait_exit(vc, Clock::now() + std::chrono::milliseconds(d.timeout_ms));
      const std::string who = fmt::format("{} rank {}", kill_producer ? "trainer" : "inference", d.kill_rank);
      if (!status || !WIFSIGNALED(*status) || WTERMSIG(*status) != SIGKILL) {
        std::string logs = logs_of(vc);
        kill_all();
        return fail(fmt::format("sync {}: {} was to be SIGKILLed but was not\n{}", v, who, logs));
      }
      killed = kill_producer ? fmt::format("{} SIGKILLed at group {}", who, crash.second)
                             : fmt::format("{} SIGKILLed at group {} phase {}", who, crash.second / 4, crash.second % 4);
      row.note = who + " killed";
      if (v < d.syncs) {
        st.remove(ready_key(d.kill_role, d.kill_rank)).status().ignore();
        auto [cv, cp] = victim_crash(v + 1);
        auto c = spawn_worker(d, tls, config_path, store_url, job, dir, d.kill_role, d.kill_rank, v + 1, cv, cp);
        if (!c.ok()) return kill_all(), fail(c.status().to_string());
        vc = *c;
        if (Status s = wait_ready({ready_key(d.kill_role, d.kill_rank)}); !s.ok()) {
          std::string logs = logs_of(vc);
          kill_all();
          return fail("restarted rank not ready: " + s.to_string() + "\n" + logs);
        }
      }
    } else if (killed_prev) {
      row.note = "restarted rank caught up";
    }
    killed_prev = killing;
    res.rows.push_back(row);
    if (d.syncs >= 3 && (v == soak_base || v == d.syncs - 1)) {
      for (auto& c : children) {
        if (c.pid <= 0) continue;
        auto u = proc_usage(c.pid);
        if (v == soak_base) {
          base_usage[c.pid] = u;
        } else if (auto it = base_usage.find(c.pid); it != base_usage.end() && u.first >= 0 && it->second.first >= 0) {
          res.max_rss_growth_kib = std::max(res.max_rss_growth_kib, u.first - it->second.first);
          res.max_fd_growth = std::max(res.max_fd_growth, u.second - it->second.second);
        }
      }
    }
    say(fmt::format("  sync {}: {:.1f} MB in {:.3f} s ({:.2f} GB/s), verified {}/{}{}\n", v,
                    static_cast<double>(row.bytes) / 1e6, row.seconds,
                    row.seconds > 0 ? static_cast<double>(row.bytes) / row.seconds / 1e9 : 0.0, row.verified,
                    row.expected, killed.empty() ? "" : "; " + killed));
    if (!d.quiet) {
      for (const auto& n : notes) say("    " + n + "\n");
    }
  }
  // Every worker exits after the last version (within one timeout for all of them). A
  // victim killed in the last sync was reaped and not restarted: it counts as not clean.
  const auto exit_deadline = Clock::now() + std::chrono::milliseconds(d.timeout_ms);
  for (auto& c : children) {
    const auto status = wait_exit(c, exit_deadline);
    if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      all_ok = false;
      res.error += fmt::format("{} did not exit cleanly:\n{}", c.name, logs_of(c));
    }
  }
  kill_all();
  if (server) server->stop();
  res.all_verified = all_ok && res.error.empty();
  if (res.all_verified) std::filesystem::remove_all(dir);
  return res;
}

}  // namespace ferry::tools
