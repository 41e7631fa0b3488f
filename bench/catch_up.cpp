// bench_catch_up: a joiner's catch-up from the replicas (Consumer::catch_up, issue 45)
// against a plain sync of the same model, side by side in one run, every rank a thread of
// this process over UCX (shared memory on one host by default).
//
//   build/bench/bench_catch_up [--overrides JSON] [--trainer tp=2] [--inference tp=4,replicas=2]
//                              [--syncs 3] [--tls sm,tcp,self] [--readers 1]
//
// A job of the trainer layout's producers (weights served in place from registered
// memory, as a trainer that allocates through ferry) and the inference layout's consumers
// syncs `syncs` timed versions after a warm-up (the plain sync: wall time of one round,
// every rank). Then every rank of the last replica is replaced by a new instance that
// calls catch_up() at once, all together (the joiners: wall time until the last is live),
// while `readers` threads per serving rank of replica 0 hash its live params in a loop:
// each pass must see exactly the version it held before (one digest), never another. The
// joiners are then verified bit for bit against a direct load, and one more sync of
// everyone must be ok. Prints one JSON object (the figures, the ratio joiner / plain
// sync) and exits 1 if anything was not as it must be.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "ferry/engine.h"
#include "ferry/source.h"
#include "ferry/store.h"
#include "ferry/transport.h"
#include "tools/job_model.h"
#include "tools/prepared_source.h"

