// Ranks-as-threads tests of the engine: in-process TCP store server, real model
// loaders, synthetic trainer data; every consumer verified bit for bit against a direct
// load of the same version. One suite, instantiated per transport (inproc; UCX over
// sm,tcp,self, every rank its own Transport in this process) and per mode (pull, push,
// pull with the trainer's weights served in place); tests of what only one transport
// has (inproc's failure injection) are instantiated for that transport only.
#include <array>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <ostream>
#include <set>
#include <thread>

#include "engine/in_place.h"
#include "engine/protocol.h"
#include "engine/testing.h"
#include "ferry/device.h"
#include "ferry/engine.h"
#include "tools/job_model.h"

namespace ferry {
namespace {

using tools::JobModel;
using namespace std::chrono_literals;

std::string cfg(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/configs/" + name; }

// --- cases -----------------------------------------------------------------------------

enum class Backend { kInproc, kUcx };
// kInPlace: pull, producers serving the trainer's weights from transport regions in place
// (ProducerOptions::source_regions over InPlaceSource); kPushInPlace: the same in push.
enum class Mode { kPull, kPush, kInPlace, kPushInPlace };
bool is_push(Mode m) { return m == Mode::kPush || m == Mode::kPushInPlace; }
bool is_in_place(Mode m) { return m == Mode::kInPlace || m == Mode::kPushInPlace; }

struct EngineCase {
  Backend backend;
  Mode mode;
};

const char* backend_name(Backend b) { return b == Backend::kInproc ? "inproc" : "ucx"; }
const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kPull: return "pull";
    case Mode::kPush: return "push";
    case Mode::kInPlace: return "in_place";
    case Mode::kPushInPlace: return "push_in_place";
  }
  return "?";
}
std::string case_name(const EngineCase& c) { return fmt::format("{}_{}", backend_name(c.backend), mode_name(c.mode)); }
void PrintTo(const EngineCase& c, std::ostream* os) { *os << case_name(c); }
std::string case_name_of(const ::testing::TestParamInfo<EngineCase>& info) { return case_name(info.param); }

// Every (transport, mode) pair drawn from the two lists.
auto cases(std::vector<Backend> backends, std::vector<Mode> modes) {
  std::vector<EngineCase> out;
  for (Backend b : backends) {
    for (Mode m : modes) out.push_back({b, m});
  }
  return ::testing::ValuesIn(out);
}
const std::vector<Backend> kAllBackends = {Backend::kInproc, Backend::kUcx};
const std::vector<Mode> kAllModes = {Mode::kPull, Mode::kPush, Mode::kInPlace};

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
Result<TensorMap> host_copies(const TensorMap& params) {
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
  bool caller_params = false;  // consumers get param buffers allocated by the test
  // With caller_params: how the test makes each param buffer (default: Tensor::empty).
  std::function<Result<Tensor>(const TensorDecl&)> param_factory;
  bool gpu_sources = false;  // producers materialize into GPU memory (GpuSource)
  std::vector<std::unique_ptr<GpuSource>> gpu_src;
  // Consumers from any recorded plan (Consumer::create(ConsumerModel)) instead of the
  // built-in loader: the model of consumer c.
  std::function<Result<ConsumerModel>(int c)> user_model;
  std::vector<Status> started;  // start(): every producer's, then every consumer's
  bool in_place = false;       // producers serve from InPlaceSource regions
  Backend backend = Backend::kInproc;
  static inline std::atomic<int> job_counter{0};

  explicit Cluster(EngineCase c = {Backend::kInproc, Mode::kPull}) : backend(c.backend) {
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
  Result<std::unique_ptr<Transport>> transport() {
    TransportOptions o;
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
    FERRY_ASSIGN_OR_RETURN(model, tools::make_job_model(config, trainer, inference, true, overrides));
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
    src[i] = std::make_unique<SyntheticSource>(model.metadata, model.holdings, p, seed);
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
    if (tweak_consumer) tweak_consumer(co, c);
    if (user_model) {
      FERRY_ASSIGN_OR_RETURN(auto um, user_model(c));
      FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(std::move(um), c, *ctr[i], *cst[i], co));
      return Status::Ok();
    }
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
    FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(*model.loader, c, *ctr[i], *cst[i], co, params));
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
  Outcome sync(uint64_t v) {
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
    for (int c = 0; c < C(); ++c) {
      th.emplace_back([&, c] { out.c[static_cast<size_t>(c)] = cons[static_cast<size_t>(c)]->sync(v); });
    }
    for (auto& t : th) t.join();
    return out;
  }

  void expect_verified(int c, uint64_t v) {
    auto host = host_copies(cons[static_cast<size_t>(c)]->params());
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    auto r = tools::verify_params(model, c, *host, seed, v);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->has_value()) << "consumer " << c << " version " << v << ": " << **r;
    EXPECT_EQ(cons[static_cast<size_t>(c)]->state().version, v);
    EXPECT_FALSE(cons[static_cast<size_t>(c)]->state().torn);
  }

  void expect_all_ok(const Outcome& o, uint64_t v) {
    for (size_t p = 0; p < o.p.size(); ++p) {
      ASSERT_TRUE(o.p[p]->ok()) << "producer " << p << ": " << o.p[p]->status().to_string();
      EXPECT_TRUE((*o.p[p])->failures.empty()) << (*o.p[p])->to_string();
    }
    for (size_t c = 0; c < o.c.size(); ++c) {
      ASSERT_TRUE(o.c[c]->ok()) << "consumer " << c << ": " << o.c[c]->status().to_string();
      expect_verified(static_cast<int>(c), v);
    }
  }
};

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

INSTANTIATE_TEST_SUITE_P(Cases, EngineTest, cases(kAllBackends, kAllModes), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineInprocTest, cases({Backend::kInproc}, kAllModes), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineZeroCopyTest,
                         cases(kAllBackends, {Mode::kPull, Mode::kInPlace, Mode::kPush, Mode::kPushInPlace}), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EnginePushZeroCopyTest, cases({Backend::kInproc}, {Mode::kPush, Mode::kPushInPlace}),
                         case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineInPlaceTest, cases(kAllBackends, {Mode::kInPlace}), case_name_of);

TEST_P(EngineTest, DenseGqaTwoReplicas) {
  Cluster k(GetParam());
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2").ok());
  const Routes& routes = k.prod[0]->routes();
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    uint64_t got = 0, served = 0, in_place = 0;
    for (auto& c : o.c) got += (**c).bytes_received;
    for (auto& p : o.p) {
      served += (**p).bytes_sent;
      in_place += (**p).sent_in_place;
      EXPECT_GT((**p).bytes_sent, 0u) << "every TP shard holder serves its own shard";
    }
    EXPECT_EQ(got, routes.stats.bytes_moved);
    EXPECT_EQ(served, got);
    EXPECT_EQ(got, routes.stats.bytes_min) << "exactly the bytes each consumer keeps";
    // Zero copy: most bytes are read (pull) or written (push) straight into the params;
    // what is left (small pieces) went through the receive ring and was unpacked, and
    // the params verified.
    for (auto& c : o.c) {
      EXPECT_GT((**c).received_into_params, 0u);
      EXPECT_LT((**c).received_into_params, (**c).bytes_received);
    }
    // In place: producers serve most bytes from the trainer's memory, small pieces (the
    // norms, under direct_min_bytes) from staging.
    if (is_in_place(mode())) {
      EXPECT_GT(in_place, 0u);
      EXPECT_LT(in_place, served);
    } else {
      EXPECT_EQ(in_place, 0u);
    }
  }
  // Every participant built the same routes.
  for (auto& c : k.cons) EXPECT_EQ(c->routes().hash(), routes.hash());
  for (auto& p : k.prod) EXPECT_EQ(p->routes().hash(), routes.hash());
}

