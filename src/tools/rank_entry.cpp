#include "tools/rank_entry.h"

#include <charconv>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/report_json.h"
#include "engine/testing.h"
#include "io/mapping_guard.h"
#include "tools/trace_file.h"

#include "ferry/device.h"
#include "ferry/engine.h"
#include "ferry/safetensors.h"
#include "source/checkpoint_sources.h"
#include "tools/job_model.h"
#include "ferry/metrics.h"
#include "tools/transport_options.h"

namespace ferry::tools {
namespace {

Result<std::optional<std::pair<int, std::string>>> first_env(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    int n = -1;
    const std::string_view s(v);
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
    if (ec != std::errc() || end != s.data() + s.size() || n < 0) {
      return invalid_argument("environment variable {}='{}' is not a non-negative integer", name, v);
    }
    return std::optional<std::pair<int, std::string>>(std::pair<int, std::string>{n, name});
  }
  return std::optional<std::pair<int, std::string>>{};
}

// What a served checkpoint file was when serve mapped it. A file truncated under a
// mapping turns the next touch of a page past its new end into SIGBUS, anywhere in the
// process, and a file rewritten in place changes the bytes being served: the checkpoint
// must not change while it is served. Before each sync serve checks that each file is
// still the one it mapped at the size it mapped, and stops serving (exit 1, naming the
// file) when one is not, instead of crashing on a shorter file. (It cannot rule out a
// change during a sync; --read-checkpoint, owned memory, can.)
struct ServedFile {
  std::string path;
  uint64_t size = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  timespec mtime{};
  // Status change time: any write or touch sets it, and no user can set it back (an
  // overwrite in place with the size kept and the mtime restored, `touch -r`, was served;
  // issue 49).
  timespec ctime{};