namespace {

using namespace ferry;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// XXH3-64 over every param's bytes, in name order: one value per version a rank holds.
uint64_t digest(const TensorMap& params) {
  XXH3_state_t* s = XXH3_createState();
  XXH3_64bits_reset(s);
  for (const auto& [name, t] : params) {
    auto p = t.data_ptr();
    if (p.ok()) XXH3_64bits_update(s, *p, static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
  }
  const uint64_t h = XXH3_64bits_digest(s);
  XXH3_freeState(s);
  return h;
}

int run(int argc, char** argv) {
  std::string overrides, trainer = "tp=2", inference = "tp=4,replicas=2", tls = "sm,tcp,self";
  int syncs = 3, readers = 1;
  CLI::App app{"A joiner's catch-up from the replicas against a plain sync of the same model"};
  app.add_option("--overrides", overrides, "JSON merged into the shrunk Llama config (the model's size)");
  app.add_option("--trainer", trainer, "Trainer layout");
  app.add_option("--inference", inference, "Inference layout (at least two replicas)");
  app.add_option("--syncs", syncs, "Timed plain syncs (after one warm-up)")->check(CLI::Range(1, 100));
  app.add_option("--tls", tls, "UCX transports of every rank");
  app.add_option("--readers", readers, "Reader threads per serving rank during the catch-up")->check(CLI::Range(0, 8));
  CLI11_PARSE(app, argc, argv);

  const std::string config = std::string(FERRY_CONFIGS_DIR) + "/llama-3.1-8b.json";
  auto model = tools::make_job_model(config, trainer, inference, true, overrides);
  if (!model.ok()) {
    std::fprintf(stderr, "bench_catch_up: %s\n", model.status().to_string().c_str());
    return 2;
  }
  const int P = model->trainer.world_size(), C = model->inference.world_size();
  const int replicas = model->inference.replicas;
  if (replicas < 2) {
    std::fprintf(stderr, "bench_catch_up: --inference needs at least two replicas (got %d)\n", replicas);
    return 2;
  }
  const int per_replica = C / replicas;
  StoreServerOptions sso;
  sso.token = "bench-catch-up-token-0123456789";
  auto server = StoreServer::start(sso);
  if (!server.ok()) {
    std::fprintf(stderr, "bench_catch_up: %s\n", server.status().to_string().c_str());
    return 2;
  }
  EngineOptions eo;
  eo.job = "bench-catch-up";
  eo.num_producers = P;
  eo.num_consumers = C;
  eo.timeout = std::chrono::milliseconds(120000);
  eo.stall_timeout = eo.timeout;
  eo.rendezvous_timeout = eo.timeout;
  auto transport = [&]() {
    TransportOptions o;
    o.backend = "ucx";
    o.token = "bench-catch-up-transport-token-0123456789";
    o.params = {{"tls", tls}, {"net_devices", "lo"}};
    return Transport::create(o);
  };
  auto store = [&]() {
    StoreOptions so;
    so.token = sso.token;
    return Store::open((*server)->url(), so);
  };
  struct Rank {
    std::unique_ptr<Transport> t;
    std::unique_ptr<Store> s;
  };
  std::vector<Rank> pr(static_cast<size_t>(P)), cr(static_cast<size_t>(C));
  std::vector<std::unique_ptr<tools::PreparedSource>> src(static_cast<size_t>(P));
  std::vector<std::unique_ptr<Producer>> prod(static_cast<size_t>(P));
  std::vector<std::unique_ptr<Consumer>> cons(static_cast<size_t>(C));
  const uint64_t seed = 7, version = 1;  // (PreparedSource's data version)
  auto start_producer = [&](int p) -> Status {
    Rank& r = pr[static_cast<size_t>(p)];
    FERRY_ASSIGN_OR_RETURN(r.t, transport());
    FERRY_ASSIGN_OR_RETURN(r.s, store());
    // Data version 1 for every sync (the bytes move either way), served in place.
    FERRY_ASSIGN_OR_RETURN(src[static_cast<size_t>(p)], tools::PreparedSource::create(*model, p, seed, r.t.get(), {}));
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    po.source_regions = src[static_cast<size_t>(p)]->regions();
    FERRY_ASSIGN_OR_RETURN(prod[static_cast<size_t>(p)], Producer::create(*src[static_cast<size_t>(p)], *r.t, *r.s, po));
    return Status::Ok();
  };
  auto start_consumer = [&](int c) -> Status {
    cons[static_cast<size_t>(c)].reset();
    Rank& r = cr[static_cast<size_t>(c)];
    r.t.reset();
    FERRY_ASSIGN_OR_RETURN(r.t, transport());
    FERRY_ASSIGN_OR_RETURN(r.s, store());
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    FERRY_ASSIGN_OR_RETURN(cons[static_cast<size_t>(c)], Consumer::create(*model->loader, c, *r.t, *r.s, co));
    return Status::Ok();
  };
  auto all = [](int n, const std::function<Status(int)>& f) {
    std::vector<Status> st(static_cast<size_t>(n));
    std::vector<std::thread> th;
    for (int i = 0; i < n; ++i) th.emplace_back([&, i] { st[static_cast<size_t>(i)] = f(i); });
    for (auto& t : th) t.join();
    for (auto& s : st) FERRY_RETURN_IF_ERROR(s);
    return Status::Ok();
  };
  auto fail = [](const char* what, const Status& s) {
    std::fprintf(stderr, "bench_catch_up: %s: %s\n", what, s.to_string().c_str());
    return 1;
  };
  if (Status s = all(P + C, [&](int i) { return i < P ? start_producer(i) : start_consumer(i - P); }); !s.ok())
    return fail("starting the job", s);
  // One round: every rank syncs v (the same weights each time: the bytes move either way).
  auto round = [&](uint64_t v) {
    return all(P + C, [&](int i) -> Status {
      if (i < P) {
        FERRY_ASSIGN_OR_RETURN(SyncReport r, prod[static_cast<size_t>(i)]->sync(v));
        return r.ok() ? Status::Ok() : internal_error("producer {}: {}", i, r.to_string());
      }
      return cons[static_cast<size_t>(i - P)]->sync(v).status();
    });
  };
  if (Status s = round(1); !s.ok()) return fail("warm-up sync", s);
  uint64_t next = 2;
  // Reader threads on the serving replica 0 (its ranks: consumers 0 .. per_replica-1):
  // each pass hashes every live param. `check`: each pass must see the digest the rank
  // held when they started (a catch-up: nothing of theirs changes); otherwise (a plain
  // sync, which writes them in place) they only load the machine as during the catch-up.
  std::atomic<bool> reading{false};
  std::atomic<uint64_t> passes{0}, other_versions{0};
  std::vector<std::thread> rt;
  auto start_readers = [&](bool check) {
    reading = true;
    for (int c = 0; c < per_replica; ++c) {
      const uint64_t held = digest(cons[static_cast<size_t>(c)]->params());
      for (int k = 0; k < readers; ++k) {
        rt.emplace_back([&, c, held, check] {
          while (reading.load()) {
            const uint64_t d = digest(cons[static_cast<size_t>(c)]->params());
            if (check) {
              if (d != held) ++other_versions;
              ++passes;
            }
          }
        });
      }
    }
  };
  auto stop_readers = [&] {
    reading = false;
    for (auto& t : rt) t.join();
    rt.clear();
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // Plain syncs, timed: without readers, then with them.
  std::vector<double> plain, plain_readers;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1 && readers > 0) start_readers(false);
    for (int k = 0; k < syncs; ++k) {
      const auto t0 = Clock::now();
      if (Status s = round(next++); !s.ok()) return fail("timed sync", s);
      (pass == 0 ? plain : plain_readers).push_back(since(t0));
    }
    stop_readers();
    if (readers == 0) break;
  }
  const uint64_t live = next - 1;
  uint64_t bytes_per_rank = 0;
  for (const auto& [name, t] : cons[0]->params()) bytes_per_rank += static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());

