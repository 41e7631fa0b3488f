// `ferry bench` (tools/bench.h), the rank side: one process per trainer or inference rank
// (`ferry worker --bench`) with its Producer or Consumer, its raw-transport ring and the
// staged diagnostic's buffers, running the steps the driver (bench.cpp) posts in the store
// (tools/bench_steps.h) until told to exit.
#include "tools/bench.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "common/fields.h"
#include "engine/clock.h"
#include "engine/registered_buffer.h"
#include "engine/report_json.h"
#include "engine/schedule.h"
#include "ferry/engine.h"
#include "tools/bench_steps.h"
#include "tools/job_model.h"
#include "tools/prepared_source.h"
#include "tools/proc_memory.h"
#include "tools/trace_file.h"

namespace ferry::tools {
namespace {

using engine::align_up;
using engine::Clock;
using engine::RegisteredBuffer;
using fields::bytes_to_string;
using fields::decode_fields;
using fields::encode_fields;
using fields::parse_u64_field;
using fields::string_bytes;
using fields::u64_field;
using bench_steps::key_go;
using bench_steps::key_raw;
using bench_steps::key_ready;
using bench_steps::key_result;
using bench_steps::mono_ns;

// CPU seconds of this process so far (every thread): tells a CPU-bound step (ranks'
// CPU adds up to cores x wall) from one that waits.
double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Synthetic data version moved by sync `v`: two versions alternate, so the verification
// after the last sync proves that sync moved every byte (the previous one left the other).
uint64_t data_version(uint64_t v) { return 1 + v % 2; }

int bench_worker_fail(const BenchWorkerSpec& s, const Status& st) {
  std::fprintf(stderr, "ferry worker --bench %s %d: %s\n", s.role.c_str(), s.rank, st.to_string().c_str());
  return 2;
}


}  // namespace

int run_bench_worker(const BenchWorkerSpec& s) {
  auto model = make_job_model_quantized(s.model, s.trainer, s.inference, false, "", s.quantize);
  if (!model.ok()) return bench_worker_fail(s, model.status());
  auto store = Store::open(s.store);
  if (!store.ok()) return bench_worker_fail(s, store.status());
  Store& st = **store;
  auto transport = Transport::create(worker_transport_options("ucx", s.tls));
  if (!transport.ok()) return bench_worker_fail(s, transport.status());
  Transport& tr = **transport;
  std::optional<TraceFile> trace;
  if (!s.trace.empty()) trace.emplace(s.trace);
  EngineOptions eo;
  eo.job = s.job;
  eo.num_producers = model->trainer.world_size();
  eo.num_consumers = model->inference.world_size();
  auto mode = parse_sync_mode(s.mode);
  if (!mode.ok()) return bench_worker_fail(s, mode.status());
  eo.mode = *mode;
  auto order = parse_group_order_kind(s.group_order);
  if (!order.ok()) return bench_worker_fail(s, order.status());
  eo.group_order = *order;
  auto convert = parse_convert_on(s.convert_on);
  if (!convert) return bench_worker_fail(s, invalid_argument("convert_on: '{}' is not producer or consumer", s.convert_on));
  eo.convert_on = *convert;
  auto quantize_on = parse_quantize_on(s.quantize_on);
  if (!quantize_on) return bench_worker_fail(s, invalid_argument("quantize_on: '{}' is not producer or consumer", s.quantize_on));
  eo.quantize_on = *quantize_on;
  eo.delta = s.delta;
  eo.delta_block_bytes = s.delta_block_bytes;
  eo.delta_same_host = s.delta_same_host;
  auto changes = parse_synthetic_changes(s.changed_fraction, s.changes);
  if (!changes.ok()) return bench_worker_fail(s, changes.status());
  eo.timeout = eo.stall_timeout = std::chrono::milliseconds(s.timeout_ms);
  eo.rendezvous_timeout = std::chrono::milliseconds(s.timeout_ms);
  const int P = eo.num_producers;

  std::unique_ptr<PreparedSource> source;
  std::unique_ptr<Producer> producer;
  std::unique_ptr<Consumer> consumer;
  // Raw rings: the engine's ring sizes (two slots of the largest group), allocated the
  // same way (allocate_memory), touched once so no timed step pays first faults. Every
  // rank imports the other side's (pull: consumers read producers'; push: producers
  // write into consumers').
  RegisteredBuffer raw;
  uint64_t raw_slot = 0;
  const bool is_producer = s.role == "producer";
  const int peers = is_producer ? eo.num_consumers : P;
  std::vector<RemoteRegion> raw_remote(static_cast<size_t>(peers));
  std::vector<uint64_t> raw_remote_slot(static_cast<size_t>(peers));
  std::vector<PeerId> raw_peer(static_cast<size_t>(peers));
  std::vector<std::byte> memcpy_src;
  if (is_producer) {
    auto src = PreparedSource::create(*model, s.rank, s.seed, s.in_place ? &tr : nullptr, *changes);
    if (!src.ok()) return bench_worker_fail(s, src.status());
    source = std::move(*src);
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    po.source_regions = source->regions();
    auto p = Producer::create(*source, tr, st, po);
    if (!p.ok()) return bench_worker_fail(s, p.status());
    producer = std::move(*p);
    // The engine's slot size (engine/schedule.h), without the failover worst case.
    raw_slot = engine::producer_slot_bytes(producer->routes(), s.rank, model->metadata, *model->holdings, false);
  } else if (s.role == "consumer") {
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    auto policy = parse_commit_policy(s.commit);
    if (!policy.ok()) return bench_worker_fail(s, policy.status());
    co.commit = *policy;
    TensorMap params;  // --caller-params: host buffers of this process, as an engine's params
    if (s.caller_params) {
      auto own = zeroed_host_params(*model->loader, s.rank);
      if (!own.ok()) return bench_worker_fail(s, own.status().with_context("--caller-params"));
      params = std::move(*own);
    }
    auto c = Consumer::create(*model->loader, s.rank, tr, st, co, std::move(params));
    if (!c.ok()) return bench_worker_fail(s, c.status());
    consumer = std::move(*c);
    raw_slot = engine::consumer_slot_bytes(consumer->routes().consumer(static_cast<size_t>(s.rank)));
  } else {
    return bench_worker_fail(s, invalid_argument("unknown role '{}'", s.role));
  }
  const Routes& routes = producer ? producer->routes() : consumer->routes();
  if (Status a = raw.allocate(tr, 2 * raw_slot); !a.ok()) return bench_worker_fail(s, a);
  std::memset(raw.data, is_producer ? 0x5a : 0, raw.bytes);
  if (!is_producer) memcpy_src.assign(raw.bytes, std::byte{0x3c});
  // Staged diagnostic (steps spack, sread, sunpack): the engine's three copies of every
  // byte — pack into staging, read, unpack into params — as separate whole-model steps
  // with no protocol and no overlap. Two slots of the largest group, group g in slot
  // g % 2 (the engine's ring; a whole-model buffer per rank was scaffolding that grew
  // with the model): off[g] is its offset, off.back() the buffer's size.
  auto group_offsets = [](const std::vector<uint64_t>& sizes) {
    uint64_t slot = 0;
    for (uint64_t n : sizes) slot = std::max(slot, align_up(n, 64));
    std::vector<uint64_t> off(sizes.size() + 1, 0);
    for (size_t g = 0; g < sizes.size(); ++g) off[g] = (g % 2) * slot;
    off[sizes.size()] = 2 * slot;
    return off;
  };
  auto producer_offsets = [&](const Routes& r, int p) {
    std::vector<uint64_t> sizes;
    for (const auto& g : r.producers[static_cast<size_t>(p)].groups) sizes.push_back(g.staging_bytes);
    return group_offsets(sizes);
  };
  std::vector<uint64_t> staged_off;
  if (is_producer) {
    staged_off = producer_offsets(routes, s.rank);
  } else {
    std::vector<uint64_t> sizes;
    for (const auto& g : routes.consumer(static_cast<size_t>(s.rank)).groups) sizes.push_back(g.recv_bytes);
    staged_off = group_offsets(sizes);
  }
  RegisteredBuffer staged;
  if (Status a = staged.allocate(tr, std::max<uint64_t>(staged_off.back(), 64)); !a.ok()) return bench_worker_fail(s, a);
  std::memset(staged.data, 0, staged.bytes);
  TensorMap staged_params;  // consumer: params of its own, so the engine's stay as synced
  if (!is_producer) {
    for (const auto& d : routes.consumer(static_cast<size_t>(s.rank)).params)
      staged_params.emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
  }
  std::vector<RemoteRegion> staged_remote(static_cast<size_t>(peers));
  std::vector<std::vector<uint64_t>> producer_off;  // consumer: every producer's staged offsets
  if (!is_producer) {
    for (int p = 0; p < P; ++p) producer_off.push_back(producer_offsets(routes, p));
  }
  {
    auto key = tr.export_key(raw.region);
    if (!key.ok()) return bench_worker_fail(s, key.status());
    auto skey = tr.export_key(staged.region);
    if (!skey.ok()) return bench_worker_fail(s, skey.status());
    const std::string blob = encode_fields(
        {bytes_to_string(tr.address()), bytes_to_string(*key), u64_field(raw_slot), bytes_to_string(*skey)});
    if (Status w = st.set(key_raw(s.job, s.role, s.rank), blob); !w.ok()) return bench_worker_fail(s, w);
    const std::string other = is_producer ? "consumer" : "producer";
    std::vector<std::string> keys;
    for (int q = 0; q < peers; ++q) keys.push_back(key_raw(s.job, other, q));
    if (Status w = st.wait(keys, eo.rendezvous_timeout); !w.ok()) return bench_worker_fail(s, w);
    for (int q = 0; q < peers; ++q) {
      auto b = st.get(keys[static_cast<size_t>(q)]);
      if (!b.ok()) return bench_worker_fail(s, b.status());
      auto f = decode_fields(*b, 4);
      if (!f.ok()) return bench_worker_fail(s, f.status());
      auto id = tr.connect(string_bytes((*f)[0]));  // the engine's peer: same endpoint
      if (!id.ok()) return bench_worker_fail(s, id.status());
      auto k = tr.import_key(string_bytes((*f)[1]));
      if (!k.ok()) return bench_worker_fail(s, k.status());
      auto slot = parse_u64_field((*f)[2]);
      if (!slot.ok()) return bench_worker_fail(s, slot.status());
      raw_peer[static_cast<size_t>(q)] = *id;
      raw_remote[static_cast<size_t>(q)] = *k;
      raw_remote_slot[static_cast<size_t>(q)] = *slot;
      auto sk = tr.import_key(string_bytes((*f)[3]));
      if (!sk.ok()) return bench_worker_fail(s, sk.status());
      staged_remote[static_cast<size_t>(q)] = *sk;
    }
  }
  // What the rank holds that is not the engine's: its weights shard (producer) or params
  // (consumer), and the bench's own buffers (scaffolding), by kind.
  uint64_t held_bytes = 0;
  nlohmann::json scaffolding = {{"raw_ring", raw.bytes}, {"staged_ring", staged.bytes}, {"memcpy_source", memcpy_src.size()}};
  if (producer) {
    held_bytes = source->held_bytes();
  } else {
    for (const auto& [name, t] : consumer->params()) held_bytes += static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());
    uint64_t sp = 0;
    for (const auto& [name, t] : staged_params) sp += static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());
    scaffolding["staged_params"] = sp;
  }
  uint64_t scaffolding_total = 0;
  for (const auto& [k, v] : scaffolding.items()) scaffolding_total += v.get<uint64_t>();
  scaffolding["total"] = scaffolding_total;
  if (Status w = st.set(key_ready(s.job, s.role, s.rank), std::to_string(::getpid())); !w.ok())
    return bench_worker_fail(s, w);

  const auto timeout = std::chrono::milliseconds(s.timeout_ms);
  // The engine's read pattern for one producer in one group, without its protocol: its
  // reads posted together (into `local` at local_base + recv_offset, from `remote` at
  // remote_base + offset) and waited for; adds the bytes to `bytes`.
  auto read_group = [&](const PlanGroup& grp, int p, const MemoryRegion& local, uint64_t local_base,
                        const RemoteRegion& remote, uint64_t remote_base, uint64_t& bytes) -> Status {
    std::vector<Completion> ops;
    for (const Read& r : grp.reads) {
      if (!r.length || static_cast<int>(r.producer) != p) continue;
      FERRY_ASSIGN_OR_RETURN(Completion c,
                             tr.read(local, local_base + r.recv_offset, remote, remote_base + r.offset, r.length));
      ops.push_back(c);
      bytes += r.length;
    }
    return ops.empty() ? Status::Ok() : wait_all(ops, timeout);
  };
  for (int step = 0;; ++step) {
    if (Status w = st.wait({key_go(s.job, step)}, timeout); !w.ok()) return bench_worker_fail(s, w);
    auto text = st.get(key_go(s.job, step));
    if (!text.ok()) return bench_worker_fail(s, text.status());
    const auto go = nlohmann::json::parse(*text, nullptr, false);
    if (go.is_discarded()) return bench_worker_fail(s, corrupt("bad step {}", step));
    const std::string kind = go.value("kind", std::string());
    if (kind == "exit") break;
    const uint64_t v = go.value("version", uint64_t{0});
    // The trainer's weights of version v are written before its sync starts (in place:
    // a copy over the region, like an optimizer step), outside the timed window.
    if (producer && kind == "prepare") {
      if (Status d = source->set_data_version(data_version(v)); !d.ok()) return bench_worker_fail(s, d);
    }
    std::this_thread::sleep_until(Clock::time_point(std::chrono::nanoseconds(go.value("start_ns", int64_t{0}))));
    nlohmann::json out;
    out["ok"] = true;
    const double c0 = cpu_seconds();
    const int64_t t0 = mono_ns();
    if (kind == "sync") {
      Result<SyncReport> rep = producer ? producer->sync(v) : consumer->sync(v);
      const int64_t t_end = mono_ns();
      // The engine's report (engine/report_json.h; its "memory" is the engine's share
      // apart from the bench's own buffers and the weights / params the rank holds),
      // failed or not, with the bench's keys.
      const SyncReport& last = producer ? producer->last_report() : consumer->last_report();
      out.update(engine::sync_report_json(last));
      if (trace) {
        trace->add(producer != nullptr, s.rank, last);
        if (Status w = trace->write(); !w.ok()) return bench_worker_fail(s, w);
      }
      out["end_ns"] = t_end;
      out["ok"] = rep.ok();
      if (!rep.ok()) out["error"] = rep.status().to_string();
    } else if (kind == "raw" && consumer && eo.mode == SyncMode::kPull) {
      // The engine's read pattern without its protocol: per group, per producer, that
      // producer's reads posted together and waited for, into the same ring slot.
      const PlanRoute& pr = routes.consumer(static_cast<size_t>(s.rank));
      uint64_t bytes = 0;
      Status err;
      for (size_t g = 0; g < pr.groups.size() && err.ok(); ++g) {
        const uint64_t base = (g % 2) * raw_slot;
        for (int p = 0; p < P && err.ok(); ++p) {
          err = read_group(pr.groups[g], p, raw.region, base, raw_remote[static_cast<size_t>(p)],
                           (g % 2) * raw_remote_slot[static_cast<size_t>(p)], bytes);
        }
      }
      out["end_ns"] = mono_ns();
      out["ok"] = err.ok();
      out["bytes"] = bytes;
      if (!err.ok()) out["error"] = err.to_string();
    } else if (kind == "raw" && producer && eo.mode == SyncMode::kPush) {
      // The engine's push pattern without its protocol: per group, this producer's
      // segment for every consumer written into that consumer's ring slot and flushed;
      // two groups in flight (the engine's two staging slots).
      uint64_t bytes = 0;
      Status err;
      std::vector<Completion> prev, cur;
      for (int g = 0; g < routes.num_groups() && err.ok(); ++g) {
        cur.clear();
        for (int c = 0; c < eo.num_consumers && err.ok(); ++c) {
          bool any = false;
          for (const Read& r : routes.consumer(static_cast<size_t>(c)).groups[static_cast<size_t>(g)].reads) {
            if (!r.length || static_cast<int>(r.producer) != s.rank) continue;
            auto w = tr.write(raw.region, (g % 2) * raw_slot + r.offset, raw_remote[static_cast<size_t>(c)],
                              (g % 2) * raw_remote_slot[static_cast<size_t>(c)] + r.recv_offset, r.length);
            if (!w.ok()) {
              err = w.status();
              break;
            }
            cur.push_back(*w);
            bytes += r.length;
            any = true;
          }
          if (any && err.ok()) {
            auto f = tr.flush(raw_peer[static_cast<size_t>(c)]);
            if (!f.ok()) err = f.status();
            else cur.push_back(*f);
          }
        }
        if (err.ok() && !prev.empty()) err = wait_all(prev, timeout);
        prev.swap(cur);
      }
      if (err.ok() && !prev.empty()) err = wait_all(prev, timeout);
      out["end_ns"] = mono_ns();
      out["ok"] = err.ok();
      out["bytes"] = bytes;
      if (!err.ok()) out["error"] = err.to_string();
    } else if (kind == "spack" && producer) {
      const Holdings& h = (*model->holdings)[static_cast<size_t>(s.rank)];
      uint64_t bytes = 0;
      Status err;
      for (int g = 0; g < routes.num_groups() && err.ok(); ++g) {
        const uint64_t n = routes.producers[static_cast<size_t>(s.rank)].groups[static_cast<size_t>(g)].staging_bytes;
        if (!n) continue;
        auto boxes = source->materialize(g);
        if (!boxes.ok()) {
          err = boxes.status();
          break;
        }
        err = pack_group(routes, static_cast<uint32_t>(s.rank), g, h, *boxes,
                         std::span<std::byte>(staged.data + staged_off[static_cast<size_t>(g)], n));
        bytes += n;
      }
      out["end_ns"] = mono_ns();
      out["ok"] = err.ok();
      out["bytes"] = bytes;
      if (!err.ok()) out["error"] = err.to_string();
    } else if (kind == "sread" && consumer) {
      const PlanRoute& pr = routes.consumer(static_cast<size_t>(s.rank));
      uint64_t bytes = 0;
      Status err;
      for (size_t g = 0; g < pr.groups.size() && err.ok(); ++g) {
        for (int p = 0; p < P && err.ok(); ++p) {
          err = read_group(pr.groups[g], p, staged.region, staged_off[g], staged_remote[static_cast<size_t>(p)],
                           producer_off[static_cast<size_t>(p)][g], bytes);
        }
      }
      out["end_ns"] = mono_ns();
      out["ok"] = err.ok();
      out["bytes"] = bytes;
      if (!err.ok()) out["error"] = err.to_string();
    } else if (kind == "sunpack" && consumer) {
      const PlanRoute& pr = routes.consumer(static_cast<size_t>(s.rank));
      Status err;
      for (size_t g = 0; g < pr.groups.size() && err.ok(); ++g) {
        if (!pr.groups[g].recv_bytes) continue;
        err = unpack_group(pr, static_cast<int>(g),
                           std::span<const std::byte>(staged.data + staged_off[g], pr.groups[g].recv_bytes),
                           staged_params);
      }
      out["end_ns"] = mono_ns();
      out["ok"] = err.ok();
      if (!err.ok()) out["error"] = err.to_string();
    } else if (kind == "memcpy" && consumer) {
      const PlanRoute& pr = routes.consumer(static_cast<size_t>(s.rank));
      uint64_t bytes = 0;
      for (size_t g = 0; g < pr.groups.size(); ++g) {
        const uint64_t base = (g % 2) * raw_slot;
        for (const Read& r : pr.groups[g].reads) {
          std::memcpy(raw.data + base + r.recv_offset, memcpy_src.data() + base + r.recv_offset, r.length);
          bytes += r.length;
        }
      }
      out["end_ns"] = mono_ns();
      out["bytes"] = bytes;
    } else if (kind == "verify" && consumer) {
      auto ver = verify_params(*model, s.rank, consumer->params(), s.seed, data_version(v), *changes);
      out["verified"] = ver.ok() && !ver->has_value();
      if (!ver.ok()) out["mismatch"] = ver.status().to_string();
      else if (ver->has_value()) out["mismatch"] = **ver;
      out["end_ns"] = mono_ns();
    } else {
      out["end_ns"] = t0;  // not a participant of this step
      out["idle"] = true;
    }
    out["start_ns"] = t0;
    out["cpu_seconds"] = cpu_seconds() - c0;
    if (kind == "sync" || kind == "verify") {
      out["held_bytes"] = held_bytes;
      out["scaffolding"] = scaffolding;
      if (auto pm = proc_memory(); pm.ok()) {
        out["rss_bytes"] = pm->rss_bytes;
        out["peak_rss_bytes"] = pm->peak_rss_bytes;
      }
    }
    if (Status w = st.set(key_result(s.job, step, s.role, s.rank), out.dump()); !w.ok()) return bench_worker_fail(s, w);
  }
  return 0;
}

}  // namespace ferry::tools
