// `ferry bench` (tools/bench.h), the driver: estimates the memory of every process and
// refuses what the machine cannot fit, starts the ranks (`ferry worker --bench`,
// bench_worker.cpp) and the broadcast baseline's MPI ranks, runs the interleaved steps
// (tools/bench_steps.h) and reports their medians.
#include "tools/bench.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "engine/clock.h"
#include "engine/memory.h"
#include "engine/registered_buffer.h"
#include "engine/report_json.h"
#include "engine/schedule.h"
#include "ferry/engine.h"
#include "tools/bench_steps.h"
#include "tools/broadcast.h"
#include "tools/job_model.h"
#include "tools/percentile.h"
#include "tools/proc_memory.h"
#include "tools/subprocess.h"
#include "tools/trace_file.h"

namespace ferry::tools {
namespace {

using engine::align_up;
using engine::Clock;
using engine::seconds_since;
using bench_steps::key_go;
using bench_steps::key_ready;
using bench_steps::key_result;
using bench_steps::mono_ns;

std::string tail(const std::string& text, size_t n = 3000) { return text.size() > n ? text.substr(text.size() - n) : text; }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void progress(const std::string& s) {
  std::fputs(s.c_str(), stderr);
  std::fflush(stderr);
}

std::string gib(uint64_t b) { return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1ull << 30)); }

// What one process of the bench holds beside its share: the executable, its libraries,
// UCX or MPI, the job model (measured: ~60-90 MiB per rank on Debian 12).
constexpr uint64_t kProcessBase = 128ull << 20;

struct BenchMemoryEstimate {
  uint64_t total = 0;
  nlohmann::json json;  // per role: the largest rank's figures by kind
  MemoryPrediction engine;  // predict_memory's, per rank (each rank's report is compared with it)
};

// Every process of the bench, before any starts: each producer's weights shard, one
// group of its generator, the engine's extra memory (predict_memory), its raw and staged
// rings; each consumer's params, the engine's extra, its raw ring, memcpy source, staged
// ring and staged params, and verification (a direct load: params plus one tensor); each
// MPI rank's share (root: its stage's tensors; inference: params, one tensor received,
// verification); kProcessBase per process.
// `po`: the engine options every rank runs (mode, delta), as predict_memory reads them.
Result<BenchMemoryEstimate> estimate_bench_memory(const JobModel& m, CommitPolicy commit, ConvertOn convert_on,
                                                  const ProducerOptions& po) {
  RouterOptions ro;
  ro.convert_on = convert_on;
  ro.quantize_on = po.quantize_on;
  const int P = m.trainer.world_size(), C = m.inference.world_size(), S = m.trainer.pp;
  std::vector<Plan> plans;
  for (int c = 0; c < C; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto plan, record_plan(*m.loader, c, m.metadata));
    plans.push_back(std::move(plan));
  }
  RouterInput in;
  in.metadata = m.metadata;
  in.producers = *m.holdings;
  for (const Plan& p : plans) in.consumers.push_back(&p);
  FERRY_ASSIGN_OR_RETURN(auto routes, build_routes(in, ro));
  FERRY_ASSIGN_OR_RETURN(auto engine_mem, predict_memory(routes, m.metadata, in.producers, in.consumers, po, commit));
  const Groups groups(m.metadata);
  uint64_t largest_tensor = 0;
  std::vector<uint64_t> stage_bytes(static_cast<size_t>(S), 0);
  for (size_t i = 0; i < m.metadata.size(); ++i) {
    const uint64_t n = static_cast<uint64_t>(shape_numel(m.metadata[i].shape)) * dtype_size(m.metadata[i].dtype);
    largest_tensor = std::max(largest_tensor, n);
    stage_bytes[static_cast<size_t>(m.tensor_stage[i])] += n;
  }
  BenchMemoryEstimate e;
  nlohmann::json prod, cons;
  for (int p = 0; p < P; ++p) {
    const Holdings& h = (*m.holdings)[static_cast<size_t>(p)];
    std::vector<uint64_t> per_group(static_cast<size_t>(groups.size()), 0);
    for (const HeldBox& x : h.boxes)
      per_group[static_cast<size_t>(groups.of_name(h.tensors[x.tensor].name))] +=
          static_cast<uint64_t>(x.box.numel()) * dtype_size(h.tensors[x.tensor].dtype);
    uint64_t staged_slot = 0;
    for (const auto& g : routes.producers[static_cast<size_t>(p)].groups) staged_slot = std::max(staged_slot, align_up(g.staging_bytes, 64));
    const uint64_t raw_slot = engine::producer_slot_bytes(routes, p, m.metadata, *m.holdings, false);
    const nlohmann::json r = {{"held", h.bytes()},
                              {"generator", *std::max_element(per_group.begin(), per_group.end())},
                              {"engine", engine_mem.producers[static_cast<size_t>(p)].extra()},
                              {"raw_ring", engine::registered_bytes(2 * raw_slot)},
                              {"staged_ring", engine::registered_bytes(2 * staged_slot)},
                              {"process", kProcessBase}};
    uint64_t sum = 0;
    for (const auto& [k, v] : r.items()) sum += v.get<uint64_t>();
    e.total += sum;
    if (prod.is_null() || sum > prod["total"].get<uint64_t>()) {
      prod = r;
      prod["total"] = sum;
    }
  }
  uint64_t max_params = 0;
  for (int c = 0; c < C; ++c) {
    const PlanRoute& pr = routes.consumer(static_cast<size_t>(c));
    uint64_t params = 0, staged_slot = 0;
    for (const auto& d : pr.params) params += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
    for (const auto& g : pr.groups) staged_slot = std::max(staged_slot, align_up(g.recv_bytes, 64));
    max_params = std::max(max_params, params);
    const uint64_t ring2 = engine::registered_bytes(2 * engine::consumer_slot_bytes(pr));
    // ("engine" includes the shadow params under --commit shadow: predict_memory's.)
    const nlohmann::json r = {{"held", params},          {"engine", engine_mem.consumers[static_cast<size_t>(c)].extra()},
                              {"raw_ring", ring2},       {"memcpy_source", ring2},
                              {"staged_ring", engine::registered_bytes(2 * staged_slot)},
                              {"staged_params", params}, {"verify", params + largest_tensor},
                              {"process", kProcessBase}};
    uint64_t sum = 0;
    for (const auto& [k, v] : r.items()) sum += v.get<uint64_t>();
    e.total += sum;
    if (cons.is_null() || sum > cons["total"].get<uint64_t>()) {
      cons = r;
      cons["total"] = sum;
    }
  }
  uint64_t max_stage = *std::max_element(stage_bytes.begin(), stage_bytes.end());
  const uint64_t mpi_root = max_stage + largest_tensor + kProcessBase;
  const uint64_t mpi_inference = max_params + largest_tensor + (max_params + largest_tensor) + kProcessBase;
  e.total += static_cast<uint64_t>(S) * mpi_root + static_cast<uint64_t>(C) * mpi_inference + kProcessBase;
  e.json = {{"producer", prod},           {"consumer", cons},
            {"mpi_root", mpi_root},       {"mpi_inference", mpi_inference},
            {"producers", P},             {"consumers", C},
            {"mpi_roots", S},             {"driver", kProcessBase},
            {"total", e.total}};
  e.engine = std::move(engine_mem);
  return e;
}

