// Shared by the ranks-as-threads engine tests, the sources of one executable, engine_test
// (engine_test.cpp, engine_failure_test.cpp, engine_user_plan_test.cpp,
// engine_coordination_test.cpp, engine_device_test.cpp): the cases (transport x mode), the
// trainer sources (in place, in GPU memory), the Cluster of ranks as threads and the
// fixtures of the parameterised suites (instantiated once, in engine_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/device.h"
#include "ferry/engine.h"
#include "engine/feature_matrix.h"
#include "tools/job_model.h"
#include "test_paths.h"

namespace ferry::engine_tests {

using tools::JobModel;
using namespace std::chrono_literals;

inline std::string cfg(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/configs/" + name; }

// --- cases -----------------------------------------------------------------------------

enum class Backend { kInproc, kUcx };
// kInPlace: pull, producers serving the trainer's weights from transport regions in place
// (ProducerOptions::source_regions over InPlaceSource); kPushInPlace: the same in push.
enum class Mode { kPull, kPush, kInPlace, kPushInPlace };
inline bool is_push(Mode m) { return m == Mode::kPush || m == Mode::kPushInPlace; }
inline bool is_in_place(Mode m) { return m == Mode::kInPlace || m == Mode::kPushInPlace; }

// Where FP8 block quantisation runs (kNone: the loader keeps bf16).
enum class Fp8Side { kNone, kProducer, kConsumer };

struct EngineCase {
  Backend backend;
  Mode mode;
  bool shadow = false;  // consumers under CommitPolicy::kShadow
  bool rotated = false;  // every rank under GroupOrderKind::kRotated (docs/group-order.md)
  bool groups = false;   // consumers under CommitPolicy::kGroups (the bounded shadow)
  bool relay = false;    // consumers under ConsumerOptions::relay (replicas on one host copy from one)
  bool delta = false;    // EngineOptions::delta, 1% of elements changed per version
  bool checksums = false;  // EngineOptions::checksums
  Fp8Side fp8 = Fp8Side::kNone;    // the loader quantises to FP8, on this side (EngineOptions::quantize_on)
  bool gpu_staging = false;  // producers stage on cuda:0 (a device or the emulated plugin; else skipped)
};

inline const char* backend_name(Backend b) { return b == Backend::kInproc ? "inproc" : "ucx"; }
inline const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kPull: return "pull";
    case Mode::kPush: return "push";
    case Mode::kInPlace: return "in_place";
    case Mode::kPushInPlace: return "push_in_place";
  }
  return "?";
}
inline std::string case_name(const EngineCase& c) {
  return fmt::format("{}_{}{}{}{}{}{}{}{}{}", backend_name(c.backend), mode_name(c.mode), c.shadow ? "_shadow" : "",
                     c.rotated ? "_rotated" : "", c.groups ? "_groups" : "", c.relay ? "_relay" : "",
                     c.delta ? "_delta" : "", c.checksums ? "_checksums" : "",
                     c.fp8 == Fp8Side::kProducer ? "_fp8producer" : c.fp8 == Fp8Side::kConsumer ? "_fp8consumer" : "",
                     c.gpu_staging ? "_gpu" : "");
}
inline void PrintTo(const EngineCase& c, std::ostream* os) { *os << case_name(c); }
inline std::string case_name_of(const ::testing::TestParamInfo<EngineCase>& info) { return case_name(info.param); }

// Every (transport, mode) pair drawn from the two lists.
inline auto cases(std::vector<Backend> backends, std::vector<Mode> modes, bool shadow = false, bool rotated = false,
                  bool groups = false, bool relay = false) {
  std::vector<EngineCase> out;
  for (Backend b : backends) {
    for (Mode m : modes) out.push_back({b, m, shadow, rotated, groups, relay});
  }
  return ::testing::ValuesIn(out);
}

// --- the feature matrix (feature_matrix.h) ---------------------------------------------

