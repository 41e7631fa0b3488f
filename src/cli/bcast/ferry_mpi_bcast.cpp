// ferry-mpi-bcast: the broadcast weight-sync design that RL frameworks run today (an NCCL
// broadcast of every full HF tensor to every inference rank, which keeps its shard), on a
// real collective library: OpenMPI's MPI_Bcast. `ferry bench` launches it with mpirun to
// measure what ferry replaces, in the same run.
//
// Ranks 0..S-1 are the roots, one per trainer PP stage (each holds its stage's full
// tensors, as after the gather a broadcast design does first); ranks S..S+C-1 are the
// inference ranks. Per trial: every tensor, in checkpoint order, is broadcast from its
// stage's root to every inference rank, which copies its shard out into its params with
// its recorded plan (vLLM's weight_loader step), then post-processes. Timed from a barrier
// to the last rank's end (one host: CLOCK_MONOTONIC agrees across processes).
//
// Steps come from `ferry bench` through its store, as for its own ranks (see
// tools/bench.cpp, keys in tools/bench_steps.h): every rank blocks on {job}/bench/go/{step} (no MPI polling while
// ferry's steps run); "bcast" runs one trial moving synthetic version 1 + v % 2 (two
// versions alternate, so the last trial's verification proves it moved every byte),
// "verify" checks every inference rank bit for bit against a direct load, "exit" ends.
// Rank 0 reports each step in {job}/bench/result/{step}/mpi0.
#include <mpi.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <thread>

#include "tools/job_model.h"
#include "tools/proc_memory.h"