// Zero copy into params, whatever the threshold: every piece (0), the default, or none
// (everything through the receive ring); params allocated by the consumer or by the
// caller (registered one by one); with checksums, which then cover bytes that landed in
// params. Pull reads them there; push writes them there (from staging, or in place from
// the trainer's memory: neither side stages them). Every consumer verified bit for bit,
// every sync.
TEST_P(EngineZeroCopyTest, ReadsIntoParams) {
  struct Case {
    uint64_t min_bytes;
    bool caller_params;
  };
  for (Case t : {Case{0, false}, Case{0, true}, Case{4096, true}, Case{64 * 1024, false}, Case{UINT64_MAX, false}}) {
    SCOPED_TRACE(fmt::format("direct_min_bytes {} caller_params {}", t.min_bytes, t.caller_params));
    Cluster k(GetParam());
    k.caller_params = t.caller_params;
    k.tweak_consumer = [&](ConsumerOptions& co, int) {
      co.direct_min_bytes = t.min_bytes;
      co.checksums = true;
    };
    k.tweak_producer = [&](ProducerOptions& po, int) { po.checksums = true; };
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2").ok());
    for (uint64_t v = 1; v <= 2; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      uint64_t in_place = 0, served = 0;
      for (auto& p : o.p) {
        in_place += (**p).sent_in_place;
        served += (**p).bytes_sent;
      }
      if (is_in_place(mode())) {
        EXPECT_GT(in_place, 0u) << "producers serve from the trainer's memory";
      } else {
        EXPECT_EQ(in_place, 0u);
      }
      EXPECT_LE(in_place, served);
      for (auto& c : o.c) {
        if (t.min_bytes == UINT64_MAX) {
          EXPECT_EQ((**c).received_into_params, 0u);
        } else if (t.min_bytes == 0) {
          // Llama has no dtype conversion and no shared source bytes: all of it.
          EXPECT_EQ((**c).received_into_params, (**c).bytes_received);
        } else {
          EXPECT_GT((**c).received_into_params, 0u);
        }
      }
    }
  }
}

TEST_P(EngineTest, MoeWithExpertParallelism) {
  Cluster k(GetParam());
  Status s = k.start(cfg("qwen3-30b-a3b.json"), "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2");
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (uint64_t v = 1; v <= 2; ++v) k.expect_all_ok(k.sync(v), v);
}

TEST_P(EngineTest, HooksAndSmallStagingBudget) {
  std::atomic<int> before{0}, after{0}, groups{0};
  {
    // Budget 1 byte is refused (smaller than a group): check the error, then use a
    // budget of one slot.
    Cluster k(GetParam());
    k.eo.rendezvous_timeout = 2s;
    k.tweak_producer = [](ProducerOptions& o, int) { o.staging_budget = 1; };
    Status s = k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2");
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("staging budget"), std::string::npos) << s.to_string();
  }
  Cluster k2(GetParam());
  k2.tweak_producer = [](ProducerOptions& o, int) { o.staging_budget = 64ull << 20; };
  k2.tweak_consumer = [&](ConsumerOptions& o, int) {
    o.before_sync = [&](uint64_t) { ++before; };
    o.after_group = [&](uint64_t, int) { ++groups; };
    o.after_sync = [&](uint64_t) { ++after; };
  };
  ASSERT_TRUE(k2.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k2.expect_all_ok(k2.sync(5), 5);
  EXPECT_EQ(before.load(), 2);
  EXPECT_EQ(after.load(), 2);
  EXPECT_EQ(groups.load(), 2 * k2.prod[0]->routes().num_groups());
}