// Every feature of a sync that combines with the others, its values (the default first).
// `restrict`: for a suite that cannot vary some feature, the values it may take.
// One constraint (below, with its reason); every other combination runs. EngineMatrixTest
// instantiates a covering set of all ten; feature_matrix_test.cpp checks it covers each
// pair the constraint allows.
inline Matrix engine_matrix(const std::map<std::string, std::vector<std::string>>& restrict = {}) {
  Matrix m;
  m.features = {
      {"backend", {"inproc", "ucx"}},
      {"mode", {"pull", "push"}},
      {"serving", {"staged", "in_place"}},  // producers serve the trainer's memory in place
      {"commit", {"in_place", "shadow", "groups"}},
      {"order", {"layer", "rotated"}},
      {"relay", {"off", "on"}},
      {"delta", {"off", "on"}},
      {"checksums", {"off", "on"}},
      {"fp8", {"none", "producer", "consumer"}},
      {"staging", {"host", "gpu"}},
  };
  for (const auto& [name, values] : restrict) {
    const int f = m.index_of(name);
    if (f < 0) throw std::invalid_argument("engine_matrix: no feature " + name);
    for (const std::string& v : values) {
      const auto& all = m.features[static_cast<size_t>(f)].values;
      if (std::find(all.begin(), all.end(), v) == all.end())
        throw std::invalid_argument("engine_matrix: feature " + name + " has no value " + v);
    }
    m.features[static_cast<size_t>(f)].values = values;
  }
  // GPU staging takes the trainer's boxes in GPU memory (the test's GpuSource copies them
  // there at every materialize), while serving in place serves boxes at fixed addresses
  // of a host region registered with the transport (InPlaceSource): one trainer cannot
  // be both.
  const size_t serving = static_cast<size_t>(m.index_of("serving")), staging = static_cast<size_t>(m.index_of("staging"));
  m.excluded = [serving, staging, servings = m.features[serving].values,
                stagings = m.features[staging].values](const Combination& c) {
    return servings[static_cast<size_t>(c[serving])] == "in_place" && stagings[static_cast<size_t>(c[staging])] == "gpu";
  };
  // Combinations known to interact, run whole beyond their pairs (in a suite restricted
  // away from one of their values, not at all).
  m.require({{"relay", "on"}, {"delta", "on"}, {"checksums", "on"}},
            "a relay offers a group only once its checksums and patches are verified, and its member verifies "
            "the copy against the producers' checksums again (docs/relay.md)");
  m.require({{"delta", "on"}, {"fp8", "producer"}, {"commit", "groups"}},
            "patches of producer-quantised bytes apply against the bytes that landed, as each group went live");
  m.require({{"relay", "on"}, {"staging", "gpu"}, {"mode", "push"}},
            "a relay's ring is filled from GPU staging; push writes it there, the members copy it from host memory");
  m.require({{"relay", "on"}, {"order", "rotated"}, {"mode", "push"}, {"serving", "in_place"}},
            "relay groups read in one cohort's order while producers pace their waves, serving in place");
  m.require({{"delta", "on"}, {"serving", "in_place"}, {"mode", "push"}},
            "producers given source regions under delta serve nothing in place (every byte packed to be patched)");
  return m;
}

// The EngineCase of one combination of engine_matrix()'s features (matched by name, so a
// restricted matrix maps the same way).
inline EngineCase engine_case(const Matrix& m, const Combination& c) {
  auto value = [&](const char* feature) -> const std::string& {
    const int f = m.index_of(feature);
    return m.features[static_cast<size_t>(f)].values[static_cast<size_t>(c[static_cast<size_t>(f)])];
  };
  EngineCase e{value("backend") == "ucx" ? Backend::kUcx : Backend::kInproc, Mode::kPull};
  const bool push = value("mode") == "push", in_place = value("serving") == "in_place";
  e.mode = push ? (in_place ? Mode::kPushInPlace : Mode::kPush) : (in_place ? Mode::kInPlace : Mode::kPull);
  e.shadow = value("commit") == "shadow";
  e.groups = value("commit") == "groups";
  e.rotated = value("order") == "rotated";
  e.relay = value("relay") == "on";
  e.delta = value("delta") == "on";
  e.checksums = value("checksums") == "on";
  e.fp8 = value("fp8") == "producer" ? Fp8Side::kProducer : value("fp8") == "consumer" ? Fp8Side::kConsumer : Fp8Side::kNone;
  e.gpu_staging = value("staging") == "gpu";
  return e;
}