  // The joiners: every rank of the last replica replaced by new instances that catch up
  // all at once; without readers, then (readers > 0) again with them checking.
  const int first_joiner = C - per_replica;
  bool good = true;
  uint64_t from_replicas = 0, from_producers = 0;
  std::vector<double> create_s, catch_up_s;
  for (int pass = 0; pass < (readers > 0 ? 2 : 1); ++pass) {
    for (int c = first_joiner; c < C; ++c) cons[static_cast<size_t>(c)].reset();
    const auto tc = Clock::now();
    if (Status s = all(per_replica, [&](int j) { return start_consumer(first_joiner + j); }); !s.ok())
      return fail("creating the joiners", s);
    create_s.push_back(since(tc));
    if (pass == 1) start_readers(true);
    std::vector<SyncReport> caught(static_cast<size_t>(per_replica));
    const auto tj = Clock::now();
    Status joined = all(per_replica, [&](int j) -> Status {
      FERRY_ASSIGN_OR_RETURN(caught[static_cast<size_t>(j)], cons[static_cast<size_t>(first_joiner + j)]->catch_up());
      return Status::Ok();
    });
    catch_up_s.push_back(since(tj));
    stop_readers();
    if (!joined.ok()) return fail("catch-up", joined);
    for (int j = 0; j < per_replica; ++j) {
      const SyncReport& r = caught[static_cast<size_t>(j)];
      from_replicas += r.received_from_replicas;
      for (const auto& [p, b] : r.bytes_per_peer) from_producers += b;
      good &= r.version == live;
      auto v = tools::verify_params(*model, first_joiner + j, cons[static_cast<size_t>(first_joiner + j)]->params(), seed,
                                    version);
      if (!v.ok() || v->has_value()) {
        std::fprintf(stderr, "bench_catch_up: joiner %d not verified: %s\n", first_joiner + j,
                     v.ok() ? (*v)->c_str() : v.status().to_string().c_str());
        good = false;
      }
    }
  }
  good &= from_producers == 0 && other_versions.load() == 0;
  Status after = round(live + 1);
  good &= after.ok();
  const double plain_median = median(plain);
  nlohmann::json out = {
      {"model_bytes", model->checkpoint_bytes},
      {"trainer", trainer},
      {"inference", inference},
      {"tls", tls},
      {"readers_per_serving_rank", readers},
      {"bytes_per_inference_rank", bytes_per_rank},
      {"plain_sync_s", plain},
      {"joiners", per_replica},
      {"joiners_create_s", create_s},
      {"catch_up_s", catch_up_s},
      {"catch_up_over_plain_sync", catch_up_s[0] / plain_median},
      {"joiner_bytes_from_replicas", from_replicas},
      {"joiner_bytes_from_producers", from_producers},
      {"sync_after_ok", after.ok()},
      {"ok", good},
  };
  if (readers > 0) {
    out["plain_sync_with_readers_s"] = plain_readers;
    out["catch_up_with_readers_over_plain_sync_with_readers"] = catch_up_s[1] / median(plain_readers);
    out["reader_passes_during_catch_up"] = passes.load();
    out["reader_passes_seeing_another_version"] = other_versions.load();
  }
  if (!after.ok()) out["sync_after_error"] = after.to_string();
  std::printf("%s\n", out.dump(2).c_str());
  return good ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