TEST_P(EngineTest, ChecksumDetectsCorruptSegment) {
  Cluster k(GetParam());
  k.eo.checksums = true;
  k.tweak_producer = [](ProducerOptions& o, int p) {
    if (p == 0) {
      engine::TestHooks hooks;
      hooks.corrupt_group = 1;
      hooks.corrupt_version = 2;
      o.test_hooks = engine::make_test_hooks(std::move(hooks));
    }
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
  int corrupt = 0;
  for (size_t c = 0; c < o.c.size(); ++c) {
    if (!o.c[c]->ok()) {
      EXPECT_EQ(o.c[c]->status().code(), StatusCode::kCorrupt) << o.c[c]->status().to_string();
      EXPECT_NE(o.c[c]->status().message().find("producer 0"), std::string::npos);
      EXPECT_TRUE(k.cons[c]->state().torn);
      EXPECT_EQ(k.cons[c]->state().version, 1u);
      ++corrupt;
    }
  }
  EXPECT_GT(corrupt, 0);
  for (auto& p : o.p) EXPECT_TRUE(p->ok());
  k.expect_all_ok(k.sync(3), 3);
}

// A consumer crashes at every point of a sync in turn (group x phase); the others
// complete, nothing hangs, and the restarted consumer verifies at the next sync.
TEST_P(EngineInprocTest, ConsumerCrashAtEveryPoint) {
  Cluster k(GetParam());
  k.eo.stall_timeout = 20s;  // crashes are detected at once (inproc); this only bounds a bug
  std::atomic<int> crash_at{-1};
  std::atomic<bool> crashed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    engine::TestHooks hooks;
    hooks.consumer_point = [&k, &crash_at, &crashed](int g, int phase) {
      if (g * 4 + phase == crash_at.load() && !crashed.exchange(true)) engine::simulate_crash(*k.cons[1]);
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2", R"({"num_hidden_layers": 4})").ok());
  const int points = k.prod[0]->routes().num_groups() * 4;
  ASSERT_GE(points, 20);
  uint64_t v = 1;
  for (int point = 0; point < points; ++point, v += 2) {
    crash_at = point;
    auto o = k.sync(v);
    crash_at = -1;
    for (size_t p = 0; p < o.p.size(); ++p) ASSERT_TRUE(o.p[p]->ok()) << o.p[p]->status().to_string();
    for (size_t c = 0; c < o.c.size(); ++c) {
      if (c == 1) continue;
      ASSERT_TRUE(o.c[c]->ok()) << "point " << point << " consumer " << c << ": " << o.c[c]->status().to_string();
      k.expect_verified(static_cast<int>(c), v);
    }
    // Restart the crashed consumer (a fresh transport and engine, same rank).
    ASSERT_TRUE(crashed.load()) << "point " << point << " was not reached";
    EXPECT_FALSE(o.c[1]->ok());
    ASSERT_TRUE(k.start_consumer(1).ok());
    crashed = false;
    k.expect_all_ok(k.sync(v + 1), v + 1);
  }
}

// Producer 1 crashes (simulate_crash) before materialising group 2 of sync 2. Its own
// sync thread (which a dead process would not have) ends at its first refused send; in
// push it may have none to send (no READY came before the crash), and then ends at its
// stall timeout: short, so the test does not wait it out.
void crash_producer_1_at_sync_2_group_2(Cluster& k) {
  k.tweak_producer = [&k](ProducerOptions& o, int p) {
    if (p != 1) return;
    o.stall_timeout = 2s;
    engine::TestHooks hooks;
    hooks.before_materialize = [&k](uint64_t v, int g) {
      if (v == 2 && g == 2) k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
}

// The only holder of some boxes dies mid-sync, once every consumer began unpacking group
// 0 (so each has params of the new version: torn): consumers fail naming it and report
// torn; once it is back, the next sync recovers. (Crashing it earlier may leave a consumer
// that unpacked nothing: then it keeps the old version, not torn — a race this test
// would otherwise lose now and then.)
TEST_P(EngineInprocTest, OnlyHolderDiesThenRecovers) {
  Cluster k(GetParam());
  std::atomic<bool> armed{false};
  std::atomic<unsigned> unpacking{0};  // bit c: consumer c began unpacking group 0 of sync 2
  unsigned every = 0;                  // a bit per consumer
  k.tweak_consumer = [&](ConsumerOptions& co, int c) {
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&, c](int g, int phase) {
      if (armed && g == 0 && phase == 3) unpacking |= 1u << c;
    };
    co.test_hooks = hooks;
  };
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    if (p != 1) return;
    engine::TestHooks hooks;
    hooks.before_materialize = [&](uint64_t v, int g) {
      if (v != 2 || g != 2) return;
      // Bounded: the test then fails on `torn` rather than hang.
      for (int i = 0; i < 2000 && unpacking.load() != every; ++i) std::this_thread::sleep_for(5ms);
      k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  every = (1u << k.cons.size()) - 1;
  armed = true;
  auto o = k.sync(2);
  armed = false;
  EXPECT_EQ(unpacking.load(), every);
  for (size_t c = 0; c < o.c.size(); ++c) {
    ASSERT_FALSE(o.c[c]->ok());
    EXPECT_EQ(o.c[c]->status().code(), StatusCode::kPeerFailed) << o.c[c]->status().to_string();
    EXPECT_NE(o.c[c]->status().message().find("producer 1"), std::string::npos) << o.c[c]->status().to_string();
    EXPECT_NE(o.c[c]->status().message().find("no failover"), std::string::npos) << o.c[c]->status().to_string();
    EXPECT_TRUE(k.cons[c]->state().torn);
    EXPECT_EQ(k.cons[c]->state().version, 1u);
  }
  k.tweak_producer = nullptr;
  ASSERT_TRUE(k.start_producer(1).ok());
  k.expect_all_ok(k.sync(3), 3);
}

// A producer with a DP replica dies mid-sync: every participant rebuilds the same routes
// without it, the sync completes verified (no consumer dropped: a consumer still on the
// old routes is told of the new ones, see Producer send_routes_notice); after it
// restarts, it rejoins. Push: producers write into receive slots, so a consumer that
// moves to new routes must not reuse a slot while a write of the old ones may still land
// there (FLUSHED). In place: the replica serves the dead producer's pieces from its own
// trainer memory.
TEST_P(EngineInprocTest, ProducerDiesFailoverToDpReplica) {
  Cluster k(GetParam());
  crash_producer_1_at_sync_2_group_2(k);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2,replicas=2").ok());
  const uint64_t full = k.prod[0]->routes().hash();
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
  for (int p : {0, 2, 3}) {
    ASSERT_TRUE(o.p[static_cast<size_t>(p)]->ok()) << o.p[static_cast<size_t>(p)]->status().to_string();
    EXPECT_TRUE((*o.p[static_cast<size_t>(p)])->dropped.empty()) << (*o.p[static_cast<size_t>(p)])->to_string();
  }
  for (size_t c = 0; c < o.c.size(); ++c) {
    ASSERT_TRUE(o.c[c]->ok()) << "consumer " << c << ": " << o.c[c]->status().to_string();
    k.expect_verified(static_cast<int>(c), 2);
  }
  // The dead producer's mark stays until it restarts: its own sync failed (its
  // transport is gone), so it must not take the mark off, which would bring it back
  // into the others' routes while they fail it over.
  EXPECT_TRUE(k.pst[0]->get(engine::JobKeys(k.eo.job).dead(1)).ok());
  const uint64_t without = k.prod[0]->routes().hash();
  EXPECT_NE(without, full);
  for (int p : {2, 3}) EXPECT_EQ(k.prod[static_cast<size_t>(p)]->routes().hash(), without);
  EXPECT_EQ(k.prod[3]->routes().producers[1].groups[2].staging_bytes, 0u);
  // Producer 1 is still gone at sync 3: the rebuilt routes serve it.
  {
    std::vector<std::thread> th;
    std::vector<std::optional<Result<SyncReport>>> res(7);
    for (int p : {0, 2, 3}) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        res[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    for (int c = 0; c < k.C(); ++c) th.emplace_back([&, c] { res[static_cast<size_t>(3 + c)] = k.cons[static_cast<size_t>(c)]->sync(3); });
    for (auto& t : th) t.join();
    for (int i : {0, 2, 3, 4, 5, 6}) ASSERT_TRUE(res[static_cast<size_t>(i)]->ok()) << res[static_cast<size_t>(i)]->status().to_string();
    for (int c = 0; c < k.C(); ++c) k.expect_verified(c, 3);
    // (A consumer that had finished sync 2 before the failure switches at sync 3.)
    for (auto& c : k.cons) EXPECT_EQ(c->routes().hash(), without);
  }
  // Back: the next sync uses the full routes again.
  k.tweak_producer = nullptr;
  ASSERT_TRUE(k.start_producer(1).ok());
  k.expect_all_ok(k.sync(4), 4);
  EXPECT_EQ(k.prod[0]->routes().hash(), full);
  for (auto& c : k.cons) EXPECT_EQ(c->routes().hash(), full);
}

// A consumer slow to move to the routes of a failed-over sync is no straggler. Of two DP
// replicas, the survivor serves nothing of the last group L (the routes put all of it on
// the victim). The victim dies before it serves L in sync 2. Consumers 0 and 1 fail over
// at once; the survivor restarts the sync with the new routes and serves them from group
// 0. Consumer 2 had released everything of the survivor's under the old routes and is
// held at L, as if it found the lost producer later, by its lease, on a loaded host,
// until well past the straggler bound (300 ms) after the others released group 0 of the
// new routes (meanwhile the survivor's ring is full: the others wait for it). Then it
// moves to the new routes and the survivor serves it: every consumer verifies, nobody is
// dropped. Before, the survivor counted consumer 2's lag from the others' release, before
// it had reached these routes, and dropped it as a straggler (CI:
// MultiHostFaults.TrainerHostLinkDownFailsOverToTheDpReplica under ASan).
TEST_P(EngineInprocTest, ConsumerLateToFailedOverRoutesIsNoStraggler) {
  Cluster k(GetParam());
  k.eo.straggler_floor = 300ms;
  std::atomic<int> victim{-1};
  std::atomic<int> last{-1};
  std::atomic<bool> armed{false};
  std::atomic<bool> held{false};      // consumer 2 is held at group L of sync 2 (on the old routes)
  std::atomic<unsigned> restarted{0};  // bit c: consumer c began group 0 of sync 2 a second time
  std::atomic<unsigned> released{0};   // bit c: ... and released it
  std::array<std::atomic<int>, 3> starts{};  // times consumer c began group 0 of sync 2
  auto wait_for = [](auto done) {      // bounded: a failure elsewhere must not hang the test
    const auto until = std::chrono::steady_clock::now() + 15s;
    while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(2ms);
  };
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    engine::TestHooks hooks;
    hooks.before_materialize = [&, p](uint64_t v, int g) {
      if (v != 2 || p != victim || g != last) return;
      wait_for([&] { return held.load(); });  // consumer 2 is on the old routes, past the survivor's groups
      k.ptr[static_cast<size_t>(p)]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  k.tweak_consumer = [&](ConsumerOptions& co, int c) {
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&, c](int g, int phase) {
      if (!armed) return;
      if (c != 2 && g == 0 && phase == 0 && ++starts[static_cast<size_t>(c)] == 2) restarted |= 1u << c;
      if (c != 2 && g == 0 && phase == 2 && (restarted & (1u << c))) released |= 1u << c;
      if (c == 2 && g == last && phase == 0 && !held.exchange(true)) {
        wait_for([&] { return (released & 3u) == 3u; });
        std::this_thread::sleep_for(1500ms);  // 5 x the straggler floor after the others
      }
    };
    co.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1,dp=2", "tp=1,replicas=3").ok());
  const Routes& full = k.prod[0]->routes();
  last = full.num_groups() - 1;
  for (int p : {0, 1}) {
    if (full.producers[static_cast<size_t>(p)].groups[static_cast<size_t>(last.load())].segments.empty()) victim = 1 - p;
  }
  ASSERT_GE(victim.load(), 0) << "both replicas serve the last group: the scenario needs one that does not";
  const int survivor = 1 - victim;
  k.expect_all_ok(k.sync(1), 1);
  armed = true;
  auto o = k.sync(2);
  armed = false;
  EXPECT_TRUE(held) << "consumer 2 never reached the last group of sync 2";
  EXPECT_EQ(released.load() & 3u, 3u) << "consumers 0 and 1 did not restart sync 2 while consumer 2 was held";
  auto& rep = o.p[static_cast<size_t>(survivor)];
  ASSERT_TRUE(rep->ok()) << rep->status().to_string();
  EXPECT_TRUE((*rep)->dropped.empty()) << (*rep)->to_string();
  EXPECT_NE((*rep)->to_string().find("failover"), std::string::npos) << (*rep)->to_string();
  for (size_t c = 0; c < o.c.size(); ++c) {
    ASSERT_TRUE(o.c[c]->ok()) << "consumer " << c << ": " << o.c[c]->status().to_string();
    k.expect_verified(static_cast<int>(c), 2);
  }
}

// Push writing into params while a producer with a DP replica dies mid-sync: the
// consumers fail over (waiting for FLUSHED of the abandoned routes' writes before the
// new attempt writes the same params), and every consumer verifies, with bytes written
// straight into params (and, push_in_place, from the trainer's memory) in that sync.
TEST_P(EnginePushZeroCopyTest, FailoverWritesIntoParams) {
  Cluster k(GetParam());
  k.eo.checksums = true;
  crash_producer_1_at_sync_2_group_2(k);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
  uint64_t in_place = 0;
  for (int p : {0, 2, 3}) {
    ASSERT_TRUE(o.p[static_cast<size_t>(p)]->ok()) << o.p[static_cast<size_t>(p)]->status().to_string();
    in_place += (**o.p[static_cast<size_t>(p)]).sent_in_place;
  }
  EXPECT_EQ(in_place > 0, is_in_place(mode()));
  for (size_t c = 0; c < o.c.size(); ++c) {
    ASSERT_TRUE(o.c[c]->ok()) << "consumer " << c << ": " << o.c[c]->status().to_string();
    EXPECT_GT((**o.c[c]).received_into_params, 0u);
    k.expect_verified(static_cast<int>(c), 2);
  }
  k.tweak_producer = nullptr;
  ASSERT_TRUE(k.start_producer(1).ok());
  k.expect_all_ok(k.sync(3), 3);
}

// A consumer that gives up a push sync while a producer's writes into its params are in
// flight returns only once they ended (ABORT, answered by FLUSHED): the caller owns the
// params again when sync() returns, so nothing may land in them after. Producer 0 holds
// its writes of group 1 to consumer 0 past the consumer's timeout; a snapshot of the
// params taken the moment sync() failed must equal them once every producer is done.
TEST_P(EnginePushZeroCopyTest, AbortWaitsForWritesIntoParams) {
  Cluster k(GetParam());
  // Consumer 0 gives up at its own timeout, not as a straggler dropped by producer 1.
  k.eo.straggler_floor = 20s;
  k.tweak_consumer = [](ConsumerOptions& co, int c) {
    co.direct_min_bytes = 0;  // every byte of the group goes straight into params
    if (c == 0) co.timeout = 2000ms;
  };
  k.tweak_producer = [](ProducerOptions& o, int p) {
    if (p != 0) return;
    engine::TestHooks hooks;
    hooks.before_push = [](uint64_t v, int g, int c) {
      // Past consumer 0's timeout (2 s), within the wait for FLUSHED that follows it.
      if (v == 2 && g == 1 && c == 0) std::this_thread::sleep_for(2800ms);
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  std::vector<std::optional<Result<SyncReport>>> res(static_cast<size_t>(k.P() + k.C()));
  std::map<std::string, Tensor> at_return;
  {
    std::vector<std::thread> th;
    for (int p = 0; p < k.P(); ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(2);
        res[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(2);
      });
    }
    for (int c = 0; c < k.C(); ++c) {
      th.emplace_back([&, c] {
        res[static_cast<size_t>(k.P() + c)] = k.cons[static_cast<size_t>(c)]->sync(2);
        if (c == 0) {
          for (const auto& [name, t] : k.cons[0]->params()) at_return.emplace(name, t.clone());
        }
      });
    }
    for (auto& t : th) t.join();
  }
  const auto& failed = res[static_cast<size_t>(k.P())];
  ASSERT_FALSE(failed->ok());
  EXPECT_EQ(failed->status().code(), StatusCode::kTimeout) << failed->status().to_string();
  EXPECT_EQ(failed->status().message().find("did not confirm"), std::string::npos)
      << "producer 0 answered the ABORT once its writes ended: " << failed->status().to_string();
  EXPECT_TRUE(k.cons[0]->state().torn);
  ASSERT_FALSE(at_return.empty());
  for (const auto& [name, t] : k.cons[0]->params()) {
    const Tensor& then = at_return.at(name);
    const size_t bytes = static_cast<size_t>(t.numel()) * dtype_size(t.dtype());
    EXPECT_EQ(std::memcmp(*then.data_ptr(), *t.data_ptr(), bytes), 0) << "param '" << name << "' changed after sync() returned";
  }
  ASSERT_TRUE(res[static_cast<size_t>(k.P() + 1)]->ok()) << res[static_cast<size_t>(k.P() + 1)]->status().to_string();
  k.expect_verified(1, 2);
  k.expect_all_ok(k.sync(3), 3);
}

// Producers serve from the trainer's memory in place (ProducerOptions::source_regions):
// pieces that are contiguous runs of a box are neither packed nor staged; consumers read
// them from the source region, into params or the ring. Every consumer verified bit for
// bit, with checksums (which then cover in-place bytes), at thresholds from every piece
// to none; in push too (the producer writes them from the source region, into params or
// the receive ring).
TEST_P(EngineInPlaceTest, ServesWithoutStaging) {
  struct Case {
    uint64_t min_bytes;
    SyncMode mode;
    uint64_t consumer_min;
  };
  for (Case t : {Case{0, SyncMode::kPull, 0}, Case{4096, SyncMode::kPull, 64 * 1024},
                 Case{0, SyncMode::kPull, UINT64_MAX}, Case{UINT64_MAX, SyncMode::kPull, 0},
                 Case{0, SyncMode::kPush, 0}, Case{0, SyncMode::kPush, UINT64_MAX}}) {
    SCOPED_TRACE(fmt::format("producer min {} mode {} consumer min {}", t.min_bytes, sync_mode_name(t.mode),
                             t.consumer_min));
    Cluster k(GetParam());
    k.in_place = true;
    k.eo.mode = t.mode;
    k.eo.checksums = true;
    k.tweak_producer = [&](ProducerOptions& po, int) { po.direct_min_bytes = t.min_bytes; };
    k.tweak_consumer = [&](ConsumerOptions& co, int) { co.direct_min_bytes = t.consumer_min; };
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=4").ok());
    for (uint64_t v = 1; v <= 3; ++v) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      uint64_t served = 0, in_place = 0;
      for (auto& p : o.p) {
        served += (**p).bytes_sent;
        in_place += (**p).sent_in_place;
      }
      if (t.min_bytes == UINT64_MAX) {
        EXPECT_EQ(in_place, 0u);
      } else {
        EXPECT_GT(in_place, 0u);
        EXPECT_LT(in_place, served) << "tp=2 -> tp=4: row-parallel pieces are strided in the trainer's box";
      }
    }
  }
}

// A source that breaks its in-place promise (a box at another address) fails the sync
// with an error naming the tensor, and the consumers do not commit.
TEST_P(EngineInPlaceTest, BoxThatMovedFailsTheSync) {
  Cluster k(GetParam());
  k.eo.timeout = 3s;
  k.eo.stall_timeout = 3s;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.in_place_src[0]->move_box = true;
  auto o = k.sync(2);
  ASSERT_FALSE(o.p[0]->ok());
  EXPECT_NE(o.p[0]->status().message().find("moved"), std::string::npos) << o.p[0]->status().to_string();
  for (auto& c : o.c) EXPECT_FALSE(c->ok());
  for (auto& c : k.cons) EXPECT_EQ(c->state().version, 1u);
}

// The in-place table travels in the producer's lease: decoding it is bounds-checked.
// A loader written by hand as an inference engine would (vLLM's Llama at tensor
// parallel rank r of t): q/k/v fused into one qkv param and gate/up into gate_up,
// vocab-parallel embedding and lm_head padded to a multiple of 64 rows per rank,
// row-parallel o/down, norms whole. The same code records a plan (recording tensors)
// and loads real bytes (the reference a consumer must match).
struct HandWrittenLlamaLoader {
  int r = 0, t = 1;
  std::map<std::string, TensorDecl> ckpt;

  static int64_t layer_of(const std::string& n) { return std::stoll(n.substr(n.find("layers.") + 7)); }
  Shape shape(const std::string& n) const { return ckpt.at(n).shape; }
  int64_t vocab_rows() const {
    const int64_t v = shape("model.embed_tokens.weight")[0];
    return (v + t - 1) / t + 63 - ((v + t - 1) / t + 63) % 64;
  }
  std::vector<TensorDecl> params() const {
    std::vector<TensorDecl> out;
    const DType dt = ckpt.at("model.embed_tokens.weight").dtype;
    const int64_t hidden = shape("model.embed_tokens.weight")[1];
    out.push_back({"embed.weight", dt, {vocab_rows(), hidden}});
    for (const auto& [n, d] : ckpt) {
      if (n.find("layers.") == std::string::npos) continue;
      const std::string l = fmt::format("layers.{}.", layer_of(n));
      if (n.ends_with("q_proj.weight")) {
        const int64_t rows = (d.shape[0] + 2 * shape(n.substr(0, n.size() - 13) + "k_proj.weight")[0]) / t;
        out.push_back({l + "qkv.weight", dt, {rows, d.shape[1]}});
      } else if (n.ends_with("o_proj.weight")) {
        out.push_back({l + "o.weight", dt, {d.shape[0], d.shape[1] / t}});
      } else if (n.ends_with("gate_proj.weight")) {
        out.push_back({l + "gate_up.weight", dt, {2 * d.shape[0] / t, d.shape[1]}});
      } else if (n.ends_with("down_proj.weight")) {
        out.push_back({l + "down.weight", dt, {d.shape[0], d.shape[1] / t}});
      } else if (n.ends_with("layernorm.weight")) {
        out.push_back({l + (n.find("input_") != std::string::npos ? "in_norm.weight" : "post_norm.weight"), dt, d.shape});
      }
    }
    out.push_back({"norm.weight", dt, shape("model.norm.weight")});
    out.push_back({"lm_head.weight", dt, {vocab_rows(), hidden}});
    return out;
  }
  // Loads checkpoint tensor `n` (source `w`) into `p`, as a weight_loader would.
  Status load(const std::string& n, const Tensor& w, const TensorMap& p) const {
    auto rows = [&](const char* param, int64_t at, const Tensor& part) {
      const int64_t k = part.shape()[0] / t;
      return p.at(param).narrow(0, at, k).copy_(part.narrow(0, r * k, k));
    };
    if (n == "model.embed_tokens.weight" || n == "lm_head.weight") {
      const Tensor& dst = p.at(n == "lm_head.weight" ? "lm_head.weight" : "embed.weight");
      const int64_t per = vocab_rows(), v = w.shape()[0];
      const int64_t begin = std::min(v, r * per), end = std::min(v, (r + 1) * per);
      if (end > begin) FERRY_RETURN_IF_ERROR(dst.narrow(0, 0, end - begin).copy_(w.narrow(0, begin, end - begin)));
      return end - begin < per ? dst.narrow(0, end - begin, per - (end - begin)).zero_() : Status::Ok();
    }
    if (n == "model.norm.weight") return p.at("norm.weight").copy_(w);
    const std::string l = fmt::format("layers.{}.", layer_of(n));
    const std::string base = n.substr(0, n.rfind('.', n.size() - 8) + 1);  // "...self_attn." / "...mlp."
    if (n.ends_with("q_proj.weight")) return rows((l + "qkv.weight").c_str(), 0, w);
    if (n.ends_with("k_proj.weight")) return rows((l + "qkv.weight").c_str(), shape(base + "q_proj.weight")[0] / t, w);
    if (n.ends_with("v_proj.weight"))
      return rows((l + "qkv.weight").c_str(), (shape(base + "q_proj.weight")[0] + w.shape()[0]) / t, w);
    if (n.ends_with("gate_proj.weight")) return rows((l + "gate_up.weight").c_str(), 0, w);
    if (n.ends_with("up_proj.weight")) return rows((l + "gate_up.weight").c_str(), w.shape()[0] / t, w);
    if (n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight")) {
      const int64_t k = w.shape()[1] / t;
      return p.at(l + (n.ends_with("o_proj.weight") ? "o.weight" : "down.weight")).copy_(w.narrow(1, r * k, k));
    }
    if (n.ends_with("layernorm.weight"))
      return p.at(l + (n.find("input_") != std::string::npos ? "in_norm.weight" : "post_norm.weight")).copy_(w);
    return not_found("hand-written loader: unexpected checkpoint tensor '{}'", n);
  }
  Result<Plan> record() const {
    TensorMap params;
    for (const auto& d : this->params()) params.emplace(d.name, Tensor::param(d.name, d.shape, d.dtype));
    Recorder rec;
    for (const auto& [n, d] : ckpt) FERRY_RETURN_IF_ERROR(load(n, Tensor::source(n, d.shape, d.dtype), params));
    return rec.finish();
  }
};

// The engine from a plan recorded by hand-written loader code (Consumer::create with a
// ConsumerModel): every consumer's params bit-identical to that loader run on the whole
// checkpoint of the version, post_process called once per group per sync, and replicas
// (equal plans) sharing producers.
TEST_P(EngineTest, ConsumerFromHandWrittenPlan) {
  Cluster k(GetParam());
  std::mutex mu;
  std::map<std::pair<int, std::string>, int> post_calls;  // (consumer, group) -> calls
  std::vector<HandWrittenLlamaLoader> loaders;
  std::vector<TensorMap> buffers(4);
  k.user_model = [&](int c) -> Result<ConsumerModel> {
    const HandWrittenLlamaLoader& l = loaders.at(static_cast<size_t>(c));
    ConsumerModel m;
    FERRY_ASSIGN_OR_RETURN(m.plan, l.record());
    for (const auto& d : l.params()) {
      // Half the params in the caller's buffers, the rest allocated by the engine.
      if (d.name.find("layers.0.") != std::string::npos || d.name == "embed.weight")
        buffers[static_cast<size_t>(c)].emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
    }
    m.params = buffers[static_cast<size_t>(c)];
    m.post_process = [&, c](const ConsumerModel::PostGroup& g, TensorMap& params) {
      for (const auto& n : g.params) {
        if (!params.count(n)) return internal_error("post group {} names unknown param {}", g.name, n);
      }
      std::lock_guard<std::mutex> lk(mu);
      ++post_calls[{c, g.name}];
      return Status::Ok();
    };
    return m;
  };
  // The checkpoint's shapes are only known once the job model is made: build the loaders
  // lazily, before any consumer starts (start() makes the model, then the threads).
  auto model = tools::make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2", true, "");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  for (int c = 0; c < 4; ++c) {
    HandWrittenLlamaLoader l{c % 2, 2, {}};
    for (const auto& d : model->metadata) l.ckpt.emplace(d.name, d);
    loaders.push_back(std::move(l));
  }
  Status s = k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2");
  ASSERT_TRUE(s.ok()) << s.to_string();
  const Routes& routes = k.prod[0]->routes();
  EXPECT_EQ(routes.consumer_plan[0], routes.consumer_plan[2]) << "replicas share a plan class";
  EXPECT_EQ(routes.consumer_plan[1], routes.consumer_plan[3]);
  EXPECT_NE(routes.consumer_plan[0], routes.consumer_plan[1]);
  for (uint64_t v = 1; v <= 2; ++v) {
    auto o = k.sync(v);
    TensorMap ckpt;
    for (const auto& d : k.model.metadata) ckpt.emplace(d.name, synthetic_tensor(k.seed, v, d));
    for (int c = 0; c < 4; ++c) {
      ASSERT_TRUE(o.c[static_cast<size_t>(c)]->ok()) << o.c[static_cast<size_t>(c)]->status().to_string();
      const HandWrittenLlamaLoader& l = loaders[static_cast<size_t>(c)];
      TensorMap want;
      for (const auto& d : l.params()) want.emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
      for (const auto& [n, t] : ckpt) ASSERT_TRUE(l.load(n, t, want).ok());
      const TensorMap& got = k.cons[static_cast<size_t>(c)]->params();
      for (const auto& [n, w] : want) {
        auto it = got.find(n);
        ASSERT_NE(it, got.end()) << n;
        const uint64_t bytes = shape_numel(w.shape()) * dtype_size(w.dtype());
        EXPECT_EQ(std::memcmp(*it->second.data_ptr(), *w.data_ptr(), bytes), 0)
            << "consumer " << c << " param " << n << " version " << v;
        if (auto b = buffers[static_cast<size_t>(c)].find(n); b != buffers[static_cast<size_t>(c)].end()) {
          EXPECT_EQ(*it->second.data_ptr(), *b->second.data_ptr()) << "the caller's buffer is written in place";
        }
      }
      EXPECT_EQ(k.cons[static_cast<size_t>(c)]->state().version, v);
    }
    for (auto& p : o.p) ASSERT_TRUE(p->ok()) << p->status().to_string();
  }
  std::lock_guard<std::mutex> lk(mu);
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ((post_calls[{c, "pre"}]), 2);
    EXPECT_EQ((post_calls[{c, "post"}]), 2);
    EXPECT_EQ((post_calls[{c, "layer 0"}]), 2);
  }
}

// A plan that disagrees with the trainer's metadata is refused at creation, naming the
// tensor and both shapes.
TEST(EngineUserPlan, MismatchedSourceIsNamed) {
  Cluster k;
  k.eo.rendezvous_timeout = 3s;
  k.user_model = [](int) -> Result<ConsumerModel> {
    ConsumerModel m;
    Recorder rec;
    Tensor p = Tensor::param("x", {4, 8}, DType::kBF16);
    FERRY_RETURN_IF_ERROR(p.copy_(Tensor::source("model.norm.weight", {4, 8}, DType::kBF16)));
    FERRY_ASSIGN_OR_RETURN(m.plan, rec.finish());
    return m;
  };
  ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1").ok());
  const Status s = k.started.at(1);  // the consumer's
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("'model.norm.weight' as BF16 [4, 8]"), std::string::npos) << s.to_string();
}

// --- coordination: creation, world sizes, versions, reports that never lie -------------

// 20 times: every rank syncs the moment its own create() returns (no barrier between
// creation and the first sync). Creation returns only once every participant can
// receive, so no producer reports ok with nothing delivered and every consumer verifies.
TEST_P(EngineInprocTest, SyncRightAfterCreation) {
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE(fmt::format("trial {}", trial));
    Cluster k(GetParam());
    StoreServerOptions sso;
    sso.token = "engine-test-token-0123456789";
    auto server = StoreServer::start(sso);
    ASSERT_TRUE(server.ok());
    k.server = std::move(*server);
    auto model = tools::make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2", true, "");
    ASSERT_TRUE(model.ok());
    k.model = std::move(*model);
    k.eo.job = fmt::format("race{}", trial);
    k.eo.num_producers = k.P();
    k.eo.num_consumers = k.C();
    k.ptr.resize(2), k.pst.resize(2), k.src.resize(2), k.in_place_src.resize(2), k.gpu_src.resize(2), k.prod.resize(2);
    k.ctr.resize(2), k.cst.resize(2), k.cons.resize(2);
    std::vector<std::optional<Result<SyncReport>>> pr(2), cr(2);
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        Status s = k.start_producer(p);
        if (!s.ok()) return pr[static_cast<size_t>(p)].emplace(s), void();
        k.src[static_cast<size_t>(p)]->set_version(1);
        pr[static_cast<size_t>(p)].emplace(k.prod[static_cast<size_t>(p)]->sync(1));
      });
    }
    for (int c = 0; c < 2; ++c) {
      th.emplace_back([&, c] {
        Status s = k.start_consumer(c);
        if (!s.ok()) return cr[static_cast<size_t>(c)].emplace(s), void();
        cr[static_cast<size_t>(c)].emplace(k.cons[static_cast<size_t>(c)]->sync(1));
      });
    }
    for (auto& t : th) t.join();
    for (auto& r : pr) {
      ASSERT_TRUE(r->ok()) << r->status().to_string();
      EXPECT_TRUE((*r)->ok()) << (*r)->to_string();
      EXPECT_GT((*r)->bytes_sent, 0u) << (*r)->to_string();
    }
    for (int c = 0; c < 2; ++c) {
      ASSERT_TRUE(cr[static_cast<size_t>(c)]->ok()) << cr[static_cast<size_t>(c)]->status().to_string();
      k.expect_verified(c, 1);
    }
  }
}

