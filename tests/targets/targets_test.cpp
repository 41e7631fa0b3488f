// Targets (ferry/targets.h), ranks as threads over the in-process transport and the
// embedded store:
// - target_job names, and agree_switch's one decision per version (every vote ready,
//   one not ready, every rank unchanged, a rank that never votes);
// - a LoRA adapter target (FSDP-sharded on two trainer ranks, tp=2 on the engine) in
//   adapter slots, with reader threads on both ranks: every lease a reader takes holds
//   exactly one whole version; an unchanged version is kept under its old name; a
//   producer killed mid-sync leaves the old adapter serving on both ranks; only the
//   adapter's bytes move;
// - the main model and its draft in one job, each a target with its own versions.
#include <gtest/gtest.h>

#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include "engine/testing.h"
#include "ferry/engine.h"
#include "ferry/targets.h"
#include "tools/job_model.h"
#include "test_paths.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

constexpr const char* kToken = "targets-test-token-0123456789";

struct StoreFixture {
  std::unique_ptr<StoreServer> server;
  Status start() {
    StoreServerOptions o;
    o.token = kToken;
    FERRY_ASSIGN_OR_RETURN(server, StoreServer::start(o));
    return Status::Ok();
  }
  Result<std::unique_ptr<Store>> open() {
    StoreOptions so;
    so.token = kToken;
    return Store::open(server->url(), so);
  }
};

Result<std::unique_ptr<Transport>> inproc() {
  TransportOptions o;
  o.backend = "inproc";
  return Transport::create(o);
}

EngineOptions engine_options(std::string job, int producers, int consumers) {
  EngineOptions eo;
  eo.job = std::move(job);
  eo.num_producers = producers;
  eo.num_consumers = consumers;
  eo.timeout = 20s;
  eo.stall_timeout = 3000ms;
  eo.straggler_floor = 500ms;
  eo.join_window = 1000ms;
  eo.lease_ttl = 1000ms;
  eo.rendezvous_timeout = 30s;
  eo.checksums = true;  // (SyncReport::unchanged)
  return eo;
}