// A suite's cases: a covering set of engine_matrix(restrict).
inline std::vector<EngineCase> covering_cases(const std::map<std::string, std::vector<std::string>>& restrict) {
  const Matrix m = engine_matrix(restrict);
  std::vector<EngineCase> out;
  for (const Combination& c : covering_set(m)) out.push_back(engine_case(m, c));
  return out;
}
// The features a suite of ranks as threads can't vary unless it says so: no delta, no
// checksums, no FP8, host staging.
inline std::map<std::string, std::vector<std::string>> plain(std::map<std::string, std::vector<std::string>> more = {}) {
  std::map<std::string, std::vector<std::string>> r = {
      {"delta", {"off"}}, {"checksums", {"off"}}, {"fp8", {"none"}}, {"staging", {"host"}}};
  for (auto& [k, v] : more) r[k] = std::move(v);
  return r;
}

inline const std::vector<Backend> kAllBackends = {Backend::kInproc, Backend::kUcx};
inline const std::vector<Mode> kAllModes = {Mode::kPull, Mode::kPush, Mode::kInPlace};

// A trainer rank whose weights live in place in one region of its transport (a trainer
// that allocates its parameters through ferry): the boxes of a SyntheticSource, copied
// at fixed addresses; a new version of the inner source is written over the same memory
// by the first materialize() of the next sync (the optimizer step). `move_box`: from
// then on, materialize() hands out a copy of box 0 instead (a broken promise).
class InPlaceSource final : public WeightSource {
 public:
  InPlaceSource(SyntheticSource& inner, Transport& t) : inner_(inner), tr_(t) {}
  ~InPlaceSource() override {
    if (region_.base) tr_.deregister_memory(region_).ignore();
  }
  Status init() {
    const int groups = Groups(inner_.metadata()).size();
    uint64_t bytes = 0;
    std::vector<std::vector<std::pair<uint32_t, Tensor>>> shapes(static_cast<size_t>(groups));
    for (int g = 0; g < groups; ++g) {
      FERRY_ASSIGN_OR_RETURN(auto boxes, inner_.materialize(g));
      for (auto& b : boxes) bytes += (static_cast<uint64_t>(b.data.numel()) * dtype_size(b.data.dtype()) + 63) / 64 * 64;
    }
    FERRY_ASSIGN_OR_RETURN(region_, tr_.allocate_memory(std::max<uint64_t>(bytes, 64)));
    auto* base = static_cast<std::byte*>(region_.base);
    uint64_t at = 0;
    boxes_.resize(static_cast<size_t>(groups));
    for (int g = 0; g < groups; ++g) {
      FERRY_ASSIGN_OR_RETURN(auto boxes, inner_.materialize(g));
      for (auto& b : boxes) {
        boxes_[static_cast<size_t>(g)].push_back(LocalBox{b.box, Tensor::borrow(base + at, b.data.shape(), b.data.dtype())});
        at += (static_cast<uint64_t>(b.data.numel()) * dtype_size(b.data.dtype()) + 63) / 64 * 64;
      }
    }
    return refill();
  }
  const MemoryRegion& region() const { return region_; }
  const std::vector<TensorDecl>& metadata() const override { return inner_.metadata(); }
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Result<Holdings> holdings(int rank) const override { return inner_.holdings(rank); }
  Result<std::vector<LocalBox>> materialize(int group) override {
    if (inner_.version() != filled_) FERRY_RETURN_IF_ERROR(refill());
    if (group < 0 || static_cast<size_t>(group) >= boxes_.size()) return invalid_argument("group {}", group);
    auto out = boxes_[static_cast<size_t>(group)];
    if (move_box && !out.empty()) out[0].data = out[0].data.clone();
    return out;
  }
  bool move_box = false;

 private:
  Status refill() {
    for (size_t g = 0; g < boxes_.size(); ++g) {
      FERRY_ASSIGN_OR_RETURN(auto boxes, inner_.materialize(static_cast<int>(g)));
      for (size_t i = 0; i < boxes.size(); ++i) FERRY_RETURN_IF_ERROR(boxes_[g][i].data.copy_(boxes[i].data));
    }
    filled_ = inner_.version();
    return Status::Ok();
  }
  SyntheticSource& inner_;
  Transport& tr_;
  MemoryRegion region_;
  std::vector<std::vector<LocalBox>> boxes_;
  uint64_t filled_ = 0;
};

