// Ranks-as-threads tests of the engine: in-process TCP store server, real model
// loaders, synthetic trainer data; every consumer verified bit for bit against a direct
// load of the same version. One suite, instantiated per transport (inproc; UCX over
// sm,tcp,self, every rank its own Transport in this process) and per mode (pull, push,
// pull with the trainer's weights served in place); tests of what only one transport
// has (inproc's failure injection) are instantiated for that transport only.
#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <ostream>
#include <set>
#include <thread>

#include "engine/in_place.h"
#include "engine/testing.h"
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
// (ProducerOptions::source_regions over InPlaceSource).
enum class Mode { kPull, kPush, kInPlace };

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
  bool in_place = false;       // producers serve from InPlaceSource regions
  Backend backend = Backend::kInproc;
  static inline std::atomic<int> job_counter{0};

  explicit Cluster(EngineCase c = {Backend::kInproc, Mode::kPull}) : backend(c.backend) {
    eo.timeout = 20s;
    eo.stall_timeout = 20s;
    eo.lease_ttl = 2000ms;
    eo.rendezvous_timeout = 30s;
    eo.mode = c.mode == Mode::kPush ? SyncMode::kPush : SyncMode::kPull;
    in_place = c.mode == Mode::kInPlace;
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
  Result<std::unique_ptr<Store>> store() {
    StoreOptions so;
    so.token = "engine-test";
    return Store::open(server->url(), so);
  }

  Status start(const std::string& config, const std::string& trainer, const std::string& inference,
               const std::string& overrides = "") {
    StoreServerOptions sso;
    sso.token = "engine-test";
    FERRY_ASSIGN_OR_RETURN(server, StoreServer::start(sso));
    FERRY_ASSIGN_OR_RETURN(model, tools::make_job_model(config, trainer, inference, true, overrides));
    eo.job = fmt::format("job{}", job_counter++);
    eo.num_producers = P();
    eo.num_consumers = C();
    ptr.resize(static_cast<size_t>(P()));
    pst.resize(static_cast<size_t>(P()));
    src.resize(static_cast<size_t>(P()));
    in_place_src.resize(static_cast<size_t>(P()));
    prod.resize(static_cast<size_t>(P()));
    ctr.resize(static_cast<size_t>(C()));
    cst.resize(static_cast<size_t>(C()));
    cons.resize(static_cast<size_t>(C()));
    std::vector<Status> st(static_cast<size_t>(P() + C()));
    std::vector<std::thread> th;
    for (int p = 0; p < P(); ++p) th.emplace_back([&, p] { st[static_cast<size_t>(p)] = start_producer(p); });
    for (int c = 0; c < C(); ++c) th.emplace_back([&, c] { st[static_cast<size_t>(P() + c)] = start_consumer(c); });
    for (auto& t : th) t.join();
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
    TensorMap params;
    if (caller_params) {
      FERRY_ASSIGN_OR_RETURN(auto rl, model.loader->rank(c));
      for (const ParamInfo& p : rl->params())
        params.emplace(p.decl.name, Tensor::empty(p.decl.shape, p.decl.dtype, p.decl.name));
    }
    FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(*model.loader, c, *ctr[i], *cst[i], co, params));
    if (caller_params) {  // the consumer works in the caller's buffers, not copies
      for (const auto& [name, t] : params) {
        auto it = cons[i]->params().find(name);
        if (it == cons[i]->params().end() || *it->second.data_ptr() != *t.data_ptr())
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
    auto r = tools::verify_params(model, c, cons[static_cast<size_t>(c)]->params(), seed, v);
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
// Consumers reading into params: the pull modes (push writes whole segments into the
// receive ring), every transport.
class EngineZeroCopyTest : public EngineTest {};
// Producers serving in place: every transport, in-place mode.
class EngineInPlaceTest : public EngineTest {};

INSTANTIATE_TEST_SUITE_P(Cases, EngineTest, cases(kAllBackends, kAllModes), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineInprocTest, cases({Backend::kInproc}, kAllModes), case_name_of);
INSTANTIATE_TEST_SUITE_P(Cases, EngineZeroCopyTest, cases(kAllBackends, {Mode::kPull, Mode::kInPlace}), case_name_of);
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
    // Zero-copy (pull): most bytes are read straight into the params; what is left
    // (small pieces) went through the receive ring and was unpacked, and the params
    // verified. Push writes every byte into receive slots.
    for (auto& c : o.c) {
      if (mode() == Mode::kPush) {
        EXPECT_EQ((**c).received_into_params, 0u);
      } else {
        EXPECT_GT((**c).received_into_params, 0u);
        EXPECT_LT((**c).received_into_params, (**c).bytes_received);
      }
    }
    // In place: producers serve most bytes from the trainer's memory, small pieces (the
    // norms, under direct_min_bytes) from staging.
    if (mode() == Mode::kInPlace) {
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

// Zero-copy reads into params, whatever the threshold: every piece (0), the default, or
// none (everything through the receive ring); params allocated by the consumer or by
// the caller (registered one by one); with checksums, which then cover bytes that landed
// in params. Every consumer verified bit for bit, every sync.
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

// The only holder of some boxes dies mid-sync: consumers fail naming it and report torn;
// once it is back, the next sync recovers.
TEST_P(EngineInprocTest, OnlyHolderDiesThenRecovers) {
  Cluster k(GetParam());
  k.tweak_producer = [&k](ProducerOptions& o, int p) {
    if (p != 1) return;
    engine::TestHooks hooks;
    hooks.before_materialize = [&k](uint64_t v, int g) {
      if (v == 2 && g == 2) k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
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
  k.tweak_producer = [&k](ProducerOptions& o, int p) {
    if (p != 1) return;
    // (The crashed producer's own sync thread, which a dead process would not have,
    // ends at its first refused send: no stall timeout involved.)
    engine::TestHooks hooks;
    hooks.before_materialize = [&k](uint64_t v, int g) {
      if (v == 2 && g == 2) k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
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

// Producers serve from the trainer's memory in place (ProducerOptions::source_regions):
// pieces that are contiguous runs of a box are neither packed nor staged; consumers read
// them from the source region, into params or the ring. Every consumer verified bit for
// bit, with checksums (which then cover in-place bytes), at thresholds from every piece
// to none; push mode ignores source_regions (it writes whole staged segments).
TEST_P(EngineInPlaceTest, ServesWithoutStaging) {
  struct Case {
    uint64_t min_bytes;
    SyncMode mode;
    uint64_t consumer_min;
  };
  for (Case t : {Case{0, SyncMode::kPull, 0}, Case{4096, SyncMode::kPull, 64 * 1024},
                 Case{0, SyncMode::kPull, UINT64_MAX}, Case{UINT64_MAX, SyncMode::kPull, 0},
                 Case{0, SyncMode::kPush, 0}}) {
    SCOPED_TRACE(fmt::format("producer min {} mode {} consumer min {}", t.min_bytes, sync_mode_name(t.mode),
                             t.consumer_min));
    Cluster k(GetParam());
    k.in_place = true;  // also in push, which ignores it
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
      if (t.mode == SyncMode::kPush || t.min_bytes == UINT64_MAX) {
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

}  // namespace
}  // namespace ferry