// num_producers / num_consumers that disagree between ranks: an InvalidArgument naming
// both numbers, from the world-size check (not the rendezvous timeout, kept long here).
TEST(EngineCoordination, WrongWorldSizesNameBothNumbers) {
  {
    Cluster k;
    k.eo.rendezvous_timeout = 60s;
    k.tweak_producer = [](ProducerOptions& o, int) { o.num_consumers = 1; };  // 2 consumers run
    ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=2").ok());
    bool named = false;
    for (const Status& s : k.started) {
      if (s.ok()) continue;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      named |= s.message().find("num_consumers=1") != std::string::npos &&
               s.message().find("num_consumers=2") != std::string::npos;
    }
    EXPECT_TRUE(named);
  }
  {
    Cluster k;
    k.eo.rendezvous_timeout = 60s;
    k.tweak_consumer = [](ConsumerOptions& o, int) { o.num_producers = 1; };  // 2 producers run
    ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1").ok());
    for (const Status& s : k.started) {
      if (s.ok()) continue;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
      EXPECT_NE(s.message().find("num_producers=1"), std::string::npos) << s.to_string();
      EXPECT_NE(s.message().find("num_producers=2"), std::string::npos) << s.to_string();
    }
  }
}

// Versions: a consumer syncing another version than the producers fails at once naming
// both (and the producers' reports are not ok, naming it); a rollback to an earlier
// version on every rank syncs it; committed_versions() says what each rank holds.
TEST_P(EngineInprocTest, VersionsMismatchRollbackAndCommitted) {
  Cluster k(GetParam());
  auto mode_of_case = [&] { return k.eo.mode; };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  k.expect_all_ok(k.sync(2), 2);
  // Consumer 1 asks for 4 while the trainer serves 3.
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    th.emplace_back([&] { o.c[1] = k.cons[1]->sync(4); });
    for (auto& t : th) t.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  // Pull: the consumer sees the producers' announcements of 3. Push: the producers see
  // its requests for 4 and drop it, saying why.
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), mode_of_case() == SyncMode::kPush ? StatusCode::kCancelled : StatusCode::kFailedPrecondition)
      << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but"), std::string::npos) << why.to_string();
  EXPECT_NE(why.message().find("serves version 3"), std::string::npos) << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_FALSE((*p)->ok()) << (*p)->to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 2u);
  auto cv = committed_versions(*k.pst[0], k.eo.job, 2);
  ASSERT_TRUE(cv.ok()) << cv.status().to_string();
  EXPECT_EQ(*cv, (std::vector<std::optional<uint64_t>>{3, 2}));
  // Every rank rolls back to version 1: synced and verified, not ignored as stale.
  k.expect_all_ok(k.sync(1), 1);
  for (int c = 0; c < 2; ++c) EXPECT_EQ(k.cons[static_cast<size_t>(c)]->state().version, 1u);
  cv = committed_versions(*k.pst[0], k.eo.job, 2);
  ASSERT_TRUE(cv.ok());
  EXPECT_EQ(*cv, (std::vector<std::optional<uint64_t>>{1, 1}));
}