// The boxes of another source copied into GPU memory at every materialize (a trainer
// whose weights live in HBM). GPU tests only: without a device, materialize fails.
class GpuSource final : public WeightSource {
 public:
  explicit GpuSource(WeightSource& inner) : inner_(inner) {}
  const std::vector<TensorDecl>& metadata() const override { return inner_.metadata(); }
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Result<Holdings> holdings(int rank) const override { return inner_.holdings(rank); }
  Result<std::vector<LocalBox>> materialize(int group) override {
    FERRY_ASSIGN_OR_RETURN(auto boxes, inner_.materialize(group));
    for (LocalBox& b : boxes) {
      const size_t bytes = static_cast<size_t>(b.data.nbytes());
      FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(Device::cuda(0), bytes));
      FERRY_ASSIGN_OR_RETURN(const std::byte* host, b.data.contiguous().data_ptr());
      FERRY_RETURN_IF_ERROR(device_memcpy(mem.get(), host, bytes));
      b.data = Tensor::borrow_device(mem.get(), b.data.shape(), b.data.dtype(), Device::cuda(0), mem);
    }
    return boxes;
  }

 private:
  WeightSource& inner_;
};

// Host copies of (possibly GPU-resident) params, to verify them.
inline Result<TensorMap> host_copies(const TensorMap& params) {
  TensorMap out;
  for (const auto& [name, t] : params) {
    if (t.device().is_host()) {
      out.emplace(name, t);
      continue;
    }
    Tensor h = Tensor::empty(t.shape(), t.dtype(), name);
    FERRY_ASSIGN_OR_RETURN(std::byte* dst, h.data_ptr());
    FERRY_ASSIGN_OR_RETURN(const std::byte* src, t.device_ptr());
    FERRY_RETURN_IF_ERROR(device_memcpy(dst, src, static_cast<size_t>(t.nbytes())));
    out.emplace(name, h);
  }
  return out;
}

struct Cluster {
  std::unique_ptr<StoreServer> server;
  JobModel model;
  uint64_t seed = 7;
  EngineOptions eo;
  std::vector<std::unique_ptr<Transport>> ptr, ctr;
  std::vector<std::unique_ptr<Store>> pst, cst;
  std::vector<std::unique_ptr<SyntheticSource>> src;
  std::vector<std::unique_ptr<InPlaceSource>> in_place_src;  // when in_place
  std::vector<std::unique_ptr<Producer>> prod;
  std::vector<std::unique_ptr<Consumer>> cons;
  std::function<void(ProducerOptions&, int)> tweak_producer;
  std::function<void(ConsumerOptions&, int)> tweak_consumer;
  // Wraps producer p's store connection (and so its lease's: Store::hold_lease clones it).
  std::function<std::unique_ptr<Store>(int p, std::unique_ptr<Store>)> wrap_producer_store;
  bool caller_params = false;  // consumers get param buffers allocated by the test
  // With caller_params: how the test makes each param buffer (default: Tensor::empty).
  std::function<Result<Tensor>(const TensorDecl&)> param_factory;
  bool gpu_sources = false;  // producers materialize into GPU memory (GpuSource)
  std::vector<std::unique_ptr<GpuSource>> gpu_src;
  // Consumers from any recorded plan (Consumer::create(ConsumerModel)) instead of the
  // built-in loader: the model of consumer c.
  std::function<Result<ConsumerModel>(int c)> user_model;
  std::vector<Status> started;  // start(): every producer's, then every consumer's
  // start_consumer(c) creates consumer c under this rank instead (a rank out of range).
  std::map<int, int> consumer_rank_as;
  bool in_place = false;       // producers serve from InPlaceSource regions
  Backend backend = Backend::kInproc;
  bool shadow = false;  // consumers commit by CommitPolicy::kShadow (a failed sync never tears them)
  bool rotated = false;  // every rank under GroupOrderKind::kRotated (eo.group_order)
  bool groups = false;   // consumers commit by CommitPolicy::kGroups (a failed sync never tears them)
  bool relay = false;    // consumers under ConsumerOptions::relay (all on this one host)
  Device staging_device = Device::host();  // every producer's ProducerOptions::staging_device
  SyntheticChanges changes;  // what the producers' synthetic checkpoint changes per version
  LoaderOptions loader_options;  // the inference ranks' loader (quantize: consumer-side FP8 post-processing)
  static inline std::atomic<int> job_counter{0};
  // Full multi-rank syncs this process ran (every rank's sync of one version): with
  // FERRY_TEST_COUNT_SYNCS=FILE each test process appends its count to FILE at exit
  // (docs/RESULTS.md, "CI time", counts them over a whole run).
  static inline std::atomic<uint64_t> syncs_run{0};

