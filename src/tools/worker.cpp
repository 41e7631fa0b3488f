#include "tools/worker.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <thread>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/report_json.h"
#include "engine/testing.h"
#include "ferry/engine.h"
#include "tools/job_model.h"
#include "tools/prepared_source.h"
#include "tools/proc_memory.h"
#include "tools/trace_file.h"
#include "tools/transport_options.h"

namespace ferry::tools {

std::string worker_ready_key(const std::string& job, const std::string& role, int rank) {
  return fmt::format("{}/ready/{}{}", job, role, rank);
}
std::string worker_go_key(const std::string& job, int version) { return fmt::format("{}/go/{}", job, version); }
std::string worker_result_key(const std::string& job, int version, const std::string& role, int rank) {
  return fmt::format("{}/result/{}/{}{}", job, version, role, rank);
}

Result<std::vector<std::pair<int, int>>> parse_pause_points(std::string_view text) {
  std::vector<std::pair<int, int>> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string item(text.substr(at, end - at));
    int v = 0, point = 0, used = 0;
    if (std::sscanf(item.c_str(), "%d:%d%n", &v, &point, &used) != 2 || used != static_cast<int>(item.size()) || v < 0)
      return invalid_argument("pause point '{}' is not VERSION:POINT (in '{}')", item, text);
    out.emplace_back(v, point);
    at = end + 1;
  }
  return out;
}

bool PausePoints::take(int v, int point) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = std::find(points_.begin(), points_.end(), std::make_pair(v, point));
  if (it == points_.end()) return false;
  points_.erase(it);
  return true;
}

namespace {

// Inference rank `rank`'s final params by the loader's layer groups (the units a groups
// commit makes live: "embedding", "layer 3", ...). A param post-processing made (an FP8
// scale) joins the group of the param named like it up to its last '.', else stands
// alone.
Result<std::vector<std::pair<std::string, std::vector<TensorDecl>>>> layer_group_params(const ModelLoader& loader,
                                                                                         int rank) {
  FERRY_ASSIGN_OR_RETURN(auto rl, loader.rank(rank));
  std::vector<std::pair<std::string, std::vector<TensorDecl>>> out;
  for (const auto& g : rl->groups()) out.push_back({g.name, {}});
  std::map<std::string, int, std::less<>> group_of, prefix_group;
  auto prefix = [](std::string_view n) { return n.substr(0, n.rfind('.') == std::string_view::npos ? n.size() : n.rfind('.')); };
  for (const ParamInfo& p : rl->params()) {
    group_of[p.decl.name] = p.group;
    prefix_group.emplace(std::string(prefix(p.decl.name)), p.group);
  }
  for (const TensorDecl& d : rl->final_params()) {
    int g = -1;
    if (auto it = group_of.find(d.name); it != group_of.end()) {
      g = it->second;
    } else if (auto pt = prefix_group.find(prefix(d.name)); pt != prefix_group.end()) {
      g = pt->second;
    }
    if (g >= 0) {
      out[static_cast<size_t>(g)].second.push_back(d);
    } else {
      out.push_back({d.name, {d}});
    }
  }
  return out;
}

// Per group of `units`: the index of the first of `versions` (direct loads; null entries
// skipped) its params in `live` equal bit for bit, -1 when none (a group half written).
std::vector<int> group_versions(const std::vector<std::pair<std::string, std::vector<TensorDecl>>>& units,
                                const TensorMap& live, const std::vector<const TensorMap*>& versions) {
  std::vector<int> out;
  for (const auto& [name, decls] : units) {
    int at = -1;
    for (size_t i = 0; i < versions.size() && at < 0; ++i) {
      if (!versions[i]) continue;
      auto mm = compare_params(decls, *versions[i], live);
      if (mm.ok() && !mm->has_value()) at = static_cast<int>(i);
    }
    out.push_back(at);
  }
  return out;
}

// One read of a commit reader (shadow, groups): not made (nothing committed yet to check
// against), or made and then what made it a mix (the mismatch, or the group half
// written) if anything, and whether its groups were at different versions (groups).
struct ReadVerdict {
  bool made = true;
  std::optional<std::string> mixed;
  bool split = false;
};

int worker_fail(const WorkerSpec& s, const Status& st) {
  std::fprintf(stderr, "ferry worker %s %d: %s\n", s.role.c_str(), s.rank, st.to_string().c_str());
  return 2;
}

}  // namespace