// Push: consumer 1's requests for 4 reach the producers before their sync of 3 begins
// (held until it sent them); they drop it at once, under its version, naming both.
TEST(EngineCoordination, PushVersionMismatchAskedBeforeTheProducersBegan) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPush});
  std::promise<void> asked;
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 1) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&](int g, int phase) {
      if (g == 0 && phase == 1 && armed.exchange(false)) asked.set_value();
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    armed = true;
    std::thread late([&] { o.c[1] = k.cons[1]->sync(4); });
    asked.get_future().wait();
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    for (auto& t : th) t.join();
    late.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), StatusCode::kCancelled) << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but this producer serves version 3"), std::string::npos)
      << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
    EXPECT_EQ((*p)->dropped, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 1u);
  k.expect_all_ok(k.sync(2), 2);
}

// Pull: the producers' announcements of 3 reach consumer 1 before its sync of 4 begins
// (it starts once consumer 0 reads group 1, so every announcement of group 0 was
// delivered); it fails at once naming both versions, not at its timeout.
TEST(EngineCoordination, PullVersionMismatchAnnouncedBeforeTheConsumerBegan) {
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull});
  std::promise<void> announced;
  std::atomic<bool> armed{false};
  k.tweak_consumer = [&](ConsumerOptions& o, int c) {
    if (c != 0) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&](int g, int phase) {
      if (g == 1 && phase == 1 && armed.exchange(false)) announced.set_value();
    };
    o.test_hooks = hooks;
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  Cluster::Outcome o;
  o.p.resize(2), o.c.resize(2);
  {
    armed = true;
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        k.src[static_cast<size_t>(p)]->set_version(3);
        o.p[static_cast<size_t>(p)] = k.prod[static_cast<size_t>(p)]->sync(3);
      });
    }
    th.emplace_back([&] { o.c[0] = k.cons[0]->sync(3); });
    announced.get_future().wait();
    o.c[1] = k.cons[1]->sync(4);
    for (auto& t : th) t.join();
  }
  ASSERT_TRUE(o.c[0]->ok()) << o.c[0]->status().to_string();
  ASSERT_FALSE(o.c[1]->ok());
  const Status& why = o.c[1]->status();
  EXPECT_EQ(why.code(), StatusCode::kFailedPrecondition) << why.to_string();
  EXPECT_NE(why.message().find("syncs version 4 but"), std::string::npos) << why.to_string();
  EXPECT_NE(why.message().find("serves version 3"), std::string::npos) << why.to_string();
  for (auto& p : o.p) {
    ASSERT_TRUE(p->ok()) << p->status().to_string();
    EXPECT_EQ((*p)->missed, std::vector<int>{1}) << (*p)->to_string();
  }
  k.expect_verified(0, 3);
  EXPECT_EQ(k.cons[1]->state().version, 1u);
  k.expect_all_ok(k.sync(2), 2);
}