// Splits "--mca a b --mca c d" into words.
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string w;
  while (ss >> w) out.push_back(w);
  return out;
}

}  // namespace

BenchResult run_bench(const BenchSpec& b) {
  BenchResult res;
  auto fail = [&](const std::string& e) {
    res.error = e;
    return res;
  };
  // The broadcast baseline needs MPI: refuse before spending a minute on the rest.
  if (!b.estimate_only && !is_executable(b.mpirun))
    return fail(fmt::format("'{}' not found: the broadcast baseline runs OpenMPI (Debian: openmpi-bin "
                            "libopenmpi-dev; scripts/install-deps.sh installs them)",
                            b.mpirun));
  if (!b.estimate_only && (b.mpi_binary.empty() || ::access(b.mpi_binary.c_str(), X_OK) != 0))
    return fail(fmt::format("'{}' not found: ferry was built without MPI (install libopenmpi-dev and reconfigure)",
                            b.mpi_binary.empty() ? "ferry-mpi-bcast" : b.mpi_binary));
  if (b.syncs < 1) return fail("--syncs must be at least 1");
  auto model = make_job_model_quantized(b.model, b.trainer, b.inference, b.shrink, b.overrides, b.quantize);
  if (!model.ok()) return fail(model.status().to_string());
  const JobModel& m = *model;
  const int P = m.trainer.world_size(), C = m.inference.world_size(), S = m.trainer.pp;
  // What every process will hold, before any starts: refuse a model this machine cannot
  // fit rather than let the kernel's OOM killer end the bench half way.
  auto policy = parse_commit_policy(b.commit);
  if (!policy.ok()) return fail(policy.status().to_string());
  const auto convert_on = parse_convert_on(b.convert_on);
  if (!convert_on) return fail(fmt::format("--convert-on: '{}' is not producer or consumer", b.convert_on));
  if (auto ch = parse_synthetic_changes(b.changed_fraction, b.changes); !ch.ok()) return fail(ch.status().to_string());
  ProducerOptions engine_options;  // what predict_memory reads of the ranks' options
  engine_options.mode = b.mode == "push" ? SyncMode::kPush : SyncMode::kPull;
  engine_options.delta = b.delta;
  engine_options.delta_block_bytes = b.delta_block_bytes;
  const auto quantize_on = parse_quantize_on(b.quantize_on);
  if (!quantize_on) return fail(fmt::format("--quantize-on: '{}' is not producer or consumer", b.quantize_on));
  engine_options.quantize_on = *quantize_on;
  auto estimate = estimate_bench_memory(m, *policy, *convert_on, engine_options);
  if (!estimate.ok()) return fail(estimate.status().to_string());
  {
    auto avail = mem_available_bytes();
    if (b.estimate_only) {
      res.json = {{"memory_estimate", estimate->json},
                  {"estimate_bytes", estimate->total},
                  {"mem_available_bytes", avail.ok() ? *avail : 0},
                  {"fits", avail.ok() && estimate->total <= *avail},
                  {"checkpoint_bytes", m.checkpoint_bytes}};
      return res;
    }
    if (avail.ok() && estimate->total > *avail)
      return fail(fmt::format("the bench of this model needs an estimated {} of memory and the machine has {} "
                              "available (MemAvailable); use a smaller model (fewer layers) or free memory. "
                              "Estimate: {}",
                              gib(estimate->total), gib(*avail), estimate->json.dump()));
    progress(fmt::format("  memory: estimated {} for every process of the bench ({} available)\n", gib(estimate->total),
                         avail.ok() ? gib(*avail) : std::string("? ")));
  }
  char tmpl[] = "/tmp/ferry-bench-XXXXXX";
  if (!::mkdtemp(tmpl)) return fail("mkdtemp failed");
  const std::string dir = tmpl;
  const std::string config_path = dir + "/config.json";
  {
    std::ofstream f(config_path);
    f << m.config.dump();
  }
  std::random_device rd;
  const std::string token = fmt::format("{:08x}{:08x}", rd(), rd());
  ::setenv("FERRY_TOKEN", token.c_str(), 1);
  StoreServerOptions so;
  so.token = token;
  auto server = StoreServer::start(so);
  if (!server.ok()) return fail(server.status().to_string());
  auto store = Store::open((*server)->url());
  if (!store.ok()) return fail(store.status().to_string());
  Store& st = **store;
  const std::string job = fmt::format("bench-{}", ::getpid());
  const auto bcb = broadcast_baseline(m.metadata, m.tensor_stage, C);
  progress(fmt::format("ferry bench: {} ({}), checkpoint {:.1f} MB, {} tensors, {} groups\n", m.config.architecture(),
                       b.model, static_cast<double>(m.checkpoint_bytes) / 1e6, m.metadata.size(),
                       Groups(m.metadata).size()));
  progress(fmt::format("  trainer {} ({} ranks) -> inference {} ({} ranks), UCX_TLS={}, mode {}\n",
                       m.trainer.to_string(), P, m.inference.to_string(), C, b.tls, b.mode));
  const char* raw_name = b.mode == "push" ? "raw writes" : "raw reads";

  std::vector<Child> procs;
  auto kill_all = [&] {
    for (auto& p : procs) {
      // mpirun passes SIGTERM on to its ranks (a SIGKILLed mpirun would orphan them).
      if (p.name == "mpirun") {
        terminate(p, std::chrono::milliseconds(3000));
      } else {
        kill_now(p);
      }
    }
  };
  auto logs = [&] {
    std::string s;
    for (auto& p : procs) s += fmt::format("--- {}\n{}", p.name, tail(read_log(p)));
    return s;
  };
  // Every process of the bench: stdout and stderr to its log, this process's environment.
  auto spawn_proc = [](std::vector<std::string> argv, const std::string& name, const std::string& log) {
    ProcessSpec ps;
    ps.argv = std::move(argv);
    ps.name = name;
    ps.log = log;
    return spawn(ps);
  };
  const auto t_start = Clock::now();
  for (int k = 0; k < P + C; ++k) {
    const bool prod = k < P;
    const std::string role = prod ? "producer" : "consumer";
    const int rank = prod ? k : k - P;
    std::vector<std::string> args = {b.worker_binary, "worker", "--bench", "--role", role, "--rank", std::to_string(rank),
                                     "--model", config_path, "--trainer", b.trainer, "--inference", b.inference,
                                     "--store", (*server)->url(), "--job", job, "--tls", b.tls, "--mode", b.mode, "--group-order", b.group_order, "--convert-on", b.convert_on, "--quantize", b.quantize, "--quantize-on", b.quantize_on, "--seed",
                                     std::to_string(b.seed), "--timeout-ms", std::to_string(b.timeout_ms),
                                     "--in-place", b.in_place ? "1" : "0", "--commit", b.commit,
                                     "--changed-fraction", fmt::format("{}", b.changed_fraction), "--changes", b.changes};
    if (b.caller_params && !prod) args.push_back("--caller-params");
    if (b.delta) args.insert(args.end(), {"--delta", "--delta-block-bytes", std::to_string(b.delta_block_bytes)});
    if (b.delta && b.delta_same_host) args.push_back("--delta-same-host");
    if (!b.trace.empty()) args.insert(args.end(), {"--trace", fmt::format("{}/{}{}.trace.json", dir, role, rank)});
    auto p = spawn_proc(std::move(args), fmt::format("{} {}", role, rank), fmt::format("{}/{}{}.log", dir, role, rank));
    if (!p.ok()) return kill_all(), fail(p.status().to_string());
    procs.push_back(*p);
  }
  // The broadcast design under OpenMPI, on the same class of fabric as ferry's UCX. Its
  // ranks join the same steps through the store (blocked on it, not polling, while the
  // others run), so its trials interleave with ferry's.
  // MPI's fabric follows where ferry's bytes go: shared memory when the workers' UCX_TLS
  // has it (ferry carries only its messages over tcp then), else tcp on loopback.
  auto shared_memory = Transport::moves_bytes_over_shared_memory("ucx", worker_transport_options("ucx", b.tls).params);
  if (!shared_memory.ok()) return kill_all(), fail(shared_memory.status().to_string());
  const bool tcp = !*shared_memory;
  std::vector<std::string> mca = words(b.mpi_mca.empty()
                                           ? (tcp ? "--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo"
                                                  : "--mca pml ob1 --mca btl self,vader")
                                           : b.mpi_mca);
  std::vector<std::string> margs = {b.mpirun, "--oversubscribe", "-np", std::to_string(S + C)};
  if (::geteuid() == 0) margs.push_back("--allow-run-as-root");
  margs.insert(margs.end(), mca.begin(), mca.end());
  if (const char* asan = std::getenv("ASAN_OPTIONS")) {
    // Sanitizer builds: OpenMPI keeps allocations until exit that are not ferry's leaks.
    margs.push_back("-x");
    margs.push_back("ASAN_OPTIONS=" + std::string(asan) + ":detect_leaks=0");
  }
  margs.insert(margs.end(), {"-x", "FERRY_TOKEN", "-x", "UCX_TLS=" + b.tls, b.mpi_binary, "--model", config_path,
                             "--trainer", b.trainer, "--inference", b.inference, "--seed", std::to_string(b.seed),
                             "--store", (*server)->url(), "--job", job, "--changed-fraction",
                             fmt::format("{}", b.changed_fraction), "--changes", b.changes});
  std::string mpi_cmd;
  for (const auto& a : margs) mpi_cmd += (mpi_cmd.empty() ? "" : " ") + a;
  {
    auto mp = spawn_proc(margs, "mpirun", dir + "/mpirun.log");
    if (!mp.ok()) return kill_all(), fail(mp.status().to_string());
    procs.push_back(*mp);
  }
  // Waits for `keys`, failing fast when a process exits early.
  auto wait_keys = [&](const std::vector<std::string>& keys, const std::string& what) -> Status {
    const auto deadline = Clock::now() + std::chrono::milliseconds(b.timeout_ms);
    for (;;) {
      Status s = st.wait(keys, std::chrono::milliseconds(500));
      if (s.code() != StatusCode::kTimeout) return s;
      for (auto& p : procs) {
        if (auto status = wait_exit(p, Clock::now()))  // polls once
          return internal_error("{}: {} exited early (status {})", what, p.name, *status);
      }
      if (Clock::now() >= deadline) return timeout_error("{}: no answer within {} ms", what, b.timeout_ms);
    }
  };
  std::vector<std::pair<std::string, int>> ranks;
  for (int p = 0; p < P; ++p) ranks.emplace_back("producer", p);
  for (int c = 0; c < C; ++c) ranks.emplace_back("consumer", c);
  const std::vector<std::pair<std::string, int>> mpi_ranks = {{"mpi", 0}};
  {
    std::vector<std::string> keys;
    for (auto& [role, r] : ranks) keys.push_back(key_ready(job, role, r));
    keys.push_back(key_ready(job, "mpi", 0));
    if (Status s = wait_keys(keys, "start-up"); !s.ok())
      return kill_all(), fail("ranks did not become ready: " + s.to_string() + "\n" + mpi_cmd + "\n" + logs());
  }
  progress(fmt::format("  {} + {} processes and {} MPI ranks ready in {:.1f} s (weights prepared, plans recorded, "
                       "routes built)\n  broadcast: {}\n",
                       P, C, S + C, seconds_since(t_start), mpi_cmd));

  // One step: every rank waits for go, starts at start_ns, reports; the step's seconds
  // run from the earliest start to the latest end of its participants.
  int step = 0;
  struct StepOut {
    double seconds = 0;
    double cpu = 0;  // CPU seconds of every rank
    double idle_cpu = 0;  // CPU seconds the other side's processes used meanwhile (should be ~0)
    uint64_t bytes = 0;
    std::vector<nlohmann::json> results;  // per rank, in `ranks` order
  };
  // The processes that sit out a step: MPI's for ferry's steps, ferry's for MPI's.
  auto idle_cpu = [&](bool mpi_step) {
    double sum = 0;
    for (const auto& p : procs) {
      if (p.pid <= 0) continue;
      if (p.name == "mpirun") {
        if (!mpi_step) sum += tree_cpu(p.pid);
      } else if (mpi_step) {
        sum += proc_cpu(p.pid);
      }
    }
    return sum;
  };
  auto run_step = [&](const std::string& kind, uint64_t version) -> Result<StepOut> {
    const double idle0 = idle_cpu(kind == "bcast");
    nlohmann::json go = {{"kind", kind}, {"version", version}, {"start_ns", mono_ns() + 150'000'000}};
    FERRY_RETURN_IF_ERROR(st.set(key_go(job, step), go.dump()));
    const auto& who = kind == "bcast" ? mpi_ranks : ranks;
    std::vector<std::string> keys;
    for (auto& [role, r] : who) keys.push_back(key_result(job, step, role, r));
    FERRY_RETURN_IF_ERROR(wait_keys(keys, kind));
    StepOut o;
    o.idle_cpu = idle_cpu(kind == "bcast") - idle0;
    int64_t t0 = INT64_MAX, t1 = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      FERRY_ASSIGN_OR_RETURN(auto text, st.get(keys[i]));
      auto j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded()) return corrupt("bad result {}", keys[i]);
      if (!j.value("ok", false))
        return internal_error("{} {} {}: {}", kind, who[i].first, who[i].second, j.value("error", std::string("?")));
      o.cpu += j.value("cpu_seconds", 0.0);
      if (!j.value("idle", false)) {
        t0 = std::min(t0, j.value("start_ns", int64_t{0}));
        t1 = std::max(t1, j.value("end_ns", int64_t{0}));
        // Received bytes (consumers, MPI), except raw push, where producers report what they wrote.
        if (who[i].first != "producer" || kind == "raw") o.bytes += j.value("bytes", uint64_t{0});
      }
      o.results.push_back(std::move(j));
    }
    o.seconds = t1 > t0 ? static_cast<double>(t1 - t0) / 1e9 : 0;
    ++step;
    return o;
  };

  std::vector<double> sync_s, raw_s, memcpy_s, bcast_s;
  nlohmann::json trials = nlohmann::json::array();
  uint64_t bytes_moved = 0, raw_bytes = 0, memcpy_bytes = 0, bcast_bytes = 0;
  uint64_t last_in_place = 0, last_into_params = 0;
  uint64_t version = 0;
  std::vector<nlohmann::json> last_sync;  // per rank (ranks order): the last sync's results
  // Warm-up (trial 0, not counted), then interleaved trials: drift in the machine's load
  // hits the engine and its baselines alike.
  for (int t = 0; t <= b.syncs; ++t) {
    ++version;
    // The trainer's weights of this version are written first (a step of its own, so the
    // timed sync never waits for a producer still writing them).
    if (auto pr = run_step("prepare", version); !pr.ok())
      return kill_all(), fail(fmt::format("prepare {}: {}\n{}", version, pr.status().to_string(), logs()));
    auto sy = run_step("sync", version);
    if (!sy.ok()) return kill_all(), fail(fmt::format("sync {}: {}\n{}", version, sy.status().to_string(), logs()));
    auto rw = run_step("raw", version);
    if (!rw.ok()) return kill_all(), fail(fmt::format("{}: {}\n{}", raw_name, rw.status().to_string(), logs()));
    auto mc = run_step("memcpy", version);
    if (!mc.ok()) return kill_all(), fail(fmt::format("memcpy: {}\n{}", mc.status().to_string(), logs()));
    // The staged diagnostic: the engine's three copies as separate steps.
    double staged[3] = {0, 0, 0};
    const char* staged_kinds[3] = {"spack", "sread", "sunpack"};
    for (int k = 0; k < 3; ++k) {
      auto so = run_step(staged_kinds[k], version);
      if (!so.ok()) return kill_all(), fail(fmt::format("{}: {}\n{}", staged_kinds[k], so.status().to_string(), logs()));
      staged[k] = so->seconds;
    }
    auto bc = run_step("bcast", version);
    if (!bc.ok()) return kill_all(), fail(fmt::format("broadcast: {}\n{}", bc.status().to_string(), logs()));
    // Per-phase maxima over ranks (where a slow sync spends its time).
    nlohmann::json ph = nlohmann::json::object();
    for (size_t i = 0; i < ranks.size(); ++i) {
      const auto& j = sy->results[i];
      for (const char* k : {"materialize", "pack", "wait", "read", "unpack", "post"}) {
        const std::string from = std::string(k) + "_seconds";
        if (!j.contains(from)) continue;
        const std::string key = (ranks[i].first == "producer" ? "producer_" : "consumer_") + std::string(k);
        ph[key] = std::max(ph.value(key, 0.0), j[from].get<double>());
      }
    }
    // Zero-copy shares: bytes producers served in place, bytes consumers read into params.
    uint64_t in_place_bytes = 0, into_params_bytes = 0;
    for (size_t i = 0; i < ranks.size(); ++i) {
      in_place_bytes += sy->results[i].value("sent_in_place", uint64_t{0});
      into_params_bytes += sy->results[i].value("received_into_params", uint64_t{0});
    }
    last_in_place = in_place_bytes;
    last_into_params = into_params_bytes;
    // The pause a serving engine sees under --commit shadow: the slowest consumer's commit.
    double commit_max = 0;
    for (size_t i = 0; i < ranks.size(); ++i) commit_max = std::max(commit_max, sy->results[i].value("commit_seconds", 0.0));
    ph["commit_seconds_max"] = commit_max;
    // The slowest receiver: the longest inference rank's sync.
    double receiver_max = 0;
    for (size_t i = 0; i < ranks.size(); ++i)
      if (ranks[i].first != "producer") receiver_max = std::max(receiver_max, sy->results[i].value("seconds", 0.0));
    ph["consumer_seconds_max"] = receiver_max;
    nlohmann::json tj = {{"sync_seconds", sy->seconds},    {"raw_seconds", rw->seconds},
                         {"memcpy_seconds", mc->seconds},  {"broadcast_seconds", bc->seconds},
                         {"sync_cpu_seconds", sy->cpu},    {"raw_cpu_seconds", rw->cpu},
                         {"broadcast_cpu_seconds", bc->cpu}, {"mpi_idle_cpu_seconds", sy->idle_cpu + rw->idle_cpu},
                         {"ferry_idle_cpu_seconds", bc->idle_cpu}, {"phases_max", ph},
                         {"staged_pack_seconds", staged[0]}, {"staged_read_seconds", staged[1]},
                         {"staged_unpack_seconds", staged[2]}, {"staged_seconds", staged[0] + staged[1] + staged[2]},
                         {"warmup", t == 0}};
    trials.push_back(tj);
    progress(fmt::format("  {} {}: sync {:.3f} s ({:.2f} GB/s, {:.2f} CPU s), {} {:.3f} s ({:.2f} CPU s), memcpy {:.3f} s, "
                         "broadcast {:.3f} s ({:.2f} CPU s); idle sides {:.2f} / {:.2f} CPU s; staged pack/read/unpack "
                         "{:.3f}/{:.3f}/{:.3f} s\n",
                         t == 0 ? "warm-up" : "trial  ", t, sy->seconds,
                         sy->seconds > 0 ? static_cast<double>(sy->bytes) / sy->seconds / 1e9 : 0.0, sy->cpu,
                         raw_name, rw->seconds, rw->cpu, mc->seconds, bc->seconds, bc->cpu,
                         sy->idle_cpu + rw->idle_cpu, bc->idle_cpu, staged[0], staged[1], staged[2]));
    last_sync = sy->results;
    if (t == 0) continue;
    sync_s.push_back(sy->seconds);
    raw_s.push_back(rw->seconds);
    memcpy_s.push_back(mc->seconds);
    bcast_s.push_back(bc->seconds);
    bytes_moved = sy->bytes;
    raw_bytes = rw->bytes;
    memcpy_bytes = mc->bytes;
    bcast_bytes = bc->bytes;
  }
  auto vr = run_step("verify", version);
  if (!vr.ok()) return kill_all(), fail(fmt::format("verify: {}\n{}", vr.status().to_string(), logs()));
  // The MPI ranks verify in the same step (their result arrives under its own key).
  if (Status s = wait_keys({key_result(job, step - 1, "mpi", 0)}, "broadcast verify"); !s.ok())
    return kill_all(), fail(fmt::format("broadcast verify: {}\n{}", s.to_string(), logs()));
  int verified = 0;
  std::string mismatch;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].first != "consumer") continue;
    if (vr->results[i].value("verified", false)) ++verified;
    else if (mismatch.empty())
      mismatch = fmt::format("consumer {}: {}", ranks[i].second, vr->results[i].value("mismatch", std::string("?")));
  }
  nlohmann::json mv;
  if (auto text = st.get(key_result(job, step - 1, "mpi", 0)); text.ok())
    mv = nlohmann::json::parse(*text, nullptr, false);
  const bool bcast_verified = mv.is_object() && mv.value("verified", false);
  progress(fmt::format("  verified {}/{} inference ranks bit for bit (version {}); broadcast: {}\n", verified, C,
                       version, bcast_verified ? "every inference rank verified" : "NOT verified"));
  if (Status s = st.set(key_go(job, step), nlohmann::json{{"kind", "exit"}}.dump()); !s.ok())
    return kill_all(), fail(s.to_string());
  for (auto& p : procs) reap(p, std::chrono::milliseconds(10000));
  if (verified != C) return fail(fmt::format("verification failed: {}", mismatch));
  if (!bcast_verified)
    return fail(fmt::format("broadcast baseline: inference ranks did not verify: {}", mv.is_object() ? mv.dump() : ""));
  // Dense steps move the same bytes; a delta sync moves at most those (plus a header per
  // segment where a patch would not pay: dense is sent instead).
  if ((!b.delta && bytes_moved != raw_bytes) || bytes_moved > raw_bytes || raw_bytes != memcpy_bytes)
    return fail(fmt::format("byte counts disagree: sync {}, raw {}, memcpy {}", bytes_moved, raw_bytes, memcpy_bytes));
  const double bcast = median(bcast_s);

  const double sync = median(sync_s), rawm = median(raw_s), mem = median(memcpy_s);
  const auto gb = [&](double secs) { return secs > 0 ? static_cast<double>(bytes_moved) / secs / 1e9 : 0.0; };
  // The dense steps' own bytes (under delta the sync moves fewer than they do).
  const auto gb_dense = [&](double secs) { return secs > 0 ? static_cast<double>(raw_bytes) / secs / 1e9 : 0.0; };
  nlohmann::json& j = res.json;
  j["sync_seconds"] = sync;
  j["bytes_moved"] = bytes_moved;
  j["gbps"] = gb(sync);
  j["raw_transport_gbps"] = gb_dense(rawm);
  j["memcpy_gbps"] = gb_dense(mem);
  j["raw_bytes"] = raw_bytes;
  j["broadcast_seconds"] = bcast;
  j["speedup_vs_broadcast"] = sync > 0 ? bcast / sync : 0.0;
  // Time against time (the same bytes unless delta: then the dense bytes' raw read time
  // against the delta sync's).
  j["efficiency_vs_raw"] = sync > 0 ? rawm / sync : 0.0;
  j["in_place"] = b.in_place;
  j["commit"] = b.commit;
  j["quantize"] = b.quantize;
  j["quantize_on"] = b.quantize_on;
  j["caller_params"] = b.caller_params;
  if (b.delta) {  // what crossed against the dense bytes of the same trials (the raw step's)
    uint64_t patch = 0, patched_dense = 0, elements = 0, changed = 0, repaired = 0;
    for (size_t i = 0; i < ranks.size() && i < last_sync.size(); ++i) {
      const auto& r = last_sync[i];
      if (ranks[i].first == "producer") {
        patch += r.value("patch_bytes", uint64_t{0});
        patched_dense += r.value("patched_dense_bytes", uint64_t{0});
        elements += r.value("delta_elements", uint64_t{0});
        changed += r.value("delta_changed", uint64_t{0});
      } else {
        repaired += r.value("patches_repaired", uint64_t{0});
      }
    }
    j["delta"] = {{"changed_fraction", b.changed_fraction},
                  {"changes", b.changes},
                  {"bytes_moved", bytes_moved},
                  {"dense_bytes", raw_bytes},
                  {"wire_ratio", raw_bytes ? static_cast<double>(bytes_moved) / static_cast<double>(raw_bytes) : 0.0},
                  {"patch_bytes", patch},
                  {"patched_dense_bytes", patched_dense},
                  {"changed_fraction_seen", elements ? static_cast<double>(changed) / static_cast<double>(elements) : 0.0},
                  {"patches_repaired", repaired},
                  {"sync_vs_dense_raw", rawm > 0 ? sync / rawm : 0.0}};
  }
  {  // the commit's pause (shadow), median over the timed trials, against the sync
    std::vector<double> cs;
    for (const auto& t : trials)
      if (!t["warmup"].get<bool>()) cs.push_back(t["phases_max"].value("commit_seconds_max", 0.0));
    j["commit_seconds"] = median(cs);
    j["commit_fraction_of_sync"] = sync > 0 ? median(cs) / sync : 0.0;
    // What a serving engine feels over the timed syncs: the stall (each sync's longest
    // commit) and the slowest receiver (each sync's longest inference rank), p50 and p95.
    std::vector<double> rs;
    for (const auto& t : trials)
      if (!t["warmup"].get<bool>()) rs.push_back(t["phases_max"].value("consumer_seconds_max", 0.0));
    j["stall_seconds_p50"] = percentile(cs, 50);
    j["stall_seconds_p95"] = percentile(cs, 95);
    j["slowest_receiver_seconds_p50"] = percentile(rs, 50);
    j["slowest_receiver_seconds_p95"] = percentile(rs, 95);
  }
  j["in_place_fraction"] = bytes_moved ? static_cast<double>(last_in_place) / static_cast<double>(bytes_moved) : 0.0;
  j["into_params_fraction"] =
      bytes_moved ? static_cast<double>(last_into_params) / static_cast<double>(bytes_moved) : 0.0;
  // CPU seconds (every process of the step, medians): on an oversubscribed machine the
  // figure that depends least on how the scheduler shares the cores.
  std::vector<double> sc, bcc, rc;
  for (const auto& t : trials) {
    if (t["warmup"].get<bool>()) continue;
    sc.push_back(t["sync_cpu_seconds"].get<double>());
    bcc.push_back(t["broadcast_cpu_seconds"].get<double>());
    rc.push_back(t["raw_cpu_seconds"].get<double>());
  }
  std::vector<double> stg, stp, str, stu;
  for (const auto& t : trials) {
    if (t["warmup"].get<bool>()) continue;
    stg.push_back(t["staged_seconds"].get<double>());
    stp.push_back(t["staged_pack_seconds"].get<double>());
    str.push_back(t["staged_read_seconds"].get<double>());
    stu.push_back(t["staged_unpack_seconds"].get<double>());
  }
  // Diagnostic: the engine's copies alone (pack + read + unpack, whole model each, no
  // protocol, no overlap): sync_seconds far above it points at the protocol and the
  // scheduling, close to it at the copies.
  j["staged_seconds"] = median(stg);
  j["staged_pack_seconds"] = median(stp);
  j["staged_read_seconds"] = median(str);
  j["staged_unpack_seconds"] = median(stu);
  j["sync_cpu_seconds"] = median(sc);
  j["raw_cpu_seconds"] = median(rc);
  j["broadcast_cpu_seconds"] = median(bcc);
  j["raw_transport_seconds"] = rawm;
  j["memcpy_seconds"] = mem;
  j["broadcast_bytes"] = bcast_bytes;
  j["broadcast_bytes_model"] = bcb.bytes;
  j["broadcast_gbps"] = bcast > 0 ? static_cast<double>(bcast_bytes) / bcast / 1e9 : 0.0;
  j["broadcast_mpi"] = {{"command", mpi_cmd}, {"ranks", S + C}, {"roots", S}};
  j["model"] = b.model;
  j["architecture"] = m.config.architecture();
  j["checkpoint_bytes"] = m.checkpoint_bytes;
  j["trainer"] = m.trainer.to_string();
  j["inference"] = m.inference.to_string();
  j["producers"] = P;
  j["consumers"] = C;
  j["tls"] = b.tls;
  j["mode"] = b.mode;
  j["syncs"] = b.syncs;
  j["verified_ranks"] = verified;
  j["trials"] = trials;
  // Memory per rank, by role: what it holds (weights shard / params), the engine's
  // extra memory by kind (SyncReport::memory, at the last sync), the bench's own buffers
  // (scaffolding, never counted as the engine's) and peak RSS (at the end, verification
  // included). The broadcast baseline's MPI ranks: peak RSS and what they hold.
  {
    nlohmann::json mem = {{"producers", nlohmann::json::array()}, {"consumers", nlohmann::json::array()}};
    for (size_t i = 0; i < ranks.size(); ++i) {
      const auto& sj = last_sync[i];
      const auto& vj = vr->results[i];
      const bool producer = ranks[i].first == "producer";
      const auto& predicted = producer ? estimate->engine.producers : estimate->engine.consumers;
      const auto at = static_cast<size_t>(ranks[i].second);
      mem[producer ? "producers" : "consumers"].push_back(
          {{"rank", ranks[i].second},
           {"held_bytes", vj.value("held_bytes", uint64_t{0})},
           {"engine", sj.value("memory", nlohmann::json::object())},
           // What predict_memory (ferry plan's) said this rank's engine would hold.
           {"engine_predicted", at < predicted.size() ? engine::memory_use_json(predicted[at]) : nlohmann::json()},
           {"scaffolding", vj.value("scaffolding", nlohmann::json::object())},
           {"rss_after_sync_bytes", sj.value("rss_bytes", uint64_t{0})},
           {"peak_rss_bytes", vj.value("peak_rss_bytes", uint64_t{0})}});
    }
    mem["mpi"] = mv.is_object() ? mv.value("ranks", nlohmann::json::array()) : nlohmann::json::array();
    mem["estimate"] = estimate->json;
    mem["estimate_bytes"] = estimate->total;
    j["memory"] = mem;
  }
  // Every rank's report of the last sync (the same keys as every report: engine/
  // report_json.h), with "role" and "rank".
  j["last_sync_reports"] = nlohmann::json::array();
  for (size_t i = 0; i < ranks.size(); ++i) {
    nlohmann::json r = last_sync[i];
    r["role"] = ranks[i].first == "producer" ? "trainer" : "inference";
    r["rank"] = ranks[i].second;
    j["last_sync_reports"].push_back(std::move(r));
  }
  if (!b.trace.empty()) {
    std::vector<std::string> parts;
    for (size_t i = 0; i < ranks.size(); ++i) parts.push_back(fmt::format("{}/{}{}.trace.json", dir, ranks[i].first, ranks[i].second));
    if (Status t = merge_trace_files(parts, b.trace); !t.ok()) res.error = t.with_context("ferry bench --trace").to_string();
  }
  j["cpus"] = std::thread::hardware_concurrency();
  std::ifstream la("/proc/loadavg");
  std::string load;
  std::getline(la, load);
  j["loadavg"] = load;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return res;
}

}  // namespace ferry::tools