int run_worker(const WorkerSpec& s) {
  auto model = make_job_model_quantized(s.model, s.trainer, s.inference, false, "", s.quantize);
  if (!model.ok()) return worker_fail(s, model.status());
  // Every store call is bounded by the rank's timeout too (not the client's 30 s
  // default): a store that is cut off fails a sync within --timeout-ms, naming it.
  StoreOptions so;
  so.connect_timeout = std::chrono::milliseconds(s.timeout_ms);
  so.io_timeout = std::chrono::milliseconds(s.timeout_ms);
  auto store = Store::open(s.store, so);
  if (!store.ok()) return worker_fail(s, store.status());
  // A store on loopback: the backend's one-host settings (ucx: reads and writes over
  // shared memory, messages over loopback tcp, the transport list from the driver's
  // FERRY_UCX_TLS; see DemoSpec::ucx_tls). Elsewhere: the interface routing to the
  // store's host (tools/transport_options.h).
  auto transport = Transport::create(worker_transport_options(s.backend, "", s.store));
  if (!transport.ok()) return worker_fail(s, transport.status());
  auto mode = parse_sync_mode(s.mode);
  if (!mode.ok()) return worker_fail(s, mode.status());
  EngineOptions eo;
  eo.job = s.job;
  eo.num_producers = model->trainer.world_size();
  eo.num_consumers = model->inference.world_size();
  eo.mode = *mode;
  auto order = parse_group_order_kind(s.group_order);
  if (!order.ok()) return worker_fail(s, order.status());
  eo.group_order = *order;
  auto convert = parse_convert_on(s.convert_on);
  if (!convert) return worker_fail(s, invalid_argument("convert_on: '{}' is not producer or consumer", s.convert_on));
  eo.convert_on = *convert;
  auto quantize_on = parse_quantize_on(s.quantize_on);
  if (!quantize_on) return worker_fail(s, invalid_argument("quantize_on: '{}' is not producer or consumer", s.quantize_on));
  eo.quantize_on = *quantize_on;
  eo.checksums = s.checksums;
  eo.delta = s.delta;
  eo.delta_block_bytes = s.delta_block_bytes;
  eo.delta_same_host = s.delta_same_host;
  auto changes = parse_synthetic_changes(s.changed_fraction, s.changes);
  if (!changes.ok()) return worker_fail(s, changes.status());
  eo.stall_timeout = std::chrono::milliseconds(s.stall_ms);
  eo.straggler_floor = std::chrono::milliseconds(s.straggler_ms);
  eo.join_window = std::chrono::milliseconds(s.join_window_ms);
  eo.timeout = std::chrono::milliseconds(s.timeout_ms);
  eo.lease_ttl = std::chrono::milliseconds(s.lease_ttl_ms);
  eo.rendezvous_timeout = std::chrono::milliseconds(60000);
  Store& st = **store;
  const auto go_timeout = std::chrono::milliseconds(s.go_timeout_ms);
  // The driver's store may be paused or restarted between syncs (DemoSpec::pauses,
  // store_restarts): a store error is waited out until the go timeout, not fatal.
  auto transient = [](const Status& e) {
    return e.code() == StatusCode::kUnavailable || e.code() == StatusCode::kTimeout ||
           e.code() == StatusCode::kPeerFailed;
  };
  auto await_go = [&](int v) -> Status {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + go_timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      Status w = st.wait({worker_go_key(s.job, v)}, std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(1000)));
      if (w.ok() || (!transient(w) && w.code() != StatusCode::kTimeout) || left.count() <= 0) {
        // (The store's message names its last slice, at most 1 s: say the whole wait.)
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
        return w.with_context(fmt::format("waiting for the driver's go of sync {} ({} ms in all)", v, waited));
      }
      if (w.code() != StatusCode::kTimeout) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  };
  auto put_result = [&](const std::string& key, const std::string& value) -> Status {
    const auto deadline = std::chrono::steady_clock::now() + go_timeout;
    for (;;) {
      Status w = st.set(key, value);
      if (w.ok() || !transient(w) || std::chrono::steady_clock::now() >= deadline) return w;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  };
  // Pauses: SIGSTOP at the point; the driver sees the process stopped and SIGCONTs it.
  auto pauses = std::make_shared<PausePoints>(s.pauses);
  auto pause_at = [pauses](int v, int point) {
    if (pauses->take(v, point)) ::raise(SIGSTOP);
  };
  // What the process holds before the engine exists (libraries, the job model, the
  // transport): the base the memory test subtracts from RSS.
  const ProcMemory base = proc_memory().value_or(ProcMemory{});
  uint64_t held = 0, source_resident = 0;
  std::unique_ptr<SyntheticSource> source;
  // --prepare-weights: the weights of each version written before its sync starts (held
  // in memory, as a trainer's are), instead of generated group by group inside it.
  std::unique_ptr<PreparedSource> prepared;
  // Shadow consumers: a reader of the live params during each sync, under the lock the
  // commit hooks take exclusively (what a serving engine does); every read must be
  // exactly the committed version (verify_params), else it counts as mixed. Groups
  // consumers: every layer group of each read must be whole, the held version or the
  // one syncing (a group that is neither counts the read as mixed; `split` counts reads
  // whose groups were at both, which this policy allows).
  struct Reader {
    std::shared_mutex lock;
    std::atomic<bool> run{false};
    std::atomic<uint64_t> reads{0}, mixed{0}, split{0};
    std::string first_mix;  // (the reader thread's until joined)
    std::thread thread;
  } reader;
  std::unique_ptr<Producer> producer;
  std::unique_ptr<Consumer> consumer;
  std::vector<std::pair<std::string, std::vector<TensorDecl>>> units;  // groups: layer_group_params
  int version = 0;
  if (s.role == "producer") {
    source = std::make_unique<SyntheticSource>(model->metadata, model->holdings, s.rank, s.seed);
    source->set_changes(*changes);
    if (s.prepare_weights) {
      auto ps = PreparedSource::create(*model, s.rank, s.seed, nullptr, *changes);
      if (!ps.ok()) return worker_fail(s, ps.status());
      prepared = std::move(*ps);
    }
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    engine::TestHooks hooks;
    hooks.before_materialize = [&s, pause_at](uint64_t v, int g) {
      if (static_cast<int>(v) == s.crash_version && g == s.crash_point) ::kill(::getpid(), SIGKILL);
      pause_at(static_cast<int>(v), g);
    };
    if (s.corrupt_version >= 0) {
      hooks.corrupt_group = s.corrupt_group;
      hooks.corrupt_version = static_cast<uint64_t>(s.corrupt_version);
    }
    po.test_hooks = engine::make_test_hooks(std::move(hooks));
    po.staging_budget = s.staging_budget;
    const Holdings& h = (*model->holdings)[static_cast<size_t>(s.rank)];
    held = h.bytes();
    // SyntheticSource materialises one group at a time, into fresh buffers.
    std::map<int, uint64_t> per_group;
    const Groups groups(model->metadata);
    for (const HeldBox& b : h.boxes) {
      const TensorDecl& d = h.tensors[b.tensor];
      per_group[groups.of_name(d.name)] += static_cast<uint64_t>(b.box.numel()) * dtype_size(d.dtype);
    }
    for (const auto& [g, n] : per_group) source_resident = std::max(source_resident, n);
    if (prepared) {
      source_resident = prepared->held_bytes();  // every group in memory (written before each sync: set_weights)
    }
    WeightSource& served = prepared ? static_cast<WeightSource&>(*prepared) : *source;
    auto p = Producer::create(served, **transport, st, po);
    if (!p.ok()) return worker_fail(s, p.status());
    producer = std::move(*p);
  } else if (s.role == "consumer") {
    ConsumerOptions co;  // (`reader`, declared below the producer's state, serves the commit hooks)
    static_cast<EngineOptions&>(co) = eo;
    engine::TestHooks hooks;
    hooks.consumer_point = [&s, &version, pause_at](int g, int phase) {
      if (version == s.crash_version && g * 4 + phase == s.crash_point) ::kill(::getpid(), SIGKILL);
      pause_at(version, g * 4 + phase);
    };
    co.test_hooks = engine::make_test_hooks(std::move(hooks));
    co.relay = s.relay;
    auto policy = parse_commit_policy(s.commit);
    if (!policy.ok()) return worker_fail(s, policy.status());
    co.commit = *policy;
    if (s.discard_version >= 0 && co.commit != CommitPolicy::kShadow)
      return worker_fail(s, invalid_argument("--discard-version {} needs --commit shadow (a sync without commit)",
                                             s.discard_version));
    if (co.commit != CommitPolicy::kInPlace) {
      co.before_commit = [&reader](uint64_t) { reader.lock.lock(); };
      co.after_commit = [&reader](uint64_t) { reader.lock.unlock(); };
    }
    TensorMap params;  // --caller-params: host buffers of this process, as an engine's params
    if (s.caller_params) {
      auto own = zeroed_host_params(*model->loader, s.rank);
      if (!own.ok()) return worker_fail(s, own.status().with_context("--caller-params"));
      params = std::move(*own);
    }
    auto c = Consumer::create(*model->loader, s.rank, **transport, st, co, std::move(params));
    if (!c.ok()) return worker_fail(s, c.status());
    consumer = std::move(*c);
    for (const auto& [name, t] : consumer->params()) held += static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());
    if (co.commit == CommitPolicy::kGroups) {
      auto u = layer_group_params(*model->loader, s.rank);
      if (!u.ok()) return worker_fail(s, u.status());
      units = std::move(*u);
    }
  } else {
    return worker_fail(s, invalid_argument("unknown role '{}'", s.role));
  }
  // The consumers that read anything from this producer under the full routes (what
  // the driver checks a report's `missed` against).
  std::vector<int> served;
  if (producer) {
    const Routes& routes = producer->routes();
    for (size_t c = 0; c < routes.consumer_plan.size(); ++c) {
      bool reads = false;
      for (const PlanGroup& g : routes.consumer(c).groups) {
        for (const Read& r : g.reads) reads |= static_cast<int>(r.producer) == s.rank;
      }
      if (reads) served.push_back(static_cast<int>(c));
    }
  }
  // (Retried: the driver may restart the store as soon as it sees the key, before this
  // set's answer arrived.)
  const uint64_t rss_created = proc_memory().value_or(ProcMemory{}).rss_bytes;
  // A producer's weights of version `ver`: set before the driver can start that sync
  // (before this rank says it is ready, or has a result of the sync before), so that with
  // --prepare-weights no rank waits in its sync for a trainer still generating them.
  auto set_weights = [&](int ver) -> Status {
    if (!source) return Status::Ok();
    source->set_version(static_cast<uint64_t>(ver));
    if (!prepared) return Status::Ok();
    return prepared->set_data_version(static_cast<uint64_t>(ver)).with_context(fmt::format("preparing version {}", ver));
  };
  if (Status w = set_weights(s.first_version); !w.ok()) return worker_fail(s, w);
  if (auto r = put_result(worker_ready_key(s.job, s.role, s.rank), std::to_string(::getpid())); !r.ok())
    return worker_fail(s, r);
  std::optional<TraceFile> trace;
  if (!s.trace.empty()) trace.emplace(s.trace);
  for (version = s.first_version; version <= s.last_version; ++version) {
    const auto v = static_cast<uint64_t>(version);
    if (auto w = await_go(version); !w.ok()) return worker_fail(s, w);
    pause_at(version, kWorkerSyncStartPoint);
    std::fprintf(stderr, "[%s %d] sync %llu start\n", s.role.c_str(), s.rank, static_cast<unsigned long long>(v));
    const auto t_sync = std::chrono::steady_clock::now();
    // Groups: the params of the held version and of this one, loaded directly, which
    // each group of a read must equal one of.
    // (After a failed sync under groups, some groups hold that sync's version: the
    // mixed one, a third a group may be at.)
    std::optional<TensorMap> direct_held, direct_next, direct_mixed;
    if (consumer && s.commit == "groups") {
      auto next = direct_params(*model, s.rank, s.seed, v, *changes);
      if (!next.ok()) return worker_fail(s, next.status());
      direct_next = std::move(*next);
      if (consumer->state().has_version) {
        auto h = direct_params(*model, s.rank, s.seed, consumer->state().version, *changes);
        if (!h.ok()) return worker_fail(s, h.status());
        direct_held = std::move(*h);
      }
      if (consumer->state().mixed) {
        auto m = direct_params(*model, s.rank, s.seed, consumer->last_report().version, *changes);
        if (!m.ok()) return worker_fail(s, m.status());
        direct_mixed = std::move(*m);
      }
    }
    // The reader's check of one read, made under the commit hooks' lock.
    std::function<ReadVerdict()> check;
    if (consumer && s.commit == "groups") {
      check = [&]() -> ReadVerdict {
        if (!direct_held) return {false};  // nothing committed before this sync: nothing to check against
        const std::vector<int> at = group_versions(
            units, consumer->params(), {&*direct_next, &*direct_held, direct_mixed ? &*direct_mixed : nullptr});
        if (auto bad = std::find(at.begin(), at.end(), -1); bad != at.end())
          return {true, units[static_cast<size_t>(bad - at.begin())].first};
        return {true, std::nullopt, std::count(at.begin(), at.end(), at.front()) != static_cast<long>(at.size())};
      };
    } else if (consumer && s.commit == "shadow") {
      check = [&]() -> ReadVerdict {
        const ConsumerState held = consumer->state();
        if (!held.has_version) return {false};  // nothing committed yet (zeros): nothing to check
        auto ver = verify_params(*model, s.rank, consumer->params(), s.seed, held.version, *changes);
        if (!ver.ok()) return {true, ver.status().to_string()};
        return {true, *ver};
      };
    }
    if (check) {
      reader.reads = reader.mixed = reader.split = 0;
      reader.run = true;
      reader.thread = std::thread([&] {
        // At least one pass (a read, where a version is held), however soon the sync
        // returns: a sync the reader never read during would check nothing. Bounded.
        for (int n = 0; (n == 0 || reader.run) && n < 1'000'000; ++n) {
          std::shared_lock<std::shared_mutex> lk(reader.lock);
          const ReadVerdict r = check();
          if (!r.made) {  // don't spin
            lk.unlock();
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            continue;
          }
          ++reader.reads;
          if (r.mixed && reader.mixed++ == 0) reader.first_mix = *r.mixed;
          reader.split += r.split;
        }
      });
    }
    // The discarded version: received into the shadow (commit=false), then dropped, while
    // the reader goes on reading the live params (they must stay the held version).
    const bool discarding = consumer && version == s.discard_version;
    Result<SyncReport> rep = producer ? producer->sync(v) : consumer->sync(v, !discarding);
    std::optional<uint64_t> received, received_after;
    Status discarded = failed_precondition("sync {} failed: nothing to discard", v);
    if (discarding && rep.ok()) {
      received = consumer->state().received;
      discarded = consumer->discard();
      received_after = consumer->state().received;
    }
    if (reader.thread.joinable()) {
      reader.run = false;
      reader.thread.join();
    }
    // The engine's report (engine/report_json.h), failed or not, and the worker's keys.
    const SyncReport& last = producer ? producer->last_report() : consumer->last_report();
    nlohmann::json out = engine::sync_report_json(last);
    if (trace) {
      trace->add(producer != nullptr, s.rank, last);
      if (Status w = trace->write(); !w.ok()) return worker_fail(s, w);
    }
    out["ok"] = rep.ok();
    out["elapsed"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_sync).count();
    if (producer) out["serves"] = served;
    if (auto pm = proc_memory(); pm.ok()) {
      out["rss_base_bytes"] = base.rss_bytes;
      out["anon_base_bytes"] = base.anon_bytes;
      out["anon_bytes"] = pm->anon_bytes;
      out["shmem_bytes"] = pm->shmem_bytes;
      out["rss_created_bytes"] = rss_created;
      out["rss_bytes"] = pm->rss_bytes;
      out["peak_rss_bytes"] = pm->peak_rss_bytes;
    }
    out["held_bytes"] = held;
    // Which path carried the bytes: reads and writes by message are tcp (or a region
    // shared memory cannot map), the others native get/put (shared memory on one host).
    const TransportStats ts = (*transport)->stats();
    out["transport"] = {{"reads", ts.reads},           {"reads_by_message", ts.reads_by_message},
                        {"writes", ts.writes},         {"writes_by_message", ts.writes_by_message},
                        {"bytes_read", ts.bytes_read}, {"bytes_written", ts.bytes_written}};
    if (producer) out["source_resident_bytes"] = source_resident;
    out["report_ok"] = rep.ok() && rep->ok();
    if (!rep.ok()) out["error"] = rep.status().to_string();
    if (consumer && s.commit != "in_place") {
      out["reads"] = reader.reads.load();
      out["mixed_reads"] = reader.mixed.load();
      if (reader.mixed) out["first_mixed_read"] = reader.first_mix;
      if (s.commit == "groups") out["split_reads"] = reader.split.load();
    }
    if (consumer) {
      out["torn"] = consumer->state().torn;
      if (consumer->state().has_version) out["holds"] = consumer->state().version;
      if (discarding) {
        out["received"] = received ? nlohmann::json(*received) : nlohmann::json(nullptr);
        out["discarded"] = rep.ok() && received == v && discarded.ok() && !received_after;
        if (!discarded.ok()) out["discard_error"] = discarded.to_string();
        if (received_after) out["received_after_discard"] = *received_after;
      }
      if ((!rep.ok() || discarding) && s.commit == "shadow" && consumer->state().has_version) {
        // A failed or discarded sync under shadow: the live params must still be the held
        // version.
        auto live = verify_params(*model, s.rank, consumer->params(), s.seed, consumer->state().version, *changes);
        out["live_verified"] = live.ok() && !live->has_value();
        if (live.ok() && live->has_value()) out["live_mismatch"] = **live;
      }
      if (!rep.ok() && s.commit == "groups" && direct_held) {
        // A failed sync under groups: the groups its report names hold this version, each
        // whole, and every other group the held one.
        const std::vector<int> at = group_versions(units, consumer->params(), {&*direct_next, &*direct_held});
        bool as_reported = true;
        for (size_t u = 0; u < units.size(); ++u) {
          const bool named = std::find(last.groups_live.begin(), last.groups_live.end(), units[u].first) !=
                             last.groups_live.end();
          if (at[u] != (named ? 0 : 1)) {
            if (as_reported) out["live_mismatch"] = fmt::format("group '{}'", units[u].first);
            as_reported = false;
          }
        }
        out["live_verified"] = as_reported;
        out["mixed"] = consumer->state().mixed;
      }
      if (rep.ok() && !discarding) {
        auto ver = verify_params(*model, s.rank, consumer->params(), s.seed, v, *changes);
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
    if (version < s.last_version) {  // the next version's weights, before the driver sees this result
      if (Status w = set_weights(version + 1); !w.ok()) return worker_fail(s, w);
    }
    if (auto w = put_result(worker_result_key(s.job, version, s.role, s.rank), out.dump()); !w.ok())
      return worker_fail(s, w);
  }
  return 0;
}

}  // namespace ferry::tools