// Consumer `victim` sleeps `pause` before waiting for group 1 of every sync while `stall`
// is set (a paused or slow rank, through the consumer's test hook).
void stall_at_group_1(Cluster& k, int victim, std::chrono::milliseconds pause, const std::atomic<bool>& stall) {
  k.tweak_consumer = [&stall, victim, pause](ConsumerOptions& o, int c) {
    if (c != victim) return;
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&stall, pause](int g, int phase) {
      if (stall && g == 1 && phase == 0) std::this_thread::sleep_for(pause);
    };
    o.test_hooks = hooks;
  };
}

// A consumer that is a member of the job but absent from a sync (its lease gone) is
// named in every report of the producers that serve it, which are then not ok; one that
// stalls is dropped and told why.
TEST(EngineCoordination, AbsentAndDroppedConsumersAreNamed) {
  Cluster k;
  k.eo.stall_timeout = 600ms;
  std::atomic<bool> stall{false};
  stall_at_group_1(k, 1, 1500ms, stall);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  stall = true;
  auto o = k.sync(2);
  stall = false;
  ASSERT_TRUE(o.p[0]->ok());
  EXPECT_FALSE((*o.p[0])->ok());
  EXPECT_EQ((*o.p[0])->missed, std::vector<int>{1});
  EXPECT_EQ((*o.p[0])->dropped, std::vector<int>{1});
  ASSERT_FALSE(o.c[1]->ok());
  EXPECT_NE(o.c[1]->status().message().find("dropped from sync 2 by producer 0: stalled"), std::string::npos)
      << o.c[1]->status().to_string();
  k.expect_verified(0, 2);
  // Consumer 1 leaves (its lease released): the next sync names it.
  k.cons[1].reset();
  std::vector<std::thread> th;
  std::optional<Result<SyncReport>> pr, cr;
  th.emplace_back([&] {
    k.src[0]->set_version(3);
    pr = k.prod[0]->sync(3);
  });
  th.emplace_back([&] { cr = k.cons[0]->sync(3); });
  for (auto& t : th) t.join();
  ASSERT_TRUE(cr->ok()) << cr->status().to_string();
  ASSERT_TRUE(pr->ok());
  EXPECT_FALSE((*pr)->ok());
  EXPECT_EQ((*pr)->missed, std::vector<int>{1});
  EXPECT_NE((*pr)->to_string().find("consumer 1 is not a member of sync 3"), std::string::npos) << (*pr)->to_string();
  // It restarts: the next sync is whole again.
  ASSERT_TRUE(k.start_consumer(1).ok());
  auto o4 = k.sync(4);
  k.expect_all_ok(o4, 4);
  EXPECT_TRUE((*o4.p[0])->ok()) << (*o4.p[0])->to_string();
}