  explicit Cluster(EngineCase c = {Backend::kInproc, Mode::kPull})
      : backend(c.backend), shadow(c.shadow), rotated(c.rotated), groups(c.groups), relay(c.relay) {
    // Explicit either way: a case without `rotated` is the layer order (the engine's default is rotated).
    eo.group_order = c.rotated ? GroupOrderKind::kRotated : GroupOrderKind::kLayer;
    eo.delta = c.delta;
    eo.delta_same_host = c.delta;  // (every rank is on this one host: patches over shared memory too)
    if (c.delta) changes = {0.01, false};
    eo.checksums = c.checksums;
    if (c.fp8 != Fp8Side::kNone) {
      loader_options.quantize = Quantize::kFp8;
      eo.quantize_on = c.fp8 == Fp8Side::kProducer ? QuantizeOn::kProducer : QuantizeOn::kConsumer;
    }
    if (c.gpu_staging) {  // (staging on the GPU takes the trainer's boxes there)
      staging_device = Device::cuda(0);
      gpu_sources = true;
    }
    eo.timeout = 20s;
    eo.stall_timeout = 20s;
    eo.lease_ttl = 2000ms;
    eo.rendezvous_timeout = 30s;
    eo.mode = is_push(c.mode) ? SyncMode::kPush : SyncMode::kPull;
    in_place = is_in_place(c.mode);
  }

  int P() const { return model.trainer.world_size(); }
  int C() const { return model.inference.world_size(); }

  // UCX as tests/transport runs it between processes: shared memory for reads and
  // writes, tcp on loopback for messages and failure reports.
  std::string transport_token;  // every rank's TransportOptions::token (empty: none)
  Result<std::unique_ptr<Transport>> transport() {
    TransportOptions o;
    o.token = transport_token;
    if (backend == Backend::kInproc) {
      o.backend = "inproc";
    } else {
      o.backend = "ucx";
      o.params = {{"tls", "sm,tcp,self"}, {"net_devices", "lo"}};
    }
    return Transport::create(o);
  }
  Millis store_connect_timeout{10000};  // each rank's StoreOptions::connect_timeout
  Result<std::unique_ptr<Store>> store() {
    StoreOptions so;
    so.token = "engine-test-token-0123456789";
    so.connect_timeout = store_connect_timeout;
    return Store::open(server->url(), so);
  }

  Status start(const std::string& config, const std::string& trainer, const std::string& inference,
               const std::string& overrides = "") {
    StoreServerOptions sso;
    sso.token = "engine-test-token-0123456789";
    FERRY_ASSIGN_OR_RETURN(server, StoreServer::start(sso));
    FERRY_ASSIGN_OR_RETURN(model, tools::make_job_model(config, trainer, inference, true, overrides, loader_options));
    eo.job = fmt::format("job{}", job_counter++);
    eo.num_producers = P();
    eo.num_consumers = C();
    ptr.resize(static_cast<size_t>(P()));
    pst.resize(static_cast<size_t>(P()));
    src.resize(static_cast<size_t>(P()));
    in_place_src.resize(static_cast<size_t>(P()));
    gpu_src.resize(static_cast<size_t>(P()));
    prod.resize(static_cast<size_t>(P()));
    ctr.resize(static_cast<size_t>(C()));
    cst.resize(static_cast<size_t>(C()));
    cons.resize(static_cast<size_t>(C()));
    std::vector<Status> st(static_cast<size_t>(P() + C()));
    std::vector<std::thread> th;
    for (int p = 0; p < P(); ++p) th.emplace_back([&, p] { st[static_cast<size_t>(p)] = start_producer(p); });
    for (int c = 0; c < C(); ++c) th.emplace_back([&, c] { st[static_cast<size_t>(P() + c)] = start_consumer(c); });
    for (auto& t : th) t.join();
    started = st;
    for (auto& s : st) FERRY_RETURN_IF_ERROR(s);
    return Status::Ok();
  }

