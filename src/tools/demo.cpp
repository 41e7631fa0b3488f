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
#include <set>
#include <thread>
#include <atomic>
#include <iterator>
#include <mutex>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/clock.h"
#include "ferry/engine.h"
#include "tools/broadcast.h"
#include "tools/job_model.h"
#include "tools/subprocess.h"
#include "tools/trace_file.h"
#include "tools/transport_options.h"
#include "tools/worker.h"

namespace ferry::tools {
namespace {

using engine::Clock;
using engine::seconds_since;

// Where a worker process writes its part of DemoSpec::trace.
std::string worker_trace_part(const std::string& dir, const std::string& role, int rank, int first_version) {
  return fmt::format("{}/{}{}-from{}.trace.json", dir, role, rank, first_version);
}

// DemoSpec::trace: every worker's part (in name order) merged into one file.
Status merge_worker_traces(const std::string& dir, const std::string& out) {
  std::vector<std::string> parts;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 11 && n.compare(n.size() - 11, 11, ".trace.json") == 0) parts.push_back(e.path().string());
  }
  std::sort(parts.begin(), parts.end());
  return merge_trace_files(parts, out).with_context("ferry demo --trace");
}

// Starts one rank's `ferry worker` process; its log is {dir}/{role}{rank}-from{first_version}.log.
Result<Child> spawn_worker(const DemoSpec& d, const std::string& tls, const std::string& config_path,
                           const std::string& store_url, const std::string& job, const std::string& dir,
                           const std::string& role, int rank, int first_version, int crash_version,
                           int crash_point) {
  std::string pause_at;  // this rank's mid-sync pauses from first_version on
  for (const DemoPause& p : d.pauses) {
    if (p.role != role || p.rank != rank || p.point < 0 || p.version < first_version) continue;
    pause_at += fmt::format("{}{}:{}", pause_at.empty() ? "" : ",", p.version, p.point);
  }
  // A link cut at a rank's point stops that rank there too, for the driver to cut then.
  for (const DemoLinkCut& c : d.link_cuts) {
    if (c.version < first_version) continue;
    if (c.role == "start") {
      pause_at += fmt::format("{}{}:{}", pause_at.empty() ? "" : ",", c.version, kWorkerSyncStartPoint);
    } else if (c.role == role && c.rank == rank) {
      pause_at += fmt::format("{}{}:{}", pause_at.empty() ? "" : ",", c.version, c.point);
    }
  }
  ProcessSpec ps;
  ps.name = fmt::format("{} {}", role, rank);
  ps.log = fmt::format("{}/{}{}-from{}.log", dir, role, rank, first_version);
  if (d.launch_prefix) ps.argv = d.launch_prefix(role, rank);
  ps.argv.insert(ps.argv.end(), {d.worker_binary, "worker", "--role", role, "--rank", std::to_string(rank),
             "--model", config_path, "--trainer", d.trainer, "--inference", d.inference,
             "--store", store_url, "--job", job, "--backend", d.backend, "--mode", d.mode, "--group-order", d.group_order,
             "--convert-on", d.convert_on, "--quantize", d.quantize, "--quantize-on", d.quantize_on,
             "--seed", std::to_string(d.seed), "--first-version", std::to_string(first_version),
             "--last-version", std::to_string(d.syncs), "--crash-version",
             std::to_string(crash_version), "--crash-point", std::to_string(crash_point),
             "--lease-ttl-ms", std::to_string(d.lease_ttl_ms), "--stall-ms", std::to_string(d.stall_ms),
             "--straggler-ms", std::to_string(d.straggler_ms), "--join-window-ms", std::to_string(d.join_window_ms),
             "--commit", d.commit,
             "--timeout-ms", std::to_string(d.rank_timeout_ms)});
  if (!pause_at.empty()) ps.argv.insert(ps.argv.end(), {"--pause-at", pause_at});
  if (d.checksums) ps.argv.push_back("--checksums");
  if (d.relay && role == "consumer") ps.argv.push_back("--relay");
  if (d.delta) ps.argv.insert(ps.argv.end(), {"--delta", "--delta-block-bytes", std::to_string(d.delta_block_bytes)});
  if (d.delta && d.delta_same_host) ps.argv.push_back("--delta-same-host");
  if (d.prepare_weights && role == "producer") ps.argv.push_back("--prepare-weights");
  ps.argv.insert(ps.argv.end(), {"--changed-fraction", fmt::format("{}", d.changed_fraction), "--changes", d.changes});
  if (d.caller_params && role == "consumer") ps.argv.push_back("--caller-params");
  if (role == "producer" && rank == d.corrupt_rank && d.corrupt_sync >= std::max(first_version, 1)) {
    ps.argv.insert(ps.argv.end(), {"--corrupt-version", std::to_string(d.corrupt_sync), "--corrupt-group",
                                   std::to_string(d.corrupt_group)});
  }
  if (role == "consumer" && d.discard_sync >= std::max(first_version, 1))
    ps.argv.insert(ps.argv.end(), {"--discard-version", std::to_string(d.discard_sync)});
  if (!d.trace.empty()) ps.argv.insert(ps.argv.end(), {"--trace", worker_trace_part(dir, role, rank, first_version)});
  if (d.staging_budget) ps.argv.insert(ps.argv.end(), {"--staging-budget", std::to_string(d.staging_budget)});
  // The worker's UCX_TLS (see DemoSpec::ucx_tls); none when `tls` is empty.
  ps.env = environment_with("FERRY_UCX_TLS", tls);
  return spawn(ps);
}

