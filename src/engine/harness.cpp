#include "engine/harness.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "engine/clock.h"
#include "engine/protocol.h"
#include "engine/registered_buffer.h"

namespace ferry::engine {

Result<JobModel> make_job_model_from(const ModelConfig& config, const std::string& trainer,
                                     const std::string& inference) {
  JobModel m;
  m.config = config;
  FERRY_ASSIGN_OR_RETURN(m.inference, InferenceLayout::parse(inference));
  FERRY_ASSIGN_OR_RETURN(m.trainer, TrainerLayout::parse(trainer));
  FERRY_ASSIGN_OR_RETURN(m.loader, make_model_loader(m.config, m.inference));
  m.metadata = m.loader->checkpoint();
  auto th = make_holdings(m.metadata, m.trainer, model_info_from_config(m.config.json()));
  if (!th.ok()) return th.status().with_context(fmt::format("trainer layout {}", trainer));
  m.holdings = std::make_shared<const std::vector<Holdings>>(std::move(th->ranks));
  m.tensor_stage = std::move(th->tensor_stage);
  for (const auto& d : m.metadata) m.checkpoint_bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  return m;
}

Result<JobModel> make_job_model(const std::string& config_path, const std::string& trainer, const std::string& inference,
                                bool shrink, const std::string& overrides) {
  FERRY_ASSIGN_OR_RETURN(auto config, ModelConfig::load(config_path));
  if (shrink) {
    FERRY_ASSIGN_OR_RETURN(auto layout, InferenceLayout::parse(inference));
    FERRY_ASSIGN_OR_RETURN(auto s, shrink_config(config, layout));
    config = s.config;
  }
  if (!overrides.empty()) {
    nlohmann::json j = config.json();
    try {
      j.merge_patch(nlohmann::json::parse(overrides));
    } catch (const std::exception& e) {
      return invalid_argument("config overrides: {}", e.what());
    }
    FERRY_ASSIGN_OR_RETURN(config, ModelConfig::from_json(j, config.path()));
  }
  return make_job_model_from(config, trainer, inference);
}

Result<std::optional<std::string>> verify_params(const JobModel& m, int rank, const TensorMap& params, uint64_t seed,
                                                 uint64_t version) {
  TensorMap ckpt;
  for (const auto& d : m.metadata) ckpt.emplace(d.name, synthetic_tensor(seed, version, d));
  FERRY_ASSIGN_OR_RETURN(auto direct, load_rank_direct(*m.loader, rank, ckpt));
  FERRY_ASSIGN_OR_RETURN(auto rl, m.loader->rank(rank));
  FERRY_ASSIGN_OR_RETURN(auto mm, compare_params(rl->final_params(), direct, params));
  if (!mm.has_value()) return std::optional<std::string>{};
  return std::optional<std::string>(fmt::format("param '{}' index {}: {}", mm->param, mm->index, mm->detail));
}

namespace {

std::string result_key(const WorkerSpec& s, int v) { return fmt::format("{}/result/{}/{}{}", s.job, v, s.role, s.rank); }

int worker_fail(const WorkerSpec& s, const Status& st) {
  std::fprintf(stderr, "ferry worker %s %d: %s\n", s.role.c_str(), s.rank, st.to_string().c_str());
  return 2;
}

}  // namespace

int run_worker(const WorkerSpec& s) {
  auto model = make_job_model(s.model, s.trainer, s.inference, false);
  if (!model.ok()) return worker_fail(s, model.status());
  auto store = Store::open(s.store);
  if (!store.ok()) return worker_fail(s, store.status());
  TransportOptions to;
  to.backend = s.backend;
  if (to.backend == "ucx") {
    const char* tls = std::getenv("FERRY_UCX_TLS");
    // One host: reads and writes over shared memory, messages over loopback tcp (the
    // transport's control endpoints; see DemoSpec::ucx_tls). FERRY_UCX_TLS=tcp,self
    // selects tcp alone, where the transport reads and writes by message.
    to.ucx_config = {{"TLS", tls ? tls : kDefaultUcxTls}};
    if (!tls || std::string(tls).find("tcp") != std::string::npos) to.ucx_config.push_back({"NET_DEVICES", "lo"});
  }
  auto transport = Transport::create(to);
  if (!transport.ok()) return worker_fail(s, transport.status());
  auto mode = parse_sync_mode(s.mode);
  if (!mode.ok()) return worker_fail(s, mode.status());
  EngineOptions eo;
  eo.job = s.job;
  eo.num_producers = model->trainer.world_size();
  eo.num_consumers = model->inference.world_size();
  eo.mode = *mode;
  eo.checksums = s.checksums;
  eo.stall_timeout = std::chrono::milliseconds(s.stall_ms);
  eo.timeout = std::chrono::milliseconds(s.timeout_ms);
  eo.lease_ttl = std::chrono::milliseconds(2000);
  eo.rendezvous_timeout = std::chrono::milliseconds(60000);
  Store& st = **store;
  const auto go_timeout = std::chrono::milliseconds(120000);
  std::unique_ptr<SyntheticSource> source;
  std::unique_ptr<Producer> producer;
  std::unique_ptr<Consumer> consumer;
  int version = 0;
  if (s.role == "producer") {
    source = std::make_unique<SyntheticSource>(model->metadata, model->holdings, s.rank, s.seed);
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    po.test_point = [&s](uint64_t v, int g) {
      if (static_cast<int>(v) == s.crash_version && g == s.crash_point) ::kill(::getpid(), SIGKILL);
    };
    auto p = Producer::create(*source, **transport, st, po);
    if (!p.ok()) return worker_fail(s, p.status());
    producer = std::move(*p);
  } else if (s.role == "consumer") {
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    co.test_point = [&s, &version](int g, int phase) {
      if (version == s.crash_version && g * 4 + phase == s.crash_point) ::kill(::getpid(), SIGKILL);
    };
    auto c = Consumer::create(*model->loader, s.rank, **transport, st, co);
    if (!c.ok()) return worker_fail(s, c.status());
    consumer = std::move(*c);
  } else {
    return worker_fail(s, invalid_argument("unknown role '{}'", s.role));
  }
  if (auto r = st.set(fmt::format("{}/ready/{}{}", s.job, s.role, s.rank), std::to_string(::getpid())); !r.ok())
    return worker_fail(s, r);
  for (version = s.first_version; version <= s.last_version; ++version) {
    const auto v = static_cast<uint64_t>(version);
    if (auto w = st.wait({fmt::format("{}/go/{}", s.job, v)}, go_timeout); !w.ok()) return worker_fail(s, w);
    std::fprintf(stderr, "[%s %d] sync %llu start\n", s.role.c_str(), s.rank, static_cast<unsigned long long>(v));
    nlohmann::json out;
    Result<SyncReport> rep = producer ? (source->set_version(v), producer->sync(v)) : consumer->sync(v);
    out["ok"] = rep.ok();
    if (rep.ok()) {
      out["bytes"] = rep->bytes;
      out["seconds"] = rep->seconds;
      out["dropped"] = rep->dropped;
      out["failures"] = rep->failures;
      out["phases"] = {{"materialize", rep->materialize_seconds}, {"pack", rep->pack_seconds},
                       {"wait", rep->wait_seconds},               {"read", rep->read_seconds},
                       {"unpack", rep->unpack_seconds},           {"post", rep->post_seconds}};
    } else {
      out["error"] = rep.status().to_string();
    }
    if (consumer) {
      out["torn"] = consumer->state().torn;
      if (rep.ok()) {
        auto ver = verify_params(*model, s.rank, consumer->params(), s.seed, v);
        if (!ver.ok()) {
          out["verified"] = false;
          out["mismatch"] = ver.status().to_string();
        } else {
          out["verified"] = !ver->has_value();
          if (ver->has_value()) out["mismatch"] = **ver;
        }
      }
    }
    std::fprintf(stderr, "[%s %d] sync %llu: %s\n", s.role.c_str(), s.rank, static_cast<unsigned long long>(v),
                 out.dump().c_str());
    if (auto w = st.set(result_key(s, version), out.dump()); !w.ok()) return worker_fail(s, w);
  }
  return 0;
}

}  // namespace ferry::engine