  Status start_producer(int p) {
    const size_t i = static_cast<size_t>(p);
    prod[i].reset();
    in_place_src[i].reset();  // (deregisters from the transport replaced next)
    FERRY_ASSIGN_OR_RETURN(ptr[i], transport());
    FERRY_ASSIGN_OR_RETURN(pst[i], store());
    if (wrap_producer_store) pst[i] = wrap_producer_store(p, std::move(pst[i]));
    src[i] = std::make_unique<SyntheticSource>(model.metadata, model.holdings, p, seed);
    src[i]->set_changes(changes);
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    WeightSource* source = src[i].get();
    if (in_place) {
      in_place_src[i] = std::make_unique<InPlaceSource>(*src[i], *ptr[i]);
      FERRY_RETURN_IF_ERROR(in_place_src[i]->init());
      po.source_regions = {in_place_src[i]->region()};
      source = in_place_src[i].get();
    }
    if (gpu_sources) {
      gpu_src[i] = std::make_unique<GpuSource>(*source);
      source = gpu_src[i].get();
    }
    po.staging_device = staging_device;
    if (tweak_producer) tweak_producer(po, p);
    FERRY_ASSIGN_OR_RETURN(prod[i], Producer::create(*source, *ptr[i], *pst[i], po));
    return Status::Ok();
  }

  Status start_consumer(int c) {
    const size_t i = static_cast<size_t>(c);
    cons[i].reset();
    FERRY_ASSIGN_OR_RETURN(ctr[i], transport());
    FERRY_ASSIGN_OR_RETURN(cst[i], store());
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    if (shadow) co.commit = CommitPolicy::kShadow;
    if (groups) co.commit = CommitPolicy::kGroups;
    co.relay = relay;
    if (tweak_consumer) tweak_consumer(co, c);
    if (user_model) {
      FERRY_ASSIGN_OR_RETURN(auto um, user_model(c));
      FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(std::move(um), c, *ctr[i], *cst[i], co));
      return Status::Ok();
    }
    const int rank = consumer_rank_as.count(c) ? consumer_rank_as.at(c) : c;
    TensorMap params;
    if (caller_params) {
      FERRY_ASSIGN_OR_RETURN(auto rl, model.loader->rank(c));
      for (const ParamInfo& p : rl->params()) {
        if (param_factory) {
          FERRY_ASSIGN_OR_RETURN(Tensor t, param_factory(p.decl));
          params.emplace(p.decl.name, t);
        } else {
          params.emplace(p.decl.name, Tensor::empty(p.decl.shape, p.decl.dtype, p.decl.name));
        }
      }
    }
    FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(*model.loader, rank, *ctr[i], *cst[i], co, params));
    if (caller_params) {  // the consumer works in the caller's buffers, not copies
      for (const auto& [name, t] : params) {
        auto it = cons[i]->params().find(name);
        if (it == cons[i]->params().end() || *it->second.device_ptr() != *t.device_ptr())
          return internal_error("consumer {} does not use the caller's buffer of {}", c, name);
      }
    }
    return Status::Ok();
  }

  struct Outcome {
    std::vector<std::optional<Result<SyncReport>>> p, c;
  };
  // Every rank syncs v; consumers with `commit` (false: received only, CommitPolicy::kShadow).
  Outcome sync(uint64_t v, bool commit = true) {
    std::vector<int> all(static_cast<size_t>(C()));
    for (int c = 0; c < C(); ++c) all[static_cast<size_t>(c)] = c;
    return sync_with(v, all, commit);
  }
  // Every producer and only the consumers `which` sync v (the others left, died or are
  // away); out.c is indexed by rank, empty for the others.
  Outcome sync_with(uint64_t v, const std::vector<int>& which, bool commit = true) {
    ++syncs_run;
    Outcome out;
    out.p.resize(static_cast<size_t>(P()));
    out.c.resize(static_cast<size_t>(C()));
    std::vector<std::thread> th;
    for (int p = 0; p < P(); ++p) {
      th.emplace_back([&, p] {
        src[static_cast<size_t>(p)]->set_version(v);
        out.p[static_cast<size_t>(p)] = prod[static_cast<size_t>(p)]->sync(v);
      });
    }
    for (int c : which) {
      th.emplace_back([&, c] { out.c[static_cast<size_t>(c)] = cons[static_cast<size_t>(c)]->sync(v, commit); });
    }
    for (auto& t : th) t.join();
    return out;
  }

  void expect_verified(int c, uint64_t v) {
    auto host = host_copies(cons[static_cast<size_t>(c)]->params());
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    auto r = tools::verify_params(model, c, *host, seed, v, changes);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->has_value()) << "consumer " << c << " version " << v << ": " << **r;
    EXPECT_EQ(cons[static_cast<size_t>(c)]->state().version, v);
    EXPECT_FALSE(cons[static_cast<size_t>(c)]->state().torn);
  }

  // After a failed sync of `next` under CommitPolicy::kGroups: the params of the layer
  // groups its report names (groups_live) hold `next` bit for bit, every other param
  // `held`; never torn, and `mixed` exactly when some group went live.
  void expect_groups_live(int c, uint64_t held, uint64_t next) {
    const Consumer& con = *cons[static_cast<size_t>(c)];
    const std::vector<std::string>& live = con.last_report().groups_live;
    EXPECT_FALSE(con.state().torn);
    EXPECT_EQ(con.state().mixed, !live.empty());
    EXPECT_EQ(con.state().version, held);
    auto host = host_copies(con.params());
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    auto rl = model.loader->rank(c);
    ASSERT_TRUE(rl.ok()) << rl.status().to_string();
    std::vector<TensorDecl> by_version[2];
    for (const ParamInfo& p : (*rl)->params()) {
      const std::string& group = (*rl)->groups()[static_cast<size_t>(p.group)].name;
      by_version[std::find(live.begin(), live.end(), group) != live.end() ? 1 : 0].push_back(p.decl);
    }
    for (int i = 0; i < 2; ++i) {
      const uint64_t v = i ? next : held;
      auto direct = tools::direct_params(model, c, seed, v, changes);
      ASSERT_TRUE(direct.ok()) << direct.status().to_string();
      auto mm = compare_params(by_version[i], *direct, *host);
      ASSERT_TRUE(mm.ok()) << mm.status().to_string();
      EXPECT_FALSE(mm->has_value()) << "consumer " << c << ", params expected at version " << v << ": param '"
                                    << (*mm)->param << "' index " << (*mm)->index << ": " << (*mm)->detail;
    }
  }

  // The stage record of a report sums to its seconds, and the stages claimed some of it.
  static void expect_stages_sum(const SyncReport& r, const char* who, size_t rank) {
    EXPECT_NEAR(r.stages.sum(), r.seconds, 1e-6) << who << " " << rank;
    EXPECT_GT(r.stages.sum() - r.stages.unattributed, 0.0) << who << " " << rank;
  }

  void expect_all_ok(const Outcome& o, uint64_t v) {
    for (size_t p = 0; p < o.p.size(); ++p) {
      ASSERT_TRUE(o.p[p]->ok()) << "producer " << p << ": " << o.p[p]->status().to_string();
      EXPECT_TRUE((*o.p[p])->failures.empty()) << (*o.p[p])->to_string();
      expect_stages_sum(**o.p[p], "producer", p);
    }
    for (size_t c = 0; c < o.c.size(); ++c) {
      ASSERT_TRUE(o.c[c]->ok()) << "consumer " << c << ": " << o.c[c]->status().to_string();
      expect_stages_sum(**o.c[c], "consumer", c);
      expect_verified(static_cast<int>(c), v);
    }
  }
};