// Whether `pid` is stopped (state T in /proc/PID/stat).
bool is_stopped(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T';
}

// Polls until `pid` is stopped, `stop` turns true or `deadline` passes.
bool await_stopped(pid_t pid, Clock::time_point deadline, const std::atomic<bool>* stop = nullptr) {
  while (!is_stopped(pid)) {
    if (Clock::now() >= deadline || (stop && stop->load())) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// The job's store, as the driver runs it: in this process, as its own `ferry store`
// process, or the caller's (DemoSpec::store_pid / restart_store); how it is paused
// (its pid) and restarted.
struct StoreHost {
  std::unique_ptr<StoreServer> server;  // in this process
  Child child;                          // `ferry store` as a process
  std::string url;
  uint16_t port = 0;
  std::string token;
  std::string log;
  const DemoSpec* d = nullptr;

  pid_t pid() const { return child.pid > 0 ? child.pid : d->store_pid; }

  // Starts `ferry store --port port` and reads its URL from its log.
  Status spawn_process() {
    ProcessSpec ps;
    ps.name = "store";
    ps.log = log;
    ps.argv = {d->worker_binary, "store", "--host", d->store_host, "--port", std::to_string(port)};
    FERRY_ASSIGN_OR_RETURN(child, spawn(ps));
    const auto deadline = Clock::now() + std::chrono::milliseconds(d->timeout_ms);
    for (;;) {
      const std::string text = read_log(child);
      const size_t at = text.find("serving tcp://");
      if (at != std::string::npos && text.find(' ', at + 8) != std::string::npos) {
        url = text.substr(at + 8, text.find(' ', at + 8) - at - 8);
        auto parsed = parse_store_url(url);  // the whole URL, its port in range
        if (!parsed.ok()) return parsed.status().with_context("`ferry store` printed");
        port = parsed->port;
        return Status::Ok();
      }
      if (auto status = wait_exit(child, Clock::now()))
        return unavailable("`ferry store` exited at start (wait status {}): {}", *status, text);
      if (Clock::now() >= deadline) return timeout_error("`ferry store` did not start within {} ms: {}", d->timeout_ms, text);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  Status start_in_process() {
    StoreServerOptions so;
    so.token = token;
    so.host = d->store_host;
    so.port = port;
    auto s = StoreServer::start(so);
    if (!s.ok()) return s.status();
    server = std::move(*s);
    url = server->url();
    port = server->port();
    return Status::Ok();
  }
  // Its data is lost (the embedded store keeps none; the caller's may).
  Status restart() {
    if (server) {
      server->stop();
      server.reset();
      return start_in_process();
    }
    if (child.pid > 0) {
      kill_now(child);  // SIGKILL: nothing is saved, clients see their connections reset
      return spawn_process();
    }
    if (d->restart_store) return d->restart_store();
    return failed_precondition("the store {} is not the driver's to restart (pass DemoSpec::restart_store)", url);
  }
  void stop() {
    if (server) server->stop();
    if (child.pid > 0) kill_now(child);
  }
};

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
  auto model = make_job_model_quantized(d.model, d.trainer, d.inference, d.shrink, d.overrides, d.quantize);
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
  StoreHost host;
  host.d = &d;
  host.log = dir + "/store.log";
  std::string store_url = d.store;
  if (store_url.empty()) {
    std::random_device rd;
    host.token = fmt::format("{:08x}{:08x}", rd(), rd());
    ::setenv("FERRY_TOKEN", host.token.c_str(), 1);
    Status s = d.store_process ? host.spawn_process() : host.start_in_process();
    if (!s.ok()) return fail(s.to_string());
    store_url = host.url;
  }
  host.url = store_url;
  for (const DemoPause& p : d.pauses) {
    if (p.role != "store" && p.role != "consumer" && p.role != "producer")
      return host.stop(), fail("pause role must be consumer, producer or store, not " + p.role);
    if (p.role == "store" && host.pid() <= 0)
      return host.stop(), fail("pausing the store needs it in a process of its own (DemoSpec::store_process, or "
                               "store_pid for the caller's)");
    if (p.ms < 0 || p.version < 1 || p.version > d.syncs)
      return host.stop(), fail(fmt::format("pause of {} {} at sync {} for {} ms: sync outside 1..{} or negative length",
                                           p.role, p.rank, p.version, p.ms, d.syncs));
  }
  for (const DemoLinkCut& c : d.link_cuts) {
    if (!d.set_link) return host.stop(), fail("link cuts need DemoSpec::set_link");
    if ((c.role != "consumer" && c.role != "producer" && c.role != "start") || c.ms < 0 || c.version < 1 ||
        c.version > d.syncs)
      return host.stop(), fail(fmt::format("link cut of host {} at sync {} ({} {}) for {} ms: role must be consumer, "
                                           "producer or start, the sync within 1..{}, the length not negative",
                                           c.host, c.version, c.role, c.rank, c.ms, d.syncs));
  }
  // Every link a cut took down comes back up, on every way out of run_demo.
  struct LinkRestorer {
    const DemoSpec& d;
    std::mutex mu;
    std::set<int> down;
    Status cut(int h) {
      std::lock_guard<std::mutex> lk(mu);
      down.insert(h);
      return d.set_link(h, false);
    }
    Status restore(int h) {
      std::lock_guard<std::mutex> lk(mu);
      down.erase(h);
      return d.set_link(h, true);
    }
    ~LinkRestorer() {
      for (int h : down) d.set_link(h, true).ignore();
    }
  } links{d, {}, {}};
  auto store = Store::open(store_url);
  if (!store.ok()) return fail(store.status().to_string());
  Store& st = **store;
  res.store_url = st.url();
  const std::string job = fmt::format("demo-{}-{}", ::getpid(), std::chrono::steady_clock::now().time_since_epoch().count());
  const int groups = Groups(m.metadata).size();
  std::mt19937_64 rng(d.seed * 7919 + 1);
  std::vector<std::pair<int, int>> kills = d.kills;
  const bool kill_producer = d.kill_role == "producer";
  if (!kill_producer && d.kill_role != "consumer") return fail("kill role must be consumer or producer, not " + d.kill_role);
  const int points = kill_producer ? groups : groups * 4;
  for (auto& k : kills) {
    if (k.second < 0) k.second = static_cast<int>(rng() % static_cast<uint64_t>(points));
    if (k.second >= points) {
      return fail(fmt::format("kill point {} is past the last point of a sync: the model has {} layer groups, so a {}'s "
                              "points are 0..{}", k.second, groups, d.kill_role, points - 1));
    }
  }
  if (d.corrupt_sync != 0 && (d.corrupt_sync < 0 || d.corrupt_sync > d.syncs || d.corrupt_group < 0 ||
                              d.corrupt_group >= groups || d.corrupt_rank < 0 || d.corrupt_rank >= P)) {
    return host.stop(), fail(fmt::format("corruption of group {} by trainer rank {} in sync {}: the sync must be "
                                         "within 1..{}, the group within the model's 0..{}, the rank within 0..{}",
                                         d.corrupt_group, d.corrupt_rank, d.corrupt_sync, d.syncs, groups - 1, P - 1));
  }
  if (d.discard_sync != 0 && (d.discard_sync < 0 || d.discard_sync > d.syncs || d.commit != "shadow")) {
    return host.stop(), fail(fmt::format("discarding sync {}: needs commit shadow (not {}) and a sync within 1..{}",
                                         d.discard_sync, d.commit, d.syncs));
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
  std::set<std::string> exited_clean;  // workers reaped (exit 0) while the driver waited
  auto kill_all = [&] {
    for (auto& c : children) kill_now(c);
    host.stop();
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
  // Waits for `keys` up to the timeout, in slices, checking between them that no worker
  // exited: a worker that fails at once (a bad --mode, a layout it refuses) is reported
  // with its log right away instead of after the whole timeout. `expected_exit` is the
  // child that is meant to die now (the victim of this sync), or -1.
  auto wait_keys = [&](const std::vector<std::string>& keys, int expected_exit = -1) -> Status {
    const auto start = Clock::now();
    const auto deadline = start + std::chrono::milliseconds(d.timeout_ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      Status s = st.wait(keys, std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(200)));
      if (s.code() != StatusCode::kTimeout) return s;
      for (size_t i = 0; i < children.size(); ++i) {
        Child& c = children[i];
        if (static_cast<int>(i) == expected_exit || c.pid <= 0) continue;
        const std::string name = c.name;
        if (auto status = wait_exit(c, Clock::now())) {  // polls once
          // A worker that finished its last version exits 0 while the others (slower to
          // verify, or on a slower host) still write their results: not a failure.
          if (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) {
            exited_clean.insert(name);
            continue;
          }
          const std::string how = WIFEXITED(*status) ? fmt::format("exited with status {}", WEXITSTATUS(*status))
                                  : WIFSIGNALED(*status) ? fmt::format("was killed by signal {}", WTERMSIG(*status))
                                                         : fmt::format("ended (wait status {})", *status);
          return internal_error("{} {} while the driver waited for {} key(s) ({}...); its log:\n{}", name, how,
                                keys.size(), keys.empty() ? std::string() : keys.front(), read_log(c));
        }
      }
      if (Clock::now() >= deadline) {
        // The store's message names its last slice (200 ms): say the whole wait.
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        return Status(s.code(), fmt::format("the driver waited {} ms in all (timeout {} ms): {}", waited, d.timeout_ms,
                                            s.message()));
      }
    }
  };
  auto wait_ready = [&](std::vector<std::string> keys) -> Status { return wait_keys(keys); };
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
    // Between syncs: store restarts, then pauses, before v's go.
    if (std::count(d.store_restarts.begin(), d.store_restarts.end(), v) > 0) {
      if (Status s = host.restart(); !s.ok())
        return kill_all(), fail(fmt::format("restarting the store {} before sync {}: {}", host.url, v, s.to_string()));
      ++res.store_restarts;
      row.paused += "store restarted before the sync; ";
    }
    auto pid_of = [&](const DemoPause& p) -> pid_t {
      if (p.role == "store") return host.pid();
      const bool prod = p.role == "producer";
      if (p.rank < 0 || p.rank >= (prod ? P : C)) return -1;
      return children[static_cast<size_t>(prod ? p.rank : P + p.rank)].pid;
    };
    auto who_of = [](const DemoPause& p) {
      return p.role == "store" ? std::string("store") : fmt::format("{} {}", p.role, p.rank);
    };
    for (const DemoPause& p : d.pauses) {
      if (p.version != v || p.point >= 0) continue;
      const pid_t pid = pid_of(p);
      if (pid <= 0) return kill_all(), fail(fmt::format("sync {}: no process of {} to pause", v, who_of(p)));
      ::kill(pid, SIGSTOP);
      const bool stopped = await_stopped(pid, Clock::now() + std::chrono::milliseconds(d.timeout_ms));
      if (stopped) std::this_thread::sleep_for(std::chrono::milliseconds(p.ms));
      ::kill(pid, SIGCONT);
      if (!stopped) return kill_all(), fail(fmt::format("sync {}: {} did not stop on SIGSTOP", v, who_of(p)));
      ++res.pauses_injected;
      row.paused += fmt::format("{} SIGSTOPped {} ms before the sync; ", who_of(p), p.ms);
    }
    if (auto s = st.set(worker_go_key(job, v), "1"); !s.ok()) return kill_all(), fail(s.to_string());
    // Mid-sync pauses: a rank stops itself at its point (the thread waits to see it
    // stopped), the store is stopped now; each is SIGCONTed `ms` later. Joined before
    // the results are read (and on every return: the guard).
    std::atomic<bool> results_in{false};
    std::mutex pause_mu;
    std::vector<std::thread> pausers;
    struct JoinGuard {
      std::atomic<bool>& over;
      std::vector<std::thread>& threads;
      void join() {
        over = true;
        for (auto& t : threads) t.join();
        threads.clear();
      }
      ~JoinGuard() { join(); }
    } pause_guard{results_in, pausers};
    for (const DemoPause& p : d.pauses) {
      if (p.version != v || p.point < 0) continue;
      const pid_t pid = pid_of(p);
      if (pid <= 0) return kill_all(), fail(fmt::format("sync {}: no process of {} to pause", v, who_of(p)));
      const std::string who = who_of(p);
      pausers.emplace_back([&, p, pid, who] {
        const auto deadline = Clock::now() + std::chrono::milliseconds(d.timeout_ms);
        if (p.role == "store") {
          ::kill(pid, SIGSTOP);
          await_stopped(pid, deadline);
        } else if (!await_stopped(pid, deadline, &results_in)) {
          std::lock_guard<std::mutex> lk(pause_mu);
          res.pauses_not_reached.push_back(fmt::format("sync {}: {} never reached point {}", v, who, p.point));
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(p.ms));
        ::kill(pid, SIGCONT);
        std::lock_guard<std::mutex> lk(pause_mu);
        ++res.pauses_injected;
        row.paused += p.role == "store" ? fmt::format("store SIGSTOPped {} ms at the go; ", p.ms)
                                        : fmt::format("{} SIGSTOPped {} ms at point {}; ", who, p.ms, p.point);
      });
    }
    // Link cuts: down once the rank (every rank, for "start") stopped itself at its
    // point, then they go on; back up `ms` later.
    for (const DemoLinkCut& c : d.link_cuts) {
      if (c.version != v) continue;
      std::vector<pid_t> pids;
      if (c.role == "start") {
        for (const Child& ch : children) pids.push_back(ch.pid);
      } else {
        const bool prod = c.role == "producer";
        if (c.rank < 0 || c.rank >= (prod ? P : C))
          return kill_all(), fail(fmt::format("sync {}: no {} {} to cut a link at", v, c.role, c.rank));
        pids.push_back(children[static_cast<size_t>(prod ? c.rank : P + c.rank)].pid);
      }
      pausers.emplace_back([&, c, pids] {
        const auto deadline = Clock::now() + std::chrono::milliseconds(d.timeout_ms);
        const std::string at = c.role == "start" ? std::string("at the start of every rank's sync")
                                                 : fmt::format("at {} {} point {}", c.role, c.rank, c.point);
        for (pid_t pid : pids) {
          if (await_stopped(pid, deadline, &results_in)) continue;
          for (pid_t q : pids) ::kill(q, SIGCONT);
          std::lock_guard<std::mutex> lk(pause_mu);
          res.pauses_not_reached.push_back(fmt::format("sync {}: link cut of host {} {}: pid {} never stopped there", v,
                                                       c.host, at, pid));
          return;
        }
        Status down = links.cut(c.host);
        for (pid_t pid : pids) ::kill(pid, SIGCONT);
        const auto t0 = Clock::now();
        if (down.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(c.ms));
        Status up = links.restore(c.host);
        std::lock_guard<std::mutex> lk(pause_mu);
        if (!down.ok() || !up.ok()) {
          res.pauses_not_reached.push_back(fmt::format("sync {}: link of host {}: down: {}; up: {}", v, c.host,
                                                       down.to_string(), up.to_string()));
          return;
        }
        ++res.link_cuts_done;
        row.paused += fmt::format("host {} link down {:.0f} ms {}; ", c.host, seconds_since(t0) * 1e3, at);
      });
    }
    // Each result's key and whose it is: kept, never parsed back out of the key.
    std::vector<std::string> keys;
    struct Whose {
      bool consumer;
      int rank;
    };
    std::vector<Whose> whose;
    for (int p = 0; p < P; ++p) {
      if (killing && kill_producer && p == d.kill_rank) continue;
      keys.push_back(worker_result_key(job, v, "producer", p));
      whose.push_back({false, p});
    }
    for (int r = 0; r < C; ++r) {
      if (killing && !kill_producer && r == d.kill_rank) continue;
      keys.push_back(worker_result_key(job, v, "consumer", r));
      whose.push_back({true, r});
    }
    if (Status s = wait_keys(keys, killing ? victim : -1); !s.ok()) {
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
    pause_guard.join();
    double secs = 0;
    std::vector<std::string> notes;
    // For the truth of the reports: who verified v, what each producer said.
    std::set<int> verified_consumers;
    struct ProducerSaid {
      bool ok = false;
      std::set<int> missed;
      std::vector<int> serves;
    };
    std::map<int, ProducerSaid> said;
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::string& k = keys[i];
      const bool is_consumer = whose[i].consumer;
      const int rank = whose[i].rank;
      const std::string name = fmt::format("{}{}", is_consumer ? "consumer" : "producer", rank);
      auto text = st.get(k);
      if (!text.ok()) return kill_all(), fail(text.status().to_string());
      row.results[name] = *text;
      auto j = nlohmann::json::parse(*text, nullptr, false);
      if (is_consumer && j.value("torn", false)) ++row.torn;
      if (is_consumer && j.value("live_verified", false)) ++row.live_verified;
      if (is_consumer) row.mixed_reads += j.value("mixed_reads", uint64_t{0});
      // A failed sync took time and moved bytes too: its row counts them.
      secs = std::max(secs, j.value("seconds", 0.0));
      if (is_consumer && j.value("seconds", 0.0) > row.slowest_seconds) {
        row.slowest_seconds = j.value("seconds", 0.0);
        row.slowest = name;
        row.slowest_stages = j.value("stages", nlohmann::json::object());
      }
      if (is_consumer && j.value("committed", false)) row.stall = std::max(row.stall, j.value("commit_seconds", 0.0));
      if (is_consumer) row.bytes += j.value("bytes", uint64_t{0});
      // What the rank noted on the way (failovers, routes followed), whether or not its
      // sync succeeded: a failed rank's notes are what says how it got there.
      for (const auto& f : j.value("failures", std::vector<std::string>{})) {
        notes.push_back(f);
        row.failures.push_back(f);
      }
      if (!j.value("ok", false)) {
        const std::string e = fmt::format("{}: {}", name, j.value("error", std::string("?")));
        notes.push_back(e);
        if (is_consumer) {
          all_ok = false;
          ++row.expected;
          ++row.failed;
          row.errors.push_back(e);
        }
        continue;
      }
      if (!is_consumer) {
        const int pr = rank;
        row.producer_bytes[static_cast<size_t>(pr)] = j.value("bytes", uint64_t{0});
        ProducerSaid& ps = said[pr];
        ps.ok = j.value("report_ok", false);
        ps.serves = j.value("serves", std::vector<int>{});
        for (int c : j.value("missed", std::vector<int>{})) ps.missed.insert(c);
      }
      if (d.verbose) {
        std::string ph;
        for (const char* name : {"materialize", "pack", "wait", "read", "unpack", "post"}) {
          const double val = j.value(fmt::format("{}_seconds", name), 0.0);
          if (val > 0) ph += fmt::format(" {} {:.3f}", name, val);
        }
        notes.push_back(fmt::format("{}: {:.3f} s:{}", name, j.value("seconds", 0.0), ph));
      }
      if (d.delta && is_consumer && j.contains("patch_bytes")) {  // what each took as patches (docs/delta.md)
        const uint64_t repaired = j.value("patches_repaired", uint64_t{0});
        notes.push_back(fmt::format("{}: {} bytes received, {} of them as patches{}", k.substr(k.rfind('/') + 1),
                                    j.value("bytes", uint64_t{0}), j.value("patch_bytes", uint64_t{0}),
                                    repaired ? fmt::format(", {} patches repaired with dense bytes", repaired) : ""));
      }
      if (is_consumer && j.value("mixed_reads", uint64_t{0}) > 0) {
        all_ok = false;
        notes.push_back(fmt::format("{}: {} of {} reads of the live params during the sync saw a {}",
                                    k.substr(k.rfind('/') + 1), j.value("mixed_reads", uint64_t{0}),
                                    j.value("reads", uint64_t{0}),
                                    d.commit == "groups" ? "layer group half written (first: " +
                                                               j.value("first_mixed_read", std::string("?")) + ")"
                                                         : std::string("mix of versions")));
      } else if (is_consumer && j.contains("split_reads")) {  // commit groups
        notes.push_back(fmt::format("{}: {} reads of the live params during the sync, every layer group whole ({} "
                                    "with groups at both versions); {} groups committed, {:.6f} s in all",
                                    k.substr(k.rfind('/') + 1), j.value("reads", uint64_t{0}),
                                    j.value("split_reads", uint64_t{0}),
                                    j.contains("groups_live") ? j["groups_live"].size() : size_t{0},
                                    j.value("commit_seconds", 0.0)));
      } else if (is_consumer && j.contains("reads")) {
        notes.push_back(fmt::format("{}: {} reads of the live params during the sync, each one version; commit {:.6f} s",
                                    k.substr(k.rfind('/') + 1), j.value("reads", uint64_t{0}),
                                    j.value("commit_seconds", 0.0)));
      }
      if (is_consumer && j.contains("discarded")) {
        // DemoSpec::discard_sync: v received, then discarded (the producers delivered it:
        // for the truth of their reports it counts as verified); the live params must
        // still be the version before, where there was one.
        ++row.expected;
        const bool discarded = j.value("discarded", false);
        if (discarded) {
          ++row.discarded;
          verified_consumers.insert(rank);
        }
        if (discarded && (!j.contains("holds") || j.value("live_verified", false))) {
          notes.push_back(fmt::format("{}: received {}, discarded; live params still {}", name, v,
                                      j.contains("holds") ? j["holds"].dump() : std::string("none")));
        } else {
          all_ok = false;
          notes.push_back(fmt::format("{}: NOT discarded cleanly: received {}, {}{}", name, j["received"].dump(),
                                      j.value("discard_error", std::string("discard ok")),
                                      j.value("live_verified", true) ? ""
                                          : "; live params not the version before: " +
                                                j.value("live_mismatch", std::string("?"))));
        }
      } else if (is_consumer) {
        ++row.expected;
        if (j.value("verified", false)) {
          ++row.verified;
          verified_consumers.insert(rank);
        } else {
          all_ok = false;
          notes.push_back(fmt::format("{}: NOT verified: {}", name, j.value("mismatch", "")));
        }
      }
    }
    row.seconds = secs;
    // A report is true when it says ok only if every consumer it serves verified v, and
    // names in `missed` every one of them that did not.
    std::set<int> missed_any;
    for (const auto& [p, ps] : said) {
      if (ps.ok) ++row.producers_ok;
      missed_any.insert(ps.missed.begin(), ps.missed.end());
      for (int c : ps.serves) {
        if (verified_consumers.count(c)) continue;
        if (ps.ok)
          row.untrue.push_back(fmt::format("producer {} says ok but consumer {}, which it serves, did not verify {}", p, c, v));
        else if (!ps.missed.count(c))
          row.untrue.push_back(fmt::format("consumer {} did not verify {} and producer {}, which serves it, does not name "
                                           "it in missed", c, v, p));
      }
    }
    row.missed = static_cast<int>(missed_any.size());
    for (const auto& u : row.untrue) notes.push_back("UNTRUE: " + u);
    if (!row.paused.empty()) notes.push_back(row.paused);
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
    if (c.pid <= 0 && exited_clean.count(c.name)) continue;
    const auto status = wait_exit(c, exit_deadline);
    if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      all_ok = false;
      res.error += fmt::format("{} did not exit cleanly:\n{}", c.name, logs_of(c));
    }
  }
  kill_all();
  if (!d.trace.empty()) {
    if (Status t = merge_worker_traces(dir, d.trace); !t.ok()) res.error += t.to_string();
  }
  res.all_verified = all_ok && res.error.empty();
  if (res.all_verified) std::filesystem::remove_all(dir);
  return res;
}

}  // namespace ferry::tools