namespace {

using namespace ferry;

int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The copies of `plan` that read source `src`, as a plan of their own (per-tensor
// copy-out, as a loader does weight by weight).
Result<Plan> sub_plan(const Plan& plan, uint32_t src) {
  Plan out;
  FERRY_ASSIGN_OR_RETURN(uint32_t s, out.declare_source(plan.sources()[src]));
  for (const Copy& c : plan.copies()) {
    if (c.source != src) continue;
    FERRY_ASSIGN_OR_RETURN(uint32_t p, out.declare_param(plan.params()[c.param]));
    Copy k = c;
    k.source = s;
    k.param = p;
    FERRY_RETURN_IF_ERROR(out.add_copy(k));
  }
  return out;
}

// MPI counts are int: broadcast in chunks below INT_MAX.
void bcast(std::byte* data, uint64_t bytes, MPI_Comm comm) {
  constexpr uint64_t kChunk = 1u << 30;
  for (uint64_t off = 0; off < bytes; off += kChunk) {
    const int n = static_cast<int>(std::min(kChunk, bytes - off));
    MPI_Bcast(data + off, n, MPI_BYTE, 0, comm);
  }
}

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

int fail(const char* what, const Status& s) {
  std::fprintf(stderr, "ferry-mpi-bcast: %s: %s\n", what, s.to_string().c_str());
  MPI_Abort(MPI_COMM_WORLD, 2);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string model_path, trainer, inference, store_url, job;
  uint64_t seed = 1;
  double changed_fraction = 1.0;  // SyntheticChanges of the trainer's versions (ferry bench --changed-fraction)
  std::string changes_layout = "scattered";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_path = v;
    else if (k == "--trainer") trainer = v;
    else if (k == "--inference") inference = v;
    else if (k == "--seed") seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--store") store_url = v;
    else if (k == "--job") job = v;
    else if (k == "--changed-fraction") changed_fraction = std::strtod(v.c_str(), nullptr);
    else if (k == "--changes") changes_layout = v;
    else return fail("usage", invalid_argument("unknown option {}", k));
  }
  auto m = tools::make_job_model(model_path, trainer, inference, false);
  if (!m.ok()) return fail("model", m.status());
  auto changes = tools::parse_synthetic_changes(changed_fraction, changes_layout);
  if (!changes.ok()) return fail("changes", changes.status());
  auto store = Store::open(store_url);
  if (!store.ok()) return fail("store", store.status());
  Store& st = **store;
  const int S = m->trainer.pp, C = m->inference.world_size();
  if (size != S + C) return fail("ranks", invalid_argument("need {} ranks ({} roots + {} inference), got {}", S + C, S, C, size));
  const auto& meta = m->metadata;

  // One communicator per stage: its root first, then every inference rank.
  MPI_Group world;
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<MPI_Comm> comm(static_cast<size_t>(S), MPI_COMM_NULL);
  for (int s = 0; s < S; ++s) {
    std::vector<int> members = {s};
    for (int c = 0; c < C; ++c) members.push_back(S + c);
    MPI_Group g;
    MPI_Group_incl(world, static_cast<int>(members.size()), members.data(), &g);
    MPI_Comm_create(MPI_COMM_WORLD, g, &comm[static_cast<size_t>(s)]);
    MPI_Group_free(&g);
  }

  const bool root = rank < S;
  const int c = rank - S;
  // Root: its stage's tensors, one data version at a time (written again, tensor by
  // tensor, before a broadcast of the other version and outside its timed window: two
  // whole versions per root were scaffolding that doubled with the model).
  std::vector<Tensor> full(meta.size());
  int full_version = 0;  // data version in `full` (0: none yet)
  uint64_t held = 0;     // root: its stage's bytes; inference: its params
  std::vector<Plan> subs(meta.size());  // inference: per-tensor copy-out
  std::vector<std::byte> recv;
  TensorMap params;
  std::shared_ptr<const RankLoader> rl;
  auto write_version = [&](int d) {
    if (d == full_version) return;
    for (size_t i = 0; i < meta.size(); ++i) {
      if (m->tensor_stage[i] != rank) continue;
      full[i] = Tensor();  // the old one freed before the new one is made
      full[i] = synthetic_tensor(seed, static_cast<uint64_t>(d), meta[i], *changes);
    }
    full_version = d;
  };
  if (root) {
    write_version(1);
    for (size_t i = 0; i < meta.size(); ++i)
      if (m->tensor_stage[i] == rank) held += static_cast<uint64_t>(shape_numel(meta[i].shape)) * dtype_size(meta[i].dtype);
  } else {
    auto plan = record_plan(*m->loader, c, meta);
    if (!plan.ok()) return fail("plan", plan.status());
    uint64_t largest = 0;
    for (size_t i = 0; i < meta.size(); ++i) {
      largest = std::max<uint64_t>(largest, static_cast<uint64_t>(shape_numel(meta[i].shape)) * dtype_size(meta[i].dtype));
      if (auto src = plan->find_source(meta[i].name)) {
        auto sp = sub_plan(*plan, *src);
        if (!sp.ok()) return fail("sub-plan", sp.status());
        subs[i] = std::move(*sp);
      }
    }
    recv.resize(largest);
    std::memset(recv.data(), 0, recv.size());
    for (const auto& p : plan->params()) {
      params.emplace(p.name, Tensor::empty(p.shape, p.dtype, p.name));
      held += static_cast<uint64_t>(shape_numel(p.shape)) * dtype_size(p.dtype);
    }
    auto r = m->loader->rank(c);
    if (!r.ok()) return fail("loader", r.status());
    rl = *r;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    if (Status w = st.set(fmt::format("{}/bench/ready/mpi0", job), "1"); !w.ok()) return fail("store", w);
  }

  ExecuteOptions eo;
  eo.threads = 1;  // one thread per rank, like the engine's background unpack
  uint64_t version = 0;
  const auto timeout = std::chrono::milliseconds(600000);
  for (int step = 0;; ++step) {
    const std::string go_key = fmt::format("{}/bench/go/{}", job, step);
    if (Status w = st.wait({go_key}, timeout); !w.ok()) return fail("store", w);
    auto text = st.get(go_key);
    if (!text.ok()) return fail("store", text.status());
    const auto go = nlohmann::json::parse(*text, nullptr, false);
    const std::string kind = go.is_object() ? go.value("kind", std::string()) : "";
    if (kind == "exit") break;
    if (kind != "bcast" && kind != "verify") continue;  // another rank kind's step
    std::this_thread::sleep_until(std::chrono::steady_clock::time_point(
        std::chrono::nanoseconds(go.value("start_ns", int64_t{0}))));
    nlohmann::json out = {{"ok", true}};
    if (kind == "bcast") {
      version = go.value("version", uint64_t{1});
      if (root) write_version(static_cast<int>(1 + version % 2));  // the optimizer step, untimed
      const double c0 = cpu_seconds();
      MPI_Barrier(MPI_COMM_WORLD);
      const int64_t t0 = mono_ns();
      uint64_t received = 0;
      TensorMap work = params;
      for (size_t i = 0; i < meta.size(); ++i) {
        const int s = m->tensor_stage[i];
        if (root && rank != s) continue;
        const uint64_t bytes = static_cast<uint64_t>(shape_numel(meta[i].shape)) * dtype_size(meta[i].dtype);
        if (root) {
          auto p = full[i].data_ptr();
          if (!p.ok()) return fail("tensor", p.status());
          bcast(*p, bytes, comm[static_cast<size_t>(s)]);
          continue;
        }
        bcast(recv.data(), bytes, comm[static_cast<size_t>(s)]);
        received += bytes;
        if (subs[i].copies().empty()) continue;
        TensorMap src = {{meta[i].name, Tensor::borrow(recv.data(), meta[i].shape, meta[i].dtype)}};
        if (Status e = execute(subs[i], src, work, eo); !e.ok()) return fail("copy-out", e);
      }
      if (!root) {
        for (size_t k = 0; k < rl->groups().size(); ++k)
          if (Status e = rl->process_weights_after_loading(static_cast<int>(k), work); !e.ok()) return fail("post", e);
        params = work;
      }
      const int64_t t1 = mono_ns();
      const double cpu = cpu_seconds() - c0;
      int64_t start = 0, end = 0;
      uint64_t total = 0;
      double cpu_total = 0;
      MPI_Reduce(&t0, &start, 1, MPI_INT64_T, MPI_MIN, 0, MPI_COMM_WORLD);
      MPI_Reduce(&t1, &end, 1, MPI_INT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
      MPI_Reduce(&received, &total, 1, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
      MPI_Reduce(&cpu, &cpu_total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
      out["start_ns"] = start;
      out["end_ns"] = end;
      out["bytes"] = total;
      out["cpu_seconds"] = cpu_total;
    } else {
      int ok = 1;
      if (!root) {
        std::string mismatch;
        auto v = tools::verify_params(*m, c, params, seed, 1 + version % 2, *changes);
        if (!v.ok()) mismatch = v.status().to_string();
        else if (v->has_value()) mismatch = **v;
        ok = mismatch.empty();
        if (!ok) std::fprintf(stderr, "ferry-mpi-bcast: inference rank %d: %s\n", c, mismatch.c_str());
      }
      int all_ok = 0;
      MPI_Reduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
      // Every rank's peak RSS and what it holds (root: its stage; inference: params).
      const uint64_t mine[2] = {tools::proc_memory().value_or(tools::ProcMemory{}).peak_rss_bytes, held};
      std::vector<uint64_t> all(2 * static_cast<size_t>(size));
      MPI_Gather(mine, 2, MPI_UINT64_T, all.data(), 2, MPI_UINT64_T, 0, MPI_COMM_WORLD);
      nlohmann::json rk = nlohmann::json::array();
      for (int r = 0; r < size; ++r)
        rk.push_back({{"rank", r}, {"root", r < S}, {"peak_rss_bytes", all[2 * static_cast<size_t>(r)]},
                      {"held_bytes", all[2 * static_cast<size_t>(r) + 1]}});
      out["ranks"] = rk;
      out["verified"] = all_ok == 1 && version > 0;
      out["idle"] = true;
    }
    if (rank == 0) {
      if (Status w = st.set(fmt::format("{}/bench/result/{}/mpi0", job, step), out.dump()); !w.ok())
        return fail("store", w);
    }
  }
  for (auto& k : comm)
    if (k != MPI_COMM_NULL) MPI_Comm_free(&k);
  MPI_Group_free(&world);
  MPI_Finalize();
  return 0;
}