// A straggler (one consumer of three stops for 2.5 s at group 1) is dropped once it lags
// the other two by the straggler bound, long before stall_timeout (20 s here): the drop
// says "straggler", the others verify, and it catches up at the next sync.
TEST_P(EngineInprocTest, StragglerIsDroppedEarlyAndCatchesUp) {
  Cluster k(GetParam());
  std::atomic<bool> stall{false};
  k.eo.straggler_floor = 500ms;
  stall_at_group_1(k, 2, 2500ms, stall);
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=3").ok());
  k.expect_all_ok(k.sync(1), 1);
  stall = true;
  auto o = k.sync(2);
  stall = false;
  ASSERT_TRUE(o.p[0]->ok()) << o.p[0]->status().to_string();
  EXPECT_EQ((*o.p[0])->dropped, std::vector<int>{2}) << (*o.p[0])->to_string();
  EXPECT_EQ((*o.p[0])->missed, std::vector<int>{2});
  EXPECT_NE((*o.p[0])->to_string().find("dropped consumer 2: straggler"), std::string::npos) << (*o.p[0])->to_string();
  ASSERT_FALSE(o.c[2]->ok());
  EXPECT_NE(o.c[2]->status().message().find("straggler"), std::string::npos) << o.c[2]->status().to_string();
  k.expect_verified(0, 2);
  k.expect_verified(1, 2);
  auto o3 = k.sync(3);
  k.expect_all_ok(o3, 3);
  EXPECT_TRUE((*o3.p[0])->ok()) << (*o3.p[0])->to_string();
}

// A lease lost while its holder was paused (the key expired: removed here) heals: the
// consumer is named as missing in at most one sync and verifies again within two.
TEST(EngineCoordination, LostLeaseHealsWithinTwoSyncs) {
  Cluster k;
  k.eo.lease_ttl = 300ms;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  ASSERT_TRUE(k.pst[0]->remove(engine::JobKeys(k.eo.job).consumer(1)).ok());
  ASSERT_TRUE(k.pst[0]->remove(engine::JobKeys(k.eo.job).producer(0)).ok());
  auto o2 = k.sync(2);  // consumer 1 may be missed here, never silently
  ASSERT_TRUE(o2.p[0]->ok());
  if (!(*o2.p[0])->ok()) {
    EXPECT_EQ((*o2.p[0])->missed, std::vector<int>{1}) << (*o2.p[0])->to_string();
  }
  ASSERT_TRUE(o2.c[0]->ok()) << "a producer whose lease lapsed keeps serving: " << o2.c[0]->status().to_string();
  std::this_thread::sleep_for(300ms);  // a heartbeat (ttl/3) has run
  auto o3 = k.sync(3);
  k.expect_all_ok(o3, 3);
  EXPECT_TRUE((*o3.p[0])->ok()) << (*o3.p[0])->to_string();
}

// The store goes away (its server stopped): every rank's next sync fails within the
// store's connect_timeout with an error naming the store's URL. Restarted on the same
// port without its data, the store is reconnected to: the next sync succeeds everywhere
// (leases healed, and the rendezvous keys every rank published once re-published), and a
// rank started afterwards finds what it needs to rendezvous.
TEST(EngineCoordination, StoreAwayFailsNamingItThenRestartedStoreRecovers) {
  Cluster k;
  k.store_connect_timeout = 1000ms;
  k.eo.lease_ttl = 300ms;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2", R"({"num_hidden_layers": 2})").ok());
  k.expect_all_ok(k.sync(1), 1);
  const uint16_t port = k.server->port();
  const std::string url = k.server->url();
  k.server->stop();
  k.server.reset();
  auto away = k.sync(2);
  for (size_t p = 0; p < away.p.size(); ++p) {
    ASSERT_FALSE(away.p[p]->ok()) << "producer " << p << " synced without its store";
    EXPECT_NE(away.p[p]->status().message().find(url), std::string::npos) << away.p[p]->status().to_string();
  }
  for (size_t c = 0; c < away.c.size(); ++c) {
    ASSERT_FALSE(away.c[c]->ok()) << "consumer " << c << " synced without its store";
    EXPECT_NE(away.c[c]->status().message().find(url), std::string::npos) << away.c[c]->status().to_string();
    EXPECT_FALSE(k.cons[c]->state().torn);
  }
  std::printf("store away: %s\n", away.c[0]->status().to_string().c_str());

  StoreServerOptions sso;
  sso.token = "engine-test-token-0123456789";
  sso.port = port;
  auto restarted = StoreServer::start(sso);
  ASSERT_TRUE(restarted.ok()) << restarted.status().to_string();
  k.server = std::move(*restarted);
  auto o3 = k.sync(3);
  for (size_t p = 0; p < o3.p.size(); ++p) {
    ASSERT_TRUE(o3.p[p]->ok()) << "producer " << p << ": " << o3.p[p]->status().to_string();
    EXPECT_TRUE((*o3.p[p])->ok()) << (*o3.p[p])->to_string();
  }
  for (size_t c = 0; c < o3.c.size(); ++c) {
    ASSERT_TRUE(o3.c[c]->ok()) << "consumer " << c << ": " << o3.c[c]->status().to_string();
    k.expect_verified(static_cast<int>(c), 3);
  }
  const engine::JobKeys keys(k.eo.job);
  auto check = k.store();
  ASSERT_TRUE(check.ok());
  EXPECT_TRUE((*check)->get(keys.meta()).ok()) << "metadata re-published";
  for (int p = 0; p < k.P(); ++p) EXPECT_TRUE((*check)->get(keys.holdings(p)).ok()) << "holdings of " << p;
  for (int c = 0; c < k.C(); ++c) EXPECT_TRUE((*check)->get(keys.plan(c)).ok()) << "plan of " << c;
  // A new instance of consumer 1 rendezvouses with the re-published keys and syncs.
  ASSERT_TRUE(k.start_consumer(1).ok());
  k.expect_all_ok(k.sync(4), 4);
}