  static Result<ServedFile> of(const SafetensorsFile& f) {
    struct stat st {};
    if (::stat(f.path().c_str(), &st) != 0) return io_error("serve: stat {}: {}", f.path(), std::strerror(errno));
    ServedFile out{f.path(), static_cast<uint64_t>(st.st_size), st.st_dev, st.st_ino, st.st_mtim, st.st_ctim};
    if (out.size != f.bytes().size())
      return failed_precondition("serve: {} is {} bytes, {} when it was opened: it changed while serve started", f.path(),
                                 out.size, f.bytes().size());
    return out;
  }
  Status unchanged() const {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      return failed_precondition("serve: checkpoint file {} is gone ({}): the checkpoint must not change while it is "
                                 "served", path, std::strerror(errno));
    const auto now = static_cast<uint64_t>(st.st_size);
    auto same = [](const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; };
    if (st.st_dev != dev || st.st_ino != ino || now != size || !same(st.st_mtim, mtime) || !same(st.st_ctim, ctime))
      return failed_precondition("serve: checkpoint file {} changed since serve mapped it ({} bytes then, {} now{}): the "
                                 "checkpoint must not change while it is served (or pass --read-checkpoint)", path, size,
                                 now, st.st_ino != ino ? ", another file" : "");
    return Status::Ok();
  }
};

// The options every rank of the job must agree on, set on a Producer's or Consumer's.
template <typename Options>
Options engine_options(const RankSpec& s, const JobModel& m, SyncMode mode, GroupOrderKind order) {
  Options eo;
  eo.job = s.job;
  eo.num_producers = m.trainer.world_size();
  eo.num_consumers = m.inference.world_size();
  eo.mode = mode;
  eo.group_order = order;
  eo.checksums = s.checksums;
  eo.delta = s.delta;
  eo.delta_block_bytes = s.delta_block_bytes;
  eo.delta_same_host = s.delta_same_host;
  eo.timeout = std::chrono::milliseconds(s.timeout_ms);
  eo.stall_timeout = std::chrono::milliseconds(s.timeout_ms);
  eo.rendezvous_timeout = std::chrono::milliseconds(s.rendezvous_ms);
  eo.straggler_floor = std::chrono::milliseconds(s.straggler_floor_ms);
  eo.straggler_factor = s.straggler_factor;
  eo.join_window = std::chrono::milliseconds(s.join_window_ms >= 0 ? s.join_window_ms
                                                                    : std::min(20000, s.timeout_ms / 2));
  eo.lease_ttl = std::chrono::milliseconds(s.lease_ttl_ms);
  return eo;
}

// What a rank needs before it can sync, made in two steps: the local checks first (the
// spec, the model, the rank; a bad one fails at once, with no store to reach), then the
// connections.
struct Setup {
  JobModel model;
  SyncMode mode = SyncMode::kPull;
  GroupOrderKind group_order = GroupOrderKind::kRotated;
  int rank = 0;
  std::unique_ptr<Store> store;
  std::unique_ptr<Transport> transport;
};

Result<Setup> local_setup(const RankSpec& s, bool producer) {
  Setup u;
  const char* role = producer ? "serve" : "fetch";
  if (s.store.empty()) return invalid_argument("{}: --store is required (the URL every rank of the job uses)", role);
  if (producer && s.checkpoint.empty()) return invalid_argument("serve: --checkpoint DIR is required");
  // (A fetch that catches up may take no sync: it joins the live version and exits.)
  if (s.syncs < (!producer && s.catch_up ? 0 : 1))
    return invalid_argument("{}: syncs is {}; at least {}", role, s.syncs, !producer && s.catch_up ? 0 : 1);
  if (s.first_version < 0) return invalid_argument("{}: the first version is {}; versions are >= 0", role, s.first_version);
  if (s.timeout_ms < 1 || s.rendezvous_ms < 1) {
    return invalid_argument("{}: timeouts must be positive (timeout {} ms, rendezvous timeout {} ms)", role, s.timeout_ms,
                            s.rendezvous_ms);
  }
  // A serve rank that waits for an absent fetch rank as long as the fetch ranks' own
  // --timeout makes the healthy ones' next sync time out waiting for it (issue 49,
  // finding 2): the window must end first.
  if (producer && s.join_window_ms >= s.timeout_ms) {
    return invalid_argument("serve: --join-window {} ms must be below --timeout {} ms: while a serve rank waits for an "
                            "absent fetch rank, the others' next sync waits for that serve rank, bounded by their "
                            "--timeout", s.join_window_ms, s.timeout_ms);
  }
  if (producer && !std::filesystem::is_directory(s.checkpoint)) {
    return not_found("serve: checkpoint directory {} does not exist or is not a directory", s.checkpoint);
  }
  std::string model = s.model;
  if (model.empty() && !s.checkpoint.empty()) model = s.checkpoint + "/config.json";
  if (model.empty()) return invalid_argument("{}: --model (the HF config.json) is required", role);
  FERRY_ASSIGN_OR_RETURN(Device device, parse_device(s.device));
  if (device.is_cuda()) {
    if (auto why = cuda_unusable(device)) return unavailable("{}: --device {} cannot be used here: {}", role, s.device, *why);
  } else if (s.gpu_staging) {
    return invalid_argument("serve: --gpu-staging needs the weights on a GPU (--device cuda:N)");
  }
  FERRY_ASSIGN_OR_RETURN(u.model, make_job_model(model, s.trainer, s.inference, false));
  FERRY_ASSIGN_OR_RETURN(LauncherRank env, launcher_rank_from_env());
  FERRY_ASSIGN_OR_RETURN(u.rank, resolve_role_rank(producer, s.rank, u.model.trainer.world_size(),
                                                   u.model.inference.world_size(), env));
  FERRY_ASSIGN_OR_RETURN(u.mode, parse_sync_mode(s.mode));
  FERRY_ASSIGN_OR_RETURN(u.group_order, parse_group_order_kind(s.group_order));
  return u;
}

Status connect(const RankSpec& s, Setup& u) {
  StoreOptions so;
  so.token = s.token;
  FERRY_ASSIGN_OR_RETURN(u.store, Store::open(s.store, so));
  TransportOptions to = worker_transport_options("ucx", "", s.store);
  if (!s.token.empty()) to.token = s.token;
  FERRY_ASSIGN_OR_RETURN(u.transport, Transport::create(to));
  return Status::Ok();
}

// Every tensor of the model is in the checkpoint with the model's dtype and shape.
Status check_checkpoint(const RankSpec& s, const JobModel& m, const SafetensorsDir& dir) {
  for (const TensorDecl& d : m.metadata) {
    const Tensor* t = dir.find(d.name);
    if (t == nullptr) return not_found("serve: checkpoint {} has no tensor '{}'", s.checkpoint, d.name);
    if (t->dtype() != d.dtype || t->shape() != d.shape) {
      return invalid_argument("serve: checkpoint {}: tensor '{}' is {} {}, the model says {} {}", s.checkpoint, d.name,
                              dtype_name(t->dtype()), shape_str(t->shape()), dtype_name(d.dtype), shape_str(d.shape));
    }
  }
  return Status::Ok();
}

std::string join_ints(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out;
}

// What rank `rank` must hold after a sync of the checkpoint in `dir`: a direct load.
// Not inlined, and by out-parameter: GCC 12 inlining a Result<TensorMap>'s destructor
// into the caller raised a false -Wfree-nonheap-object.
[[gnu::noinline]] Status direct_load(const JobModel& m, int rank, const std::string& dir,
                                     std::optional<TensorMap>& out) {
  FERRY_ASSIGN_OR_RETURN(TensorMap ckpt, read_checkpoint_dir(dir));
  FERRY_ASSIGN_OR_RETURN(TensorMap direct, load_rank_direct(*m.loader, rank, ckpt));
  out = std::move(direct);
  return Status::Ok();
}

}  // namespace