// ---------------------------------------------------------------------------------------
// The demo / multi-process driver.

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <random>
#include <thread>

namespace ferry::engine {
namespace {

struct Child {
  pid_t pid = -1;
  std::string role;
  int rank = 0;
  std::string log;
};

Result<Child> spawn_worker(const DemoSpec& d, const std::string& tls, const std::string& config_path,
                           const std::string& store_url, const std::string& job, const std::string& dir,
                           const std::string& role, int rank, int first_version, int crash_version,
                           int crash_point) {
  Child ch;
  ch.role = role;
  ch.rank = rank;
  ch.log = fmt::format("{}/{}{}-from{}.log", dir, role, rank, first_version);
  std::vector<std::string> args = {d.worker_binary, "worker", "--role", role, "--rank", std::to_string(rank),
                                   "--model", config_path, "--trainer", d.trainer, "--inference", d.inference,
                                   "--store", store_url, "--job", job, "--backend", d.backend, "--mode", d.mode,
                                   "--seed", std::to_string(d.seed), "--first-version", std::to_string(first_version),
                                   "--last-version", std::to_string(d.syncs), "--crash-version",
                                   std::to_string(crash_version), "--crash-point", std::to_string(crash_point)};
  if (d.checksums) args.push_back("--checksums");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The worker's environment with FERRY_UCX_TLS set, built before fork: the child of a
  // multithreaded process may only make async-signal-safe calls, so it cannot setenv.
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with("FERRY_UCX_TLS=")) env_text.emplace_back(*e);
  }
  if (!tls.empty()) env_text.push_back("FERRY_UCX_TLS=" + tls);
  std::vector<char*> envp;
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return io_error("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int fd = ::open(ch.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ch.pid = pid;
  return ch;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Resident set (KiB) and open descriptors of a process; -1 when unreadable.
std::pair<int64_t, int64_t> proc_usage(pid_t pid) {
  int64_t rss = -1, fds = 0;
  {
    std::ifstream f(fmt::format("/proc/{}/statm", pid));
    int64_t size = 0, resident = 0;
    if (f >> size >> resident) rss = resident * (::sysconf(_SC_PAGESIZE) / 1024);
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++fds;
  if (ec) fds = -1;
  return {rss, fds};
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
  std::string tls = d.ucx_tls;
  if (tls.empty()) {
    if (const char* e = std::getenv("FERRY_UCX_TLS"); e != nullptr && *e != '\0') tls = e;
  }
  if (tls.empty() && d.backend == "ucx") tls = kDefaultUcxTls;
  res.ucx_tls = tls;
  say(fmt::format("  trainer {} ({} ranks) -> inference {} ({} ranks), mode {}, transport {}{}, store {}\n",
                  m.trainer.to_string(), P, m.inference.to_string(), C, d.mode, d.backend,
                  d.backend == "ucx" ? fmt::format(" (UCX_TLS {})", tls) : std::string(),
                  st.url()));

  std::vector<Child> children;
  auto kill_all = [&] {
    for (auto& c : children) {
      if (c.pid > 0) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
        c.pid = -1;
      }
    }
  };
  auto logs_of = [&](const Child& c) { return read_file(c.log); };
  auto ready_key = [&](const std::string& role, int r) { return fmt::format("{}/ready/{}{}", job, role, r); };
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
    if (auto s = st.set(fmt::format("{}/go/{}", job, v), "1"); !s.ok()) return kill_all(), fail(s.to_string());
    std::vector<std::string> keys;
    for (int p = 0; p < P; ++p) {
      if (killing && kill_producer && p == d.kill_rank) continue;
      keys.push_back(fmt::format("{}/result/{}/producer{}", job, v, p));
    }
    for (int r = 0; r < C; ++r) {
      if (killing && !kill_producer && r == d.kill_rank) continue;
      keys.push_back(fmt::format("{}/result/{}/consumer{}", job, v, r));
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
      for (auto& c : children) logs += fmt::format("--- {} {}\n{}", c.role, c.rank, logs_of(c));
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
      int status = 0;
      const auto t0 = Clock::now();
      pid_t w = 0;
      while ((w = ::waitpid(vc.pid, &status, WNOHANG)) == 0 && seconds_since(t0) * 1000 < d.timeout_ms)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const std::string who = fmt::format("{} rank {}", kill_producer ? "trainer" : "inference", d.kill_rank);
      if (w != vc.pid || !WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL) {
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
  // Every worker exits after the last version.
  const auto t0 = Clock::now();
  for (auto& c : children) {
    int status = 0;
    pid_t w = 0;
    while ((w = ::waitpid(c.pid, &status, WNOHANG)) == 0 && seconds_since(t0) * 1000 < d.timeout_ms)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (w == c.pid && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      c.pid = -1;
    } else {
      all_ok = false;
      res.error += fmt::format("{} {} did not exit cleanly:\n{}", c.role, c.rank, logs_of(c));
    }
  }
  kill_all();
  if (server) server->stop();
  res.all_verified = all_ok && res.error.empty();
  if (res.all_verified) std::filesystem::remove_all(dir);
  return res;
}

}  // namespace ferry::engine