TEST(InPlaceTable, RoundTripAndMalformedBytes) {
  engine::InPlaceTable t;
  t.min_bytes = 4096;
  t.keys = {"key-a", "key-b"};
  t.boxes = {{0, 128}, {-1, 0}, {1, 1 << 20}};
  const std::string bytes = t.encode();
  auto d = engine::InPlaceTable::decode(bytes, 3);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->min_bytes, 4096u);
  EXPECT_EQ(d->keys, t.keys);
  ASSERT_EQ(d->boxes.size(), 3u);
  EXPECT_EQ(d->boxes[2].region, 1);
  EXPECT_EQ(d->boxes[2].offset, uint64_t{1} << 20);
  EXPECT_TRUE(engine::InPlaceTable::decode("", 3)->empty());  // no source regions
  EXPECT_EQ(engine::InPlaceTable::decode(bytes, 4).status().code(), StatusCode::kCorrupt);  // box count
  for (size_t n = 1; n < bytes.size(); n += 7)
    EXPECT_FALSE(engine::InPlaceTable::decode(bytes.substr(0, n), 3).ok()) << "truncated at " << n;
  t.boxes[1].region = 2;  // names a region the table lacks
  EXPECT_EQ(engine::InPlaceTable::decode(t.encode(), 3).status().code(), StatusCode::kCorrupt);
}

// A push consumer's param table travels in its lease: decoding it is bounds-checked.
TEST(ParamTable, RoundTripAndMalformedBytes) {
  engine::ParamTable t;
  t.min_bytes = 4096;
  t.keys = {"k0", "k1"};
  t.params["a"] = {0, 0, 128};
  t.params["b"] = {1, 64, 4096};
  const std::string bytes = t.encode();
  auto d = engine::ParamTable::decode(bytes);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->min_bytes, 4096u);
  EXPECT_EQ(d->keys, t.keys);
  ASSERT_EQ(d->params.size(), 2u);
  EXPECT_EQ(d->params.at("b").key, 1u);
  EXPECT_EQ(d->params.at("b").offset, 64u);
  EXPECT_EQ(d->params.at("b").bytes, 4096u);
  EXPECT_TRUE(engine::ParamTable::decode("")->empty());  // nothing registered
  for (size_t n = 1; n < bytes.size(); ++n)
    EXPECT_FALSE(engine::ParamTable::decode(bytes.substr(0, n)).ok()) << "truncated at " << n;
  t.params["c"] = {2, 0, 8};  // names a registration the table lacks
  EXPECT_EQ(engine::ParamTable::decode(t.encode()).status().code(), StatusCode::kCorrupt);
  t.params.erase("c");
  t.params["d"] = {0, UINT64_MAX, 2};  // offset + bytes overflows
  EXPECT_EQ(engine::ParamTable::decode(t.encode()).status().code(), StatusCode::kCorrupt);
}

// --- weights in GPU memory (issue #19) ---------------------------------------------------

// Params that say they live on cuda:0, on a machine with no usable CUDA device: the
// consumer is refused at create, before its rendezvous, naming the param, the device and
// why (cuda_status); nothing touches the (fake) device pointer.
TEST(EngineDevice, GpuParamsWithoutAUsableDeviceAreRefusedAtCreate) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here: EngineDevice.SyncsFromGpuMemoryIntoGpuMemory covers it";
  Cluster k;
  k.eo.rendezvous_timeout = 3000ms;
  k.caller_params = true;
  k.param_factory = [](const TensorDecl& d) -> Result<Tensor> {
    return Tensor::borrow_device(reinterpret_cast<void*>(uintptr_t{0x10000}), d.shape, d.dtype, Device::cuda(0), nullptr,
                                 d.name);
  };
  Status st = k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1", R"({"num_hidden_layers": 1})");
  ASSERT_FALSE(st.ok());
  bool named = false;
  for (const Status& s : k.started) {
    if (s.ok()) continue;
    named |= s.code() == StatusCode::kUnavailable && s.message().find("cuda:0") != std::string::npos &&
             s.message().find(cuda_status().detail) != std::string::npos;
  }
  EXPECT_TRUE(named) << st.to_string();
}

// A consumer param in cuda:0 memory (Cluster::param_factory; called from the consumers'
// threads at once: the tensor itself keeps its memory).
Result<Tensor> gpu_param(const TensorDecl& d) {
  const size_t bytes = static_cast<size_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(Device::cuda(0), bytes));
  return Tensor::borrow_device(mem.get(), d.shape, d.dtype, Device::cuda(0), mem, d.name);
}

// Trainer weights and inference params both in GPU memory (one device, threads as
// ranks): packed by a kernel into host staging, moved by the transport, unpacked by a
// kernel into the params; verified bit for bit after each of two syncs, pull and push.
TEST(EngineDevice, SyncsFromGpuMemoryIntoGpuMemory) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  for (Mode mode : {Mode::kPull, Mode::kPush}) {
    SCOPED_TRACE(mode == Mode::kPull ? "pull" : "push");
    Cluster k(EngineCase{Backend::kInproc, mode});
    k.gpu_sources = true;
    k.caller_params = true;
    k.param_factory = gpu_param;
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
    k.expect_all_ok(k.sync(1), 1);
    k.expect_all_ok(k.sync(2), 2);
  }
}

// GPU staging without a usable device: every producer is refused at create, before its
// rendezvous, naming the option, the device and why.
TEST(EngineDevice, GpuStagingWithoutAUsableDeviceIsRefusedAtCreate) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here: EngineDevice.SyncsThroughGpuStagingDeviceToDevice covers it";
  Cluster k;
  k.eo.rendezvous_timeout = 3000ms;
  k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
  Status st = k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1", R"({"num_hidden_layers": 1})");
  ASSERT_FALSE(st.ok());
  bool named = false;
  for (const Status& s : k.started) {
    named |= s.code() == StatusCode::kUnavailable && s.message().find("staging_device cuda:0") != std::string::npos &&
             s.message().find(cuda_status().detail) != std::string::npos;
  }
  EXPECT_TRUE(named) << st.to_string();
}

// Staging in GPU memory, read device to device (ConsumerOptions::cuda_ipc; ranks as
// threads, so the consumer maps the producer's staging pointer itself): two syncs, pull,
// verified bit for bit; every byte such a consumer receives was copied device to
// device. A consumer with cuda_ipc off reads the same producers' host staging through
// the transport and verifies too.
TEST(EngineDevice, SyncsThroughGpuStagingDeviceToDevice) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  Cluster k(EngineCase{Backend::kInproc, Mode::kPull});
  k.gpu_sources = true;
  k.caller_params = true;
  k.param_factory = gpu_param;
  k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
  k.tweak_consumer = [](ConsumerOptions& o, int c) { o.cuda_ipc = c != 3; };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  for (uint64_t v : {1u, 2u}) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    for (size_t c = 0; c < o.c.size(); ++c) {
      ASSERT_TRUE(o.c[c]->ok());
      const SyncReport& r = **o.c[c];
      EXPECT_GT(r.bytes_received, 0u);
      EXPECT_EQ(r.received_via_cuda_ipc, c == 3 ? 0u : r.bytes_received) << "consumer " << c << ": " << r.to_string();
    }
  }
}

}  // namespace
}  // namespace ferry