Result<LauncherRank> launcher_rank_from_env() {
  LauncherRank r;
  FERRY_ASSIGN_OR_RETURN(auto rank, first_env({"FERRY_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}));
  FERRY_ASSIGN_OR_RETURN(auto size, first_env({"FERRY_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                               "SLURM_NTASKS"}));
  if (rank) r.rank = rank->first, r.rank_var = rank->second;
  if (size) r.world_size = size->first, r.world_size_var = size->second;
  return r;
}

Result<int> resolve_role_rank(bool producer, int flag, int producers, int consumers, const LauncherRank& env) {
  const char* role = producer ? "trainer" : "inference";
  const int own = producer ? producers : consumers;
  if (flag >= 0) {
    if (flag >= own) return out_of_range("{} rank {} is outside the layout's 0..{}", role, flag, own - 1);
    return flag;
  }
  if (!env.rank) {
    return invalid_argument("no {} rank: pass --rank, or start under a launcher that sets one of FERRY_RANK, RANK, "
                            "OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID", role);
  }
  int rank = *env.rank;
  const int world = env.world_size.value_or(own);
  if (world == producers + consumers && world != own) {
    // One launch for both roles: the trainer's ranks first.
    if (producer ? rank >= producers : rank < producers) {
      return invalid_argument("{}={} with {}={} (= {} trainer + {} inference ranks): ranks 0..{} are the trainer's, "
                              "{}..{} the inference side's, so this rank is not a{} {} rank",
                              env.rank_var, rank, env.world_size_var, world, producers, consumers, producers - 1,
                              producers, world - 1, producer ? "" : "n", role);
    }
    if (!producer) rank -= producers;
  } else if (world != own) {
    return invalid_argument("{}={} is neither the layout's {} {} ranks nor the job's {} (trainer + inference)",
                            env.world_size_var, world, own, role, producers + consumers);
  }
  if (rank >= own) return out_of_range("{} rank {} (from {}) is outside the layout's 0..{}", role, rank, env.rank_var, own - 1);
  return rank;
}

bool rank_report_passed(const RankReport& r) { return r.ok && r.verified.value_or(true); }

nlohmann::json rank_report_json(const RankReport& r) {
  nlohmann::json out = engine::sync_report_json(r.sync);
  out["role"] = r.producer ? "trainer" : "inference";
  out["rank"] = r.rank;
  out["version"] = r.version;
  out["ok"] = r.ok;
  if (!r.ok) {
    out["error"] = r.error.to_string();
    out["code"] = status_code_name(r.error.code());
  }
  if (!r.producer) {
    out["torn"] = r.torn;
    out["received_version"] = r.received ? nlohmann::json(*r.received) : nlohmann::json(nullptr);
  }
  if (r.verified) {
    out["verified"] = *r.verified;
    if (!*r.verified) out["mismatch"] = r.mismatch;
  }
  const TransportStats& ts = r.transport;
  out["transport"] = {{"reads", ts.reads},           {"reads_by_message", ts.reads_by_message},
                      {"writes", ts.writes},         {"writes_by_message", ts.writes_by_message},
                      {"bytes_read", ts.bytes_read}, {"bytes_written", ts.bytes_written}};
  return out;
}

// --metrics-port: the rank's metrics, served while it runs (none when not asked for).
struct RankMetrics {
  std::shared_ptr<SyncMetrics> sink;
  std::unique_ptr<MetricsEndpoint> endpoint;
};

Result<RankMetrics> start_metrics(const RankSpec& s, const char* cmd, int rank) {
  RankMetrics m;
  if (s.metrics.empty()) return m;
  FERRY_ASSIGN_OR_RETURN(m.sink, SyncMetrics::create());
  auto ep = MetricsEndpoint::start(s.metrics, m.sink->registry());
  if (!ep.ok()) return ep.status().with_context(fmt::format("{}: --metrics-port", cmd));
  m.endpoint = std::move(*ep);
  std::fprintf(stderr, "ferry %s: rank %d: metrics at %s\n", cmd, rank, m.endpoint->url().c_str());
  return m;
}

// After the last sync: until a scrape has the final values (--metrics-linger).
void linger_for_scrape(const RankMetrics& m, const RankSpec& s, const char* cmd, int rank) {
  if (!m.endpoint || !(s.metrics_linger_s > 0)) return;
  const auto bound = std::chrono::milliseconds(static_cast<int64_t>(s.metrics_linger_s * 1000));
  if (!m.endpoint->wait_fresh_scrape(bound)) {
    std::fprintf(stderr, "ferry %s: rank %d: metrics not scraped within --metrics-linger %g s after the last sync; "
                 "exiting without that scrape\n", cmd, rank, s.metrics_linger_s);
  }
}

// --trace FILE written once (empty) before the rank joins the job: a path it cannot write
// was taken, and then failed in every sync's report.
Status check_trace_path(const RankSpec& s, int rank) {
  if (s.trace.empty()) return Status::Ok();
  return TraceFile(trace_path_for_rank(s.trace, rank)).write().with_context("--trace");
}

Result<std::vector<RankReport>> serve_rank(const RankSpec& s, const RankReportSink& on_report) {
  FERRY_ASSIGN_OR_RETURN(Setup u, local_setup(s, true));
  FERRY_RETURN_IF_ERROR(check_trace_path(s, u.rank));
  FERRY_ASSIGN_OR_RETURN(RankMetrics metrics, start_metrics(s, "serve", u.rank));
  const SafetensorsAccess access = s.read_checkpoint ? SafetensorsAccess::kRead : SafetensorsAccess::kMap;
  FERRY_ASSIGN_OR_RETURN(SafetensorsDir dir, SafetensorsDir::open(s.checkpoint, access));
  std::vector<ServedFile> served;
  if (access == SafetensorsAccess::kMap) {
    for (const SafetensorsFile& f : dir.files()) {
      FERRY_ASSIGN_OR_RETURN(ServedFile sf, ServedFile::of(f));
      served.push_back(std::move(sf));
    }
  }
  FERRY_RETURN_IF_ERROR(check_checkpoint(s, u.model, dir));
  FERRY_ASSIGN_OR_RETURN(const Device device, parse_device(s.device));
  FERRY_RETURN_IF_ERROR(connect(s, u));
  // Served in place: each file's bytes are a source region (registered where they lie:
  // no copy), so consumers read (pull) or this rank writes (push) the contiguous boxes
  // straight from the mapping; strided pieces (a TP shard of a row-parallel weight) are
  // packed from it into staging. The registrations live as long as the transport.
  auto po = engine_options<ProducerOptions>(s, u.model, u.mode, u.group_order);
  if (s.gpu_staging) po.staging_device = device;
  po.sink = metrics.sink;
  for (const SafetensorsFile& f : dir.files()) {
    if (device.is_cuda()) break;  // weights on the GPU: nothing served from the mapping
    const std::span<const std::byte> b = f.bytes();
    if (b.empty()) continue;
    // (Peers only read it; this rank's writes take it as their source.)
    auto r = u.transport->register_memory(const_cast<std::byte*>(b.data()), b.size());
    if (!r.ok())
      return r.status().with_context(fmt::format("serve: registering {} ({} bytes) to serve it in place", f.path(), b.size()));
    po.source_regions.push_back(*r);
  }
  // A file truncated *during* a sync (after the check above) faults the next touch of a
  // page past its new end, in whichever thread touches it (packing, UCX serving a read
  // by message, checksums): each mapping is watched, and such a fault ends this process
  // with exit 1 and a message naming the file, never SIGBUS (io/mapping_guard.h says why
  // ending beats serving zeros). Watched while the producer lives.
  std::vector<io::TruncationGuard> guards;
  for (const SafetensorsFile& f : dir.files()) {
    if (access != SafetensorsAccess::kMap) break;
    FERRY_ASSIGN_OR_RETURN(
        io::TruncationGuard g,
        io::TruncationGuard::watch(f.bytes().data(), f.bytes().size(),
                                   fmt::format("ferry serve: trainer rank {}: checkpoint file {} was truncated while "
                                               "it was served (a read of it faulted past its new end): this rank "
                                               "stops (exit 1); the checkpoint must not change while it is served, or "
                                               "pass --read-checkpoint",
                                               u.rank, f.path()),
                                   1));
    guards.push_back(std::move(g));
  }
  if (s.before_materialize) {
    engine::TestHooks hooks;
    hooks.before_materialize = s.before_materialize;
    po.test_hooks = engine::make_test_hooks(std::move(hooks));
  }
  CheckpointSource from_files(u.model.metadata, *u.model.holdings, std::move(dir), u.rank);
  std::unique_ptr<DeviceCopySource> on_device;
  if (device.is_cuda()) {
    FERRY_ASSIGN_OR_RETURN(on_device, DeviceCopySource::make(from_files, device, Groups(u.model.metadata).size()));
  }
  WeightSource& source = on_device ? static_cast<WeightSource&>(*on_device) : from_files;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Producer> p, Producer::create(source, *u.transport, *u.store, po));
  std::fprintf(stderr, "ferry serve: trainer rank %d of %d, checkpoint %s, weights on %s%s, store %s\n", u.rank,
               u.model.trainer.world_size(), s.checkpoint.c_str(), device_str(device).c_str(),
               s.gpu_staging ? " (GPU staging, CUDA IPC)" : "", u.store->url().c_str());
  std::vector<RankReport> reports;
  std::optional<TraceFile> trace;
  if (!s.trace.empty()) trace.emplace(trace_path_for_rank(s.trace, u.rank));
  for (int v = s.first_version; v < s.first_version + s.syncs; ++v) {
    RankReport r{.producer = true, .rank = u.rank, .version = v};
    Status same;
    for (const ServedFile& f : served) {
      if (same = f.unchanged(); !same.ok()) break;
    }
    if (!same.ok()) {
      // Serving on would risk SIGBUS or bytes that are not the checkpoint: this report
      // is the last.
      r.error = same;
      r.transport = u.transport->stats();
      if (on_report) on_report(r);
      if (s.keep_reports) reports.push_back(std::move(r));
      break;
    }
    auto rep = p->sync(static_cast<uint64_t>(v));
    r.sync = p->last_report();
    if (trace) {
      trace->add(true, u.rank, r.sync);
      if (Status w = trace->write(); !w.ok()) r.sync.failures.push_back(w.to_string());
    }
    if (rep.ok()) {
      r.ok = rep->ok();
      if (!r.ok) {
        // A true report: this rank finished, but consumers it serves do not hold the version.
        r.error = peer_failed("serve: version {}: consumers {} that this rank serves did not commit it{}{}", v,
                              join_ints(rep->missed), rep->failures.empty() ? "" : ": ",
                              rep->failures.empty() ? "" : rep->failures.front());
      }
    } else {
      r.error = rep.status();
    }
    r.transport = u.transport->stats();
    if (on_report) on_report(r);
    if (s.keep_reports) reports.push_back(std::move(r));
  }
  linger_for_scrape(metrics, s, "serve", u.rank);
  return reports;
}

namespace {

// fetch --output DIR, checked before any sync (the params are written there only after
// the last one): DIR is made if missing, and must be a directory this process can create
// a file in (a probe file, made and removed: permission bits, a read-only filesystem,
// /proc — what access(2) alone misses, as root).
Status check_output_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return invalid_argument("fetch: --output {}: cannot create it: {}", dir, ec.message());
  if (!std::filesystem::is_directory(dir, ec)) return invalid_argument("fetch: --output {}: not a directory", dir);
  const std::string probe = fmt::format("{}/.ferry-fetch-probe.{}", dir, static_cast<long>(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return invalid_argument("fetch: --output {}: cannot write there ({}); the params are written to it after the last "
                            "sync, so it is checked first", dir, std::strerror(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

}  // namespace

Result<std::vector<RankReport>> fetch_rank(const RankSpec& s, const RankReportSink& on_report) {
  FERRY_ASSIGN_OR_RETURN(Setup u, local_setup(s, false));
  FERRY_RETURN_IF_ERROR(check_trace_path(s, u.rank));
  FERRY_ASSIGN_OR_RETURN(RankMetrics metrics, start_metrics(s, "fetch", u.rank));
  if (!s.output.empty()) FERRY_RETURN_IF_ERROR(check_output_dir(s.output));
  std::optional<TensorMap> expected;
  if (!s.checkpoint.empty()) FERRY_RETURN_IF_ERROR(direct_load(u.model, u.rank, s.checkpoint, expected));
  FERRY_ASSIGN_OR_RETURN(const Device device, parse_device(s.device));
  FERRY_RETURN_IF_ERROR(connect(s, u));
  auto co = engine_options<ConsumerOptions>(s, u.model, u.mode, u.group_order);
  co.cuda_ipc = s.cuda_ipc;
  co.sink = metrics.sink;
  FERRY_ASSIGN_OR_RETURN(co.commit, parse_commit_policy(s.commit));
  // Params on a GPU: allocated there (zeroed), the engine's kernels write them.
  TensorMap params;
  std::vector<std::shared_ptr<std::byte>> keep;
  if (device.is_cuda()) {
    FERRY_ASSIGN_OR_RETURN(auto rl, u.model.loader->rank(u.rank));
    for (const TensorDecl& d : rl->param_decls()) {
      const size_t bytes = static_cast<size_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
      FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(device, bytes));
      const std::vector<std::byte> zeros(bytes);
      FERRY_RETURN_IF_ERROR(device_memcpy(mem.get(), zeros.data(), bytes));
      params.emplace(d.name, Tensor::borrow_device(mem.get(), d.shape, d.dtype, device, mem, d.name));
    }
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Consumer> c,
                         Consumer::create(*u.model.loader, u.rank, *u.transport, *u.store, co, std::move(params)));
  std::fprintf(stderr, "ferry fetch: inference rank %d of %d, params on %s, store %s\n", u.rank,
               u.model.inference.world_size(), device_str(device).c_str(), u.store->url().c_str());
  // The params as host tensors (a copy of those in GPU memory), to verify or write.
  auto host_params = [&]() -> Result<TensorMap> {
    if (!device.is_cuda()) return c->params();
    TensorMap out;
    for (const auto& [name, t] : c->params()) {
      if (t.device().is_host()) {
        out.emplace(name, t);
        continue;
      }
      Tensor h = Tensor::empty(t.shape(), t.dtype(), name);
      FERRY_ASSIGN_OR_RETURN(std::byte* dst, h.data_ptr());
      FERRY_ASSIGN_OR_RETURN(std::byte* src, t.device_ptr());
      FERRY_RETURN_IF_ERROR(device_memcpy(dst, src, static_cast<size_t>(t.numel()) * dtype_size(t.dtype())));
      out.emplace(name, std::move(h));
    }
    return out;
  };
  std::vector<RankReport> reports;
  std::optional<TraceFile> trace;
  if (!s.trace.empty()) trace.emplace(trace_path_for_rank(s.trace, u.rank));
  bool all_passed = true;
  // One line: a sync's (or the catch-up's) report, verified against the checkpoint.
  auto report = [&](RankReport r, const Result<SyncReport>& rep) {
    r.sync = c->last_report();
    if (trace) {
      trace->add(false, u.rank, r.sync);
      if (Status w = trace->write(); !w.ok()) r.sync.failures.push_back(w.to_string());
    }
    if (rep.ok()) {
      r.ok = true;
    } else {
      r.error = rep.status();
    }
    r.torn = c->state().torn;
    r.received = c->state().received;
    if (r.ok && expected) {
      auto rl = u.model.loader->rank(u.rank);
      auto got = host_params();
      auto mm = !rl.ok()    ? Result<std::optional<Mismatch>>(rl.status())
                : !got.ok() ? Result<std::optional<Mismatch>>(got.status())
                            : compare_params((*rl)->final_params(), *expected, *got);
      if (!mm.ok()) {
        r.verified = false;
        r.mismatch = mm.status().to_string();
      } else {
        r.verified = !mm->has_value();
        if (mm->has_value()) r.mismatch = fmt::format("param '{}' index {}: {}", (*mm)->param, (*mm)->index, (*mm)->detail);
      }
    }
    r.transport = u.transport->stats();
    all_passed = all_passed && rank_report_passed(r);
    if (on_report) on_report(r);
    if (s.keep_reports) reports.push_back(std::move(r));
  };
  if (s.catch_up) {
    auto rep = c->catch_up();
    if (!rep.ok() && rep.status().code() == StatusCode::kNotFound) {
      // Nothing to catch up from (no replica of this layout holds the live version): not
      // a failure, the first sync brings it. Said on stderr, no line.
      std::fprintf(stderr, "ferry fetch: rank %d: no catch-up: %s\n", u.rank, rep.status().message().c_str());
    } else {
      const int v = rep.ok() ? static_cast<int>(rep->version) : static_cast<int>(c->last_report().version);
      report(RankReport{.producer = false, .rank = u.rank, .version = v}, rep);
    }
  }
  for (int v = s.first_version; v < s.first_version + s.syncs; ++v) {
    report(RankReport{.producer = false, .rank = u.rank, .version = v}, c->sync(static_cast<uint64_t>(v)));
  }
  if (!s.output.empty() && all_passed) {
    std::vector<SafetensorsEntry> entries;
    FERRY_ASSIGN_OR_RETURN(TensorMap got, host_params());
    for (const auto& [name, t] : got) entries.push_back(SafetensorsEntry{name, t});
    std::error_code ec;
    std::filesystem::create_directories(s.output, ec);
    const std::string path = fmt::format("{}/rank-{}.safetensors", s.output, u.rank);
    FERRY_RETURN_IF_ERROR(write_safetensors(path, entries).with_context("fetch: output"));
  }
  if (s.leave) FERRY_RETURN_IF_ERROR(c->leave().with_context("fetch --leave"));
  linger_for_scrape(metrics, s, "fetch", u.rank);
  return reports;
}

namespace {

int run_rank(const char* cmd, const RankSpec& s, bool producer) {
  bool passed = true;
  auto print = [&](const RankReport& r) {
    passed = passed && rank_report_passed(r);
    std::printf("%s\n", rank_report_json(r).dump().c_str());
    std::fflush(stdout);
  };
  RankSpec spec = s;
  spec.keep_reports = false;  // (printed as they come)
  auto reports = producer ? serve_rank(spec, print) : fetch_rank(spec, print);
  if (!reports.ok()) {
    std::fprintf(stderr, "ferry %s: %s\n", cmd, reports.status().to_string().c_str());
    return 2;
  }
  return passed ? 0 : 1;
}

}  // namespace

int run_serve(const RankSpec& s) { return run_rank("serve", s, true); }
int run_fetch(const RankSpec& s) { return run_rank("fetch", s, false); }

}  // namespace ferry::tools