TEST(TargetJob, NamesAJobPerTargetAndRefusesBadNames) {
  EXPECT_EQ(*target_job("rl", ""), "rl");
  EXPECT_EQ(*target_job("rl", "draft"), "rl#draft");
  EXPECT_EQ(*target_job("rl", "lora-math.v2_a"), "rl#lora-math.v2_a");
  EXPECT_EQ(target_job("rl", "a/b").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(target_job("rl", "a#b").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(target_job("rl", std::string(65, 'a')).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(target_job("r#l", "draft").status().code(), StatusCode::kInvalidArgument);
}

// --- agree_switch ------------------------------------------------------------------------

struct Votes {
  StoreFixture fx;
  std::vector<std::unique_ptr<Store>> stores;
  void start(int n) {
    ASSERT_TRUE(fx.start().ok());
    for (int r = 0; r < n; ++r) {
      auto s = fx.open();
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      stores.push_back(std::move(*s));
    }
  }
  // Every rank in `voting` votes at once; the decisions by rank.
  std::map<int, Result<SwitchDecision>> run(uint64_t v, const std::vector<int>& group, std::map<int, SwitchVote> votes,
                                            std::chrono::milliseconds timeout = 10s) {
    std::map<int, std::optional<Result<SwitchDecision>>> got;
    for (const auto& [r, vote] : votes) got[r];
    std::vector<std::thread> th;
    for (const auto& [r, vote] : votes) {
      th.emplace_back([&, r = r, vote = vote] {
        got[r] = agree_switch(*stores[static_cast<size_t>(r)], "job", v, r, group, vote, timeout);
      });
    }
    for (auto& t : th) t.join();
    std::map<int, Result<SwitchDecision>> out;
    for (auto& [r, d] : got) out.emplace(r, std::move(*d));
    return out;
  }
};

SwitchVote ready(bool changed = true) { return SwitchVote{true, changed, ""}; }
SwitchVote not_ready(std::string why) { return SwitchVote{false, true, std::move(why)}; }

TEST(AgreeSwitch, EveryRankGetsOneDecision) {
  Votes k;
  ASSERT_NO_FATAL_FAILURE(k.start(3));
  const std::vector<int> group{0, 1, 2};
  for (const auto& [r, d] : k.run(1, group, {{0, ready()}, {1, ready(false)}, {2, ready()}})) {
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(*d, SwitchDecision::kSwitch) << "rank " << r;
  }
  // One rank did not receive it: every rank aborts, whatever the order of the votes.
  for (const auto& [r, d] : k.run(2, group, {{0, ready()}, {1, not_ready("sync failed")}, {2, ready()}})) {
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(*d, SwitchDecision::kAbort) << "rank " << r;
  }
  // Nobody's bytes changed: kept.
  for (const auto& [r, d] : k.run(3, group, {{0, ready(false)}, {1, ready(false)}, {2, ready(false)}})) {
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(*d, SwitchDecision::kKeep) << "rank " << r;
  }
  // Rank 2 never votes: the others abort after the timeout; rank 2 voting ready later
  // follows the decision made without it.
  for (const auto& [r, d] : k.run(4, group, {{0, ready()}, {1, ready()}}, 300ms)) {
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    EXPECT_EQ(*d, SwitchDecision::kAbort) << "rank " << r;
  }
  auto late = agree_switch(*k.stores[2], "job", 4, 2, group, ready(), 10s);
  ASSERT_TRUE(late.ok()) << late.status().to_string();
  EXPECT_EQ(*late, SwitchDecision::kAbort);
  EXPECT_EQ(agree_switch(*k.stores[0], "job", 5, 3, group, ready(), 1s).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(agree_switch(*k.stores[0], "job", 5, 0, {}, ready(), 1s).status().code(), StatusCode::kInvalidArgument);
}

// --- a LoRA adapter in slots ---------------------------------------------------------------

// LoRA on q_proj and v_proj of 2 layers (hidden 256, rank 16), in the PEFT checkpoint's
// names. The trainer holds each tensor's rows split in two (FSDP dim-0 shards); the
// engine is tp=2, as vLLM shards a column-parallel layer's LoRA: lora_A whole on every
// rank, lora_B by output rows.
struct LoraJob {
  static constexpr int64_t kHidden = 256, kRank = 16, kLayers = 2;
  std::vector<TensorDecl> metadata;
  std::shared_ptr<std::vector<Holdings>> holdings = std::make_shared<std::vector<Holdings>>(2);
  LoraJob() {
    for (int l = 0; l < kLayers; ++l) {
      for (auto [proj, out] : {std::pair<const char*, int64_t>{"q_proj", kHidden}, {"v_proj", kHidden / 4}}) {
        const std::string base = fmt::format("base_model.model.model.layers.{}.self_attn.{}.", l, proj);
        metadata.push_back({base + "lora_A.weight", DType::kBF16, {kRank, kHidden}});
        metadata.push_back({base + "lora_B.weight", DType::kBF16, {out, kRank}});
      }
    }
    for (const TensorDecl& d : metadata) {
      const int64_t half = d.shape[0] / 2;
      for (int p = 0; p < 2; ++p) (*holdings)[static_cast<size_t>(p)].add(d, Box{{p * half, 0}, {half, d.shape[1]}}).ignore();
    }
  }
  static bool is_b(const TensorDecl& d) { return d.name.find("lora_B") != std::string::npos; }
  static std::string param_name(const TensorDecl& d) {  // "layers.0.q_proj.lora_b"
    const size_t at = d.name.find("layers.");
    std::string n = d.name.substr(at, d.name.find(".lora_") - at);
    n.erase(n.find("self_attn."), 10);
    return n + (is_b(d) ? ".lora_b" : ".lora_a");
  }
  Result<ConsumerModel> model(int rank) const {
    ConsumerModel m;
    for (const TensorDecl& d : metadata) {
      FERRY_ASSIGN_OR_RETURN(uint32_t s, m.plan.declare_source(d));
      const Shape kept = is_b(d) ? Shape{d.shape[0] / 2, d.shape[1]} : d.shape;
      FERRY_ASSIGN_OR_RETURN(uint32_t p, m.plan.declare_param({param_name(d), d.dtype, kept}));
      Copy c{s, p, Layout::contiguous(kept, is_b(d) ? rank * kept[0] * kept[1] : 0), Layout::contiguous(kept)};
      FERRY_RETURN_IF_ERROR(m.plan.add_copy(c));
    }
    m.plan.canonicalize();
    FERRY_RETURN_IF_ERROR(m.plan.validate());
    return m;
  }
  uint64_t kept_bytes(int rank) const {
    uint64_t b = 0;
    for (const TensorDecl& d : metadata) b += static_cast<uint64_t>(shape_numel(d.shape)) * 2 / (is_b(d) ? 2 : 1);
    (void)rank;
    return b;
  }
  // XXH64 over rank `rank`'s params at `version`, in name order (what a lease must hash to).
  uint64_t expected_hash(int rank, uint64_t seed, uint64_t version) const {
    std::map<std::string, std::string> bytes;
    for (const TensorDecl& d : metadata) {
      Tensor full = synthetic_tensor(seed, version, d);
      const std::byte* p = *full.data_ptr();
      const size_t n = static_cast<size_t>(full.nbytes());
      bytes[param_name(d)] = is_b(d) ? std::string(reinterpret_cast<const char*>(p) + rank * n / 2, n / 2)
                                     : std::string(reinterpret_cast<const char*>(p), n);
    }
    XXH64_state_t* st = XXH64_createState();
    XXH64_reset(st, 0);
    for (const auto& [name, b] : bytes) XXH64_update(st, b.data(), b.size());
    const uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
  }
};

uint64_t hash_params(const TensorMap& params) {
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  for (const auto& [name, t] : params) XXH64_update(st, *t.data_ptr(), static_cast<size_t>(t.nbytes()));
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

struct AdapterCluster {
  static constexpr uint64_t kSeed = 11;
  StoreFixture fx;
  LoraJob lora;
  EngineOptions eo = engine_options(*target_job("rl", "lora-math"), 2, 2);
  std::vector<std::unique_ptr<Transport>> ptr{2}, ctr{2};
  std::vector<std::unique_ptr<Store>> pst{2}, cst{2};
  std::vector<std::unique_ptr<SyntheticSource>> src{2};
  std::vector<std::unique_ptr<Producer>> prod{2};
  std::vector<std::unique_ptr<AdapterSlots>> slots{2};
  std::function<void(ProducerOptions&, int)> tweak_producer;
  std::function<void(ConsumerOptions&, int)> tweak_consumer;
  std::chrono::milliseconds slot_wait{5000};

  Status start_producer(int p) {
    const size_t i = static_cast<size_t>(p);
    prod[i].reset();
    FERRY_ASSIGN_OR_RETURN(ptr[i], inproc());
    FERRY_ASSIGN_OR_RETURN(pst[i], fx.open());
    src[i] = std::make_unique<SyntheticSource>(lora.metadata, lora.holdings, p, kSeed);
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    if (tweak_producer) tweak_producer(po, p);
    FERRY_ASSIGN_OR_RETURN(prod[i], Producer::create(*src[i], *ptr[i], *pst[i], po));
    return Status::Ok();
  }
  Status start_consumer(int c) {
    const size_t i = static_cast<size_t>(c);
    FERRY_ASSIGN_OR_RETURN(ctr[i], inproc());
    FERRY_ASSIGN_OR_RETURN(cst[i], fx.open());
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    if (tweak_consumer) tweak_consumer(co, c);
    FERRY_ASSIGN_OR_RETURN(ConsumerModel m, lora.model(c));
    AdapterSlotOptions so;
    so.adapter = "math";
    so.switch_timeout = 10s;
    so.slot_wait = slot_wait;
    FERRY_ASSIGN_OR_RETURN(slots[i], AdapterSlots::create(std::move(m), c, *ctr[i], *cst[i], co, so));
    return Status::Ok();
  }
  Status start() {
    FERRY_RETURN_IF_ERROR(fx.start());
    std::vector<Status> st(4);
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) th.emplace_back([&, p] { st[static_cast<size_t>(p)] = start_producer(p); });
    for (int c = 0; c < 2; ++c) th.emplace_back([&, c] { st[static_cast<size_t>(2 + c)] = start_consumer(c); });
    for (auto& t : th) t.join();
    for (const Status& s : st) FERRY_RETURN_IF_ERROR(s);
    return Status::Ok();
  }
  struct Outcome {
    std::vector<std::optional<Result<SyncReport>>> p{2};
    std::vector<std::optional<Result<AdapterSlots::Report>>> c{2};
  };
  // Every rank syncs `version`; the producers serve the weights of `weights` (default: the
  // version itself).
  Outcome sync(uint64_t version, std::optional<uint64_t> weights = std::nullopt) {
    Outcome o;
    std::vector<std::thread> th;
    for (int p = 0; p < 2; ++p) {
      th.emplace_back([&, p] {
        src[static_cast<size_t>(p)]->set_version(weights.value_or(version));
        o.p[static_cast<size_t>(p)] = prod[static_cast<size_t>(p)]->sync(version);
      });
    }
    for (int c = 0; c < 2; ++c) th.emplace_back([&, c] { o.c[static_cast<size_t>(c)] = slots[static_cast<size_t>(c)]->sync(version); });
    for (auto& t : th) t.join();
    return o;
  }
};

TEST(AdapterSlots, VersionsSwitchOnEveryRankUnderReaders) {
  AdapterCluster k;
  // Layer order: layer 0 moves before producer 1 materialises layer 1, where it dies once
  // both consumers unpacked layer 0 into their own buffers (a sync half landed; a death
  // before anything was read would make the consumers wait out their timeout for a
  // restarted producer instead, engine/consumer.cpp).
  k.eo.group_order = GroupOrderKind::kLayer;
  std::atomic<bool> crash_armed{false};
  std::atomic<unsigned> unpacked{0};  // bit c: consumer c unpacked layer 0 while armed
  k.tweak_consumer = [&](ConsumerOptions& co, int c) {
    auto hooks = std::make_shared<engine::TestHooks>();
    hooks->consumer_point = [&, c](int g, int phase) {
      if (crash_armed && g == 1 && phase == 3) unpacked |= 1u << c;  // (group 1: layer 0, after "pre")
    };
    co.test_hooks = hooks;
  };
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    if (p != 1) return;
    engine::TestHooks hooks;
    hooks.before_materialize = [&](uint64_t, int g) {
      if (g != 2 || !crash_armed) return;  // (layer 1)
      for (int i = 0; i < 2000 && unpacked.load() != 3u; ++i) std::this_thread::sleep_for(5ms);  // (bounded)
      crash_armed = false;
      k.ptr[1]->simulate_crash().ignore();
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start().ok());
  for (int c = 0; c < 2; ++c) EXPECT_FALSE(k.slots[static_cast<size_t>(c)]->acquire().has_value());
  // What each rank's lease may hash to: one version, whole (versions 1 to 5).
  std::vector<std::map<uint64_t, uint64_t>> expect(2);
  for (int c = 0; c < 2; ++c)
    for (uint64_t v = 1; v <= 5; ++v) expect[static_cast<size_t>(c)][v] = k.lora.expected_hash(c, AdapterCluster::kSeed, v);
  // Two readers per rank, each taking leases over and over (bounded), hashing the whole
  // adapter under each.
  std::atomic<bool> stop{false};
  std::vector<std::atomic<uint64_t>> reads(2), wrong(2);
  std::vector<std::mutex> seen_mu(2);
  std::vector<std::set<std::string>> seen(2);
  std::vector<std::thread> readers;
  for (int c = 0; c < 2; ++c) {
    for (int r = 0; r < 2; ++r) {
      readers.emplace_back([&, c] {
        for (int n = 0; !stop && n < 2'000'000; ++n) {
          auto lease = k.slots[static_cast<size_t>(c)]->acquire();
          if (!lease) {
            std::this_thread::yield();
            continue;
          }
          const uint64_t h = hash_params(lease->params());
          const auto& e = expect[static_cast<size_t>(c)];
          const auto it = e.find(lease->version());
          if (it == e.end() || it->second != h || lease->name() != fmt::format("math@{}", lease->version()))
            ++wrong[static_cast<size_t>(c)];
          ++reads[static_cast<size_t>(c)];
          std::lock_guard<std::mutex> lk(seen_mu[static_cast<size_t>(c)]);
          seen[static_cast<size_t>(c)].insert(lease->name());
        }
      });
    }
  }
  auto serving = [&](int c) { return k.slots[static_cast<size_t>(c)]->acquire()->name(); };
  auto expect_decision = [&](const AdapterCluster::Outcome& o, SwitchDecision d, const std::string& name) {
    for (int c = 0; c < 2; ++c) {
      const auto& r = o.c[static_cast<size_t>(c)];
      ASSERT_TRUE(r->ok()) << r->status().to_string();
      EXPECT_EQ((*r)->decision, d) << "rank " << c << ": " << (*r)->sync.to_string();
      EXPECT_EQ((*r)->serving, name);
      EXPECT_EQ(serving(c), name);
    }
  };
  // Versions 1 and 2 switch on both ranks; only the adapter's bytes move.
  for (uint64_t v = 1; v <= 2; ++v) {
    auto o = k.sync(v);
    ASSERT_NO_FATAL_FAILURE(expect_decision(o, SwitchDecision::kSwitch, fmt::format("math@{}", v)));
    for (int c = 0; c < 2; ++c) {
      const AdapterSlots::Report& r = **o.c[static_cast<size_t>(c)];
      EXPECT_TRUE(r.sync.ok()) << r.sync.to_string();
      EXPECT_FALSE(r.unchanged);
      EXPECT_EQ(r.sync.bytes_received, k.lora.kept_bytes(c));
    }
    for (const auto& p : o.p) EXPECT_TRUE((*p)->ok()) << (*p)->to_string();
  }
  // Version 3 carries version 2's weights: reported unchanged by every side, kept
  // serving under its old name (prefix caches stay valid).
  {
    auto o = k.sync(3, 2);
    ASSERT_NO_FATAL_FAILURE(expect_decision(o, SwitchDecision::kKeep, "math@2"));
    for (int c = 0; c < 2; ++c) {
      const AdapterSlots::Report& r = **o.c[static_cast<size_t>(c)];
      EXPECT_TRUE(r.unchanged);
      EXPECT_EQ(r.sync.unchanged, std::optional<bool>(true));
    }
    for (const auto& p : o.p) {
      ASSERT_TRUE(p->ok());
      EXPECT_EQ((*p)->unchanged, std::optional<bool>(true)) << "a trainer serving the same bytes is told";
    }
  }
  // Version 4: producer 1 dies after layer 0 landed. Both ranks keep serving version 2.
  crash_armed = true;
  {
    auto o = k.sync(4);
    EXPECT_EQ(unpacked.load(), 3u) << "layer 0 had not landed on both ranks";
    for (int c = 0; c < 2; ++c) {
      const auto& r = o.c[static_cast<size_t>(c)];
      ASSERT_TRUE(r->ok()) << r->status().to_string();
      EXPECT_EQ((*r)->decision, SwitchDecision::kAbort);
      EXPECT_FALSE((*r)->sync.status.ok());
      EXPECT_EQ((*r)->serving, "math@2");
      EXPECT_EQ(serving(c), "math@2");
      EXPECT_EQ((*r)->slot, -1);
    }
  }
  ASSERT_FALSE(crash_armed.load()) << "the producer was not killed";
  {
    // The store says what each rank serves (math@2), beside what its consumer received.
    auto store = k.fx.open();
    ASSERT_TRUE(store.ok());
    auto serving = adapter_serving(**store, k.eo.job, 2);
    ASSERT_TRUE(serving.ok()) << serving.status().to_string();
    EXPECT_EQ(*serving, (std::vector<std::optional<std::string>>{"math@2", "math@2"}));
    auto received = committed_versions(**store, k.eo.job, 2);
    ASSERT_TRUE(received.ok());
    EXPECT_EQ((*received)[0], std::optional<uint64_t>(3));  // (version 3 was received and kept as math@2)
  }
  // Restarted, version 5 switches on both ranks.
  k.tweak_producer = nullptr;
  ASSERT_TRUE(k.start_producer(1).ok());
  {
    auto o = k.sync(5);
    ASSERT_NO_FATAL_FAILURE(expect_decision(o, SwitchDecision::kSwitch, "math@5"));
    // (After a failed sync nothing to compare with: version 4's layer 0 had landed.)
    for (int c = 0; c < 2; ++c) EXPECT_EQ((**o.c[static_cast<size_t>(c)]).sync.unchanged, std::nullopt);
  }
  stop = true;
  for (auto& t : readers) t.join();
  for (int c = 0; c < 2; ++c) {
    EXPECT_GT(reads[static_cast<size_t>(c)].load(), 0u);
    EXPECT_EQ(wrong[static_cast<size_t>(c)].load(), 0u)
        << "rank " << c << ": " << wrong[static_cast<size_t>(c)] << " of " << reads[static_cast<size_t>(c)]
        << " leases held a mix of versions or a half-written one";
    EXPECT_FALSE(seen[static_cast<size_t>(c)].count("math@4"));
    // The slots: version 5 serving, nobody holding a lease.
    int serving_slots = 0;
    for (const auto& s : k.slots[static_cast<size_t>(c)]->slots()) {
      EXPECT_EQ(s.readers, 0);
      serving_slots += s.serving;
      if (s.serving) {
        EXPECT_EQ(s.name, "math@5");
      }
    }
    EXPECT_EQ(serving_slots, 1);
  }
}

TEST(AdapterSlots, ALeaseKeepsItsSlotWhileNewerVersionsLand) {
  AdapterCluster k;
  k.slot_wait = 200ms;  // (the lease below is held on purpose)
  ASSERT_TRUE(k.start().ok());
  auto o = k.sync(1);
  for (const auto& c : o.c) ASSERT_TRUE(c->ok() && (*c)->decision == SwitchDecision::kSwitch);
  auto held = k.slots[0]->acquire();  // rank 0's reader keeps version 1
  ASSERT_TRUE(held.has_value());
  const uint64_t h1 = hash_params(held->params());
  for (uint64_t v = 2; v <= 3; ++v) {  // 2 slots: version 3 fills the slot version 2 left
    o = k.sync(v);
    for (const auto& c : o.c) ASSERT_TRUE(c->ok()) << c->status().to_string();
  }
  // Rank 0 had only one free slot (the other held): 2 switched into it; 3 found none
  // free on rank 0 (serving 2, held 1), so the group aborted 3 on both ranks.
  EXPECT_EQ((**o.c[0]).decision, SwitchDecision::kAbort);
  EXPECT_EQ((**o.c[1]).decision, SwitchDecision::kAbort);
  EXPECT_EQ(k.slots[0]->acquire()->name(), "math@2");
  EXPECT_EQ(k.slots[1]->acquire()->name(), "math@2");
  EXPECT_EQ(held->name(), "math@1");
  EXPECT_EQ(hash_params(held->params()), h1);
  held.reset();
  o = k.sync(4);
  for (const auto& c : o.c) ASSERT_TRUE(c->ok() && (*c)->decision == SwitchDecision::kSwitch);
  EXPECT_EQ(k.slots[0]->acquire()->name(), "math@4");
  // A version already decided is refused before anything moves (its decision key is taken).
  auto again = k.slots[0]->sync(3);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument) << again.status().to_string();
  EXPECT_EQ(k.slots[0]->acquire()->name(), "math@4");
}

TEST(AdapterSlots, RefusesBadOptions) {
  StoreFixture fx;
  ASSERT_TRUE(fx.start().ok());
  auto store = fx.open();
  auto tr = inproc();
  ASSERT_TRUE(store.ok() && tr.ok());
  LoraJob lora;
  ConsumerOptions co;
  static_cast<EngineOptions&>(co) = engine_options("rl#lora", 2, 2);
  AdapterSlotOptions so;
  so.adapter = "bad name";
  EXPECT_EQ(AdapterSlots::create(*lora.model(0), 0, **tr, **store, co, so).status().code(), StatusCode::kInvalidArgument);
  so.adapter = "ok";
  so.slots = 1;
  EXPECT_EQ(AdapterSlots::create(*lora.model(0), 0, **tr, **store, co, so).status().code(), StatusCode::kInvalidArgument);
  so.slots = 2;
  co.commit = CommitPolicy::kShadow;
  EXPECT_EQ(AdapterSlots::create(*lora.model(0), 0, **tr, **store, co, so).status().code(), StatusCode::kInvalidArgument);
  co.commit = CommitPolicy::kInPlace;
  so.switch_group = {1};
  EXPECT_EQ(AdapterSlots::create(*lora.model(0), 0, **tr, **store, co, so).status().code(), StatusCode::kInvalidArgument);
}

// --- the main model and its draft in one job ---------------------------------------------

// One side of one target: its producers and consumers as threads.
struct TargetRanks {
  tools::JobModel model;
  EngineOptions eo;
  std::vector<std::unique_ptr<Transport>> ptr, ctr;
  std::vector<std::unique_ptr<Store>> pst, cst;
  std::vector<std::unique_ptr<SyntheticSource>> src;
  std::vector<std::unique_ptr<Producer>> prod;
  std::vector<std::unique_ptr<Consumer>> cons;
  Status start(StoreFixture& fx, const std::string& job, const std::string& config, const std::string& trainer,
               const std::string& inference) {
    FERRY_ASSIGN_OR_RETURN(model, tools::make_job_model(std::string(FERRY_SOURCE_DIR) + "/configs/" + config, trainer,
                                                        inference, true));
    const int P = model.trainer.world_size(), C = model.inference.world_size();
    eo = engine_options(job, P, C);
    ptr.resize(static_cast<size_t>(P)), pst.resize(static_cast<size_t>(P)), src.resize(static_cast<size_t>(P));
    prod.resize(static_cast<size_t>(P)), ctr.resize(static_cast<size_t>(C)), cst.resize(static_cast<size_t>(C));
    cons.resize(static_cast<size_t>(C));
    std::vector<Status> st(static_cast<size_t>(P + C));
    std::vector<std::thread> th;
    for (int p = 0; p < P; ++p) {
      th.emplace_back([&, p] {
        st[static_cast<size_t>(p)] = [&]() -> Status {
          const size_t i = static_cast<size_t>(p);
          FERRY_ASSIGN_OR_RETURN(ptr[i], inproc());
          FERRY_ASSIGN_OR_RETURN(pst[i], fx.open());
          src[i] = std::make_unique<SyntheticSource>(model.metadata, model.holdings, p, 5);
          ProducerOptions po;
          static_cast<EngineOptions&>(po) = eo;
          FERRY_ASSIGN_OR_RETURN(prod[i], Producer::create(*src[i], *ptr[i], *pst[i], po));
          return Status::Ok();
        }();
      });
    }
    for (int c = 0; c < C; ++c) {
      th.emplace_back([&, c] {
        st[static_cast<size_t>(P + c)] = [&]() -> Status {
          const size_t i = static_cast<size_t>(c);
          FERRY_ASSIGN_OR_RETURN(ctr[i], inproc());
          FERRY_ASSIGN_OR_RETURN(cst[i], fx.open());
          ConsumerOptions co;
          static_cast<EngineOptions&>(co) = eo;
          FERRY_ASSIGN_OR_RETURN(cons[i], Consumer::create(*model.loader, c, *ctr[i], *cst[i], co));
          return Status::Ok();
        }();
      });
    }
    for (auto& t : th) t.join();
    for (const Status& s : st) FERRY_RETURN_IF_ERROR(s);
    return Status::Ok();
  }
  // Every rank syncs `version` of this target, serving the weights of `weights`.
  std::vector<Result<SyncReport>> sync(uint64_t version, uint64_t weights) {
    std::vector<std::optional<Result<SyncReport>>> out(prod.size() + cons.size());
    std::vector<std::thread> th;
    for (size_t p = 0; p < prod.size(); ++p) {
      th.emplace_back([&, p] {
        src[p]->set_version(weights);
        out[p] = prod[p]->sync(version);
      });
    }
    for (size_t c = 0; c < cons.size(); ++c) th.emplace_back([&, c] { out[prod.size() + c] = cons[c]->sync(version); });
    for (auto& t : th) t.join();
    std::vector<Result<SyncReport>> r;
    for (auto& o : out) r.push_back(std::move(*o));
    return r;
  }
  void expect_holds(uint64_t weights, uint64_t version) {
    for (size_t c = 0; c < cons.size(); ++c) {
      auto r = tools::verify_params(model, static_cast<int>(c), cons[c]->params(), 5, weights);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_FALSE(r->has_value()) << eo.job << " consumer " << c << ": " << **r;
      EXPECT_EQ(cons[c]->state().version, version);
    }
  }
};

TEST(Targets, MainModelAndDraftInOneJobWithTheirOwnVersions) {
  StoreFixture fx;
  ASSERT_TRUE(fx.start().ok());
  TargetRanks main, draft;
  // The main model (tp=2 -> tp=2) and a draft model of another shape (tp=1 -> 2 replicas).
  ASSERT_TRUE(main.start(fx, *target_job("rl", ""), "llama-3.1-8b.json", "tp=2", "tp=2").ok());
  ASSERT_TRUE(draft.start(fx, *target_job("rl", "draft"), "qwen3-30b-a3b.json", "tp=1", "tp=1,replicas=2").ok());
  // Main syncs every step; the draft at steps 1 and 3 under its own versions 1 and 2,
  // then at step 4 with its weights unchanged (version 3, the same bytes as 2).
  struct Step {
    uint64_t main_version;
    std::optional<uint64_t> draft_version, draft_weights;
  };
  const std::vector<Step> steps{{1, 1, 1}, {2, {}, {}}, {3, 2, 2}, {4, 3, 2}};
  for (const Step& s : steps) {
    std::vector<Result<SyncReport>> m, d;
    std::thread tm([&] { m = main.sync(s.main_version, s.main_version); });
    if (s.draft_version) d = draft.sync(*s.draft_version, *s.draft_weights);
    tm.join();
    for (const auto& r : m) ASSERT_TRUE(r.ok() && r->ok()) << (r.ok() ? r->to_string() : r.status().to_string());
    ASSERT_NO_FATAL_FAILURE(main.expect_holds(s.main_version, s.main_version));
    for (const auto& r : m) EXPECT_EQ(r->unchanged, s.main_version == 1 ? std::nullopt : std::optional<bool>(false));
    if (!s.draft_version) continue;
    for (const auto& r : d) ASSERT_TRUE(r.ok() && r->ok()) << (r.ok() ? r->to_string() : r.status().to_string());
    ASSERT_NO_FATAL_FAILURE(draft.expect_holds(*s.draft_weights, *s.draft_version));
    const std::optional<bool> unchanged = *s.draft_version == 1 ? std::nullopt
                                                                 : std::optional<bool>(*s.draft_version == 3);
    for (const auto& r : d) EXPECT_EQ(r->unchanged, unchanged) << "draft version " << *s.draft_version;
  }
  // Each target's versions, as the store says.
  auto store = fx.open();
  ASSERT_TRUE(store.ok());
  auto mv = committed_versions(**store, "rl", 2);
  auto dv = committed_versions(**store, "rl#draft", 2);
  ASSERT_TRUE(mv.ok() && dv.ok());
  for (const auto& v : *mv) EXPECT_EQ(v, std::optional<uint64_t>(4));
  for (const auto& v : *dv) EXPECT_EQ(v, std::optional<uint64_t>(3));
}

}  // namespace
}  // namespace ferry