struct SyncCountAtExit {
  ~SyncCountAtExit() {
    const char* file = std::getenv("FERRY_TEST_COUNT_SYNCS");
    if (file == nullptr || Cluster::syncs_run == 0) return;
    if (FILE* f = std::fopen(file, "a")) {  // (one short append per process: not interleaved)
      std::fprintf(f, "%llu\n", static_cast<unsigned long long>(Cluster::syncs_run.load()));
      std::fclose(f);
    }
  }
};
inline SyncCountAtExit sync_count_at_exit;

// --- suites ----------------------------------------------------------------------------

// Every transport x every mode.
class EngineTest : public ::testing::TestWithParam<EngineCase> {
 protected:
  Mode mode() const { return GetParam().mode; }
};
// Inproc only (its failure injection: Transport::simulate_crash, Consumer::simulate_crash),
// every mode.
class EngineInprocTest : public EngineTest {};
// Bytes landing straight in params (pull reads them there, push writes them there), with
// and without producers serving in place: every mode, every transport.
class EngineZeroCopyTest : public EngineTest {};
// Push writing into params, what only inproc's failure injection reaches.
class EnginePushZeroCopyTest : public EngineTest {};
// Producers serving in place: every transport, in-place mode.
class EngineInPlaceTest : public EngineTest {};

}  // namespace ferry::engine_tests
