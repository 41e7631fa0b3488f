#include "tools/worker.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/testing.h"
#include "ferry/engine.h"
#include "tools/job_model.h"
#include "tools/transport_options.h"

namespace ferry::tools {

std::string worker_ready_key(const std::string& job, const std::string& role, int rank) {
  return fmt::format("{}/ready/{}{}", job, role, rank);
}
std::string worker_go_key(const std::string& job, int version) { return fmt::format("{}/go/{}", job, version); }
std::string worker_result_key(const std::string& job, int version, const std::string& role, int rank) {
  return fmt::format("{}/result/{}/{}{}", job, version, role, rank);
}

namespace {

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
  // One host: the backend's one-host settings (ucx: reads and writes over shared memory,
  // messages over loopback tcp, the transport list from the driver's FERRY_UCX_TLS; see
  // DemoSpec::ucx_tls).
  auto transport = Transport::create(worker_transport_options(s.backend));
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
    engine::TestHooks hooks;
    hooks.before_materialize = [&s](uint64_t v, int g) {
      if (static_cast<int>(v) == s.crash_version && g == s.crash_point) ::kill(::getpid(), SIGKILL);
    };
    po.test_hooks = engine::make_test_hooks(std::move(hooks));
    auto p = Producer::create(*source, **transport, st, po);
    if (!p.ok()) return worker_fail(s, p.status());
    producer = std::move(*p);
  } else if (s.role == "consumer") {
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    engine::TestHooks hooks;
    hooks.consumer_point = [&s, &version](int g, int phase) {
      if (version == s.crash_version && g * 4 + phase == s.crash_point) ::kill(::getpid(), SIGKILL);
    };
    co.test_hooks = engine::make_test_hooks(std::move(hooks));
    auto c = Consumer::create(*model->loader, s.rank, **transport, st, co);
    if (!c.ok()) return worker_fail(s, c.status());
    consumer = std::move(*c);
  } else {
    return worker_fail(s, invalid_argument("unknown role '{}'", s.role));
  }
  if (auto r = st.set(worker_ready_key(s.job, s.role, s.rank), std::to_string(::getpid())); !r.ok())
    return worker_fail(s, r);
  for (version = s.first_version; version <= s.last_version; ++version) {
    const auto v = static_cast<uint64_t>(version);
    if (auto w = st.wait({worker_go_key(s.job, version)}, go_timeout); !w.ok()) return worker_fail(s, w);
    std::fprintf(stderr, "[%s %d] sync %llu start\n", s.role.c_str(), s.rank, static_cast<unsigned long long>(v));
    nlohmann::json out;
    Result<SyncReport> rep = producer ? (source->set_version(v), producer->sync(v)) : consumer->sync(v);
    out["ok"] = rep.ok();
    if (rep.ok()) {
      out["bytes"] = rep->bytes_sent + rep->bytes_received;  // this rank's side: sent or received
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
    if (auto w = st.set(worker_result_key(s.job, version, s.role, s.rank), out.dump()); !w.ok())
      return worker_fail(s, w);
  }
  return 0;
}

}  // namespace ferry::tools
