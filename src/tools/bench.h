// `ferry bench` (internal): the engine's sync time for a fixed model and layouts, side by
// side in one run with what bounds it and what it replaces:
//   raw      the same consumer <- producer reads (sizes and offsets from the routes) as
//            bare Transport::read of allocate_memory'd rings, same concurrency, same UCX_TLS;
//   memcpy   the same bytes copied by the same consumer processes;
//   broadcast  the NCCL-style design on a real collective library: OpenMPI MPI_Bcast of
//            every full tensor from one root per trainer PP stage to every inference rank,
//            which copies its shard out with its recorded plan (`ferry-mpi-bcast`).
// Ranks are processes (`ferry worker --bench`, started and reaped through tools/subprocess.h),
// coordinated through an embedded store; every timed step starts at an agreed
// CLOCK_MONOTONIC instant and lasts from the earliest start to the latest end over its
// participants (one host, so the clocks agree).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/status.h"
#include "tools/transport_options.h"

namespace ferry::tools {

struct BenchSpec {
  std::string worker_binary;  // the ferry executable (runs `worker --bench`)
  std::string mpi_binary;     // ferry-mpi-bcast
  std::string model;          // HF config.json
  std::string overrides;      // JSON merged into the (shrunk) config
  bool shrink = true;
  std::string trainer = "tp=2";
  std::string inference = "tp=4";
  std::string tls = default_worker_tls();  // UCX_TLS of every rank (and picks MPI's fabric)
  std::string mode = "pull";    // engine mode; push: the raw baseline writes instead of reads
  std::string group_order = "rotated";  // EngineOptions::group_order of every rank
  std::string convert_on = "producer";  // EngineOptions::convert_on of every rank
  std::string quantize_on = "producer";  // EngineOptions::quantize_on of every rank
  // The inference ranks' loader quantisation (LoaderOptions::quantize: "none", "fp8",
  // "fp8-ue8m0", "mxfp8"): the consumers block-quantise after loading (post-processing).
  std::string quantize = "none";
  // Delta syncs (EngineOptions::delta) on every rank, and what the trainer's synthetic
  // weights change between the alternating data versions of the trials
  // (SyntheticChanges: a fraction of elements "scattered" or of whole tensors "clustered").
  bool delta = false;
  double changed_fraction = 1.0;
  std::string changes = "scattered";
  uint64_t delta_block_bytes = 0;  // EngineOptions::delta_block_bytes (0: keep a copy)
  bool delta_same_host = false;    // EngineOptions::delta_same_host (patches over shared memory too)
  int syncs = 5;                // timed trials (after one warm-up)
  uint64_t seed = 1;
  std::string mpirun = "mpirun";
  std::string mpi_mca;          // replaces the default MCA selection ("--mca a b --mca c d")
  int timeout_ms = 120000;      // bound on each wait of the driver
  // Trainer weights in a transport region, served in place (ProducerOptions::
  // source_regions); false: in ordinary memory, every byte packed into staging.
  bool in_place = true;
  // The consumers' ConsumerOptions::commit ("in_place" or "shadow"): with shadow, every
  // sync lands beside the live params and commits at its end (commit_seconds_max).
  std::string commit = "in_place";
  // Consumers pass param buffers of their own to Consumer::create (as an inference
  // engine's parameters would be), instead of letting the engine allocate them: under
  // shadow, commit then copies into them (a memcpy per param) instead of a flip.
  bool caller_params = false;
  // Only estimate what every process would hold (json["memory_estimate"]) and compare it
  // with MemAvailable; start nothing.
  bool estimate_only = false;
  // Write every rank's trace of every sync step (warm-up included) to this file (Chrome
  // trace-event JSON, tools/trace_file.h; each rank writes a part, merged at the end).
  std::string trace;
};

// Medians of the timed trials and what they were measured on.
struct BenchResult {
  std::string error;  // empty: ok
  nlohmann::json json;  // every figure (see cmd_bench.cpp for the keys)
};

BenchResult run_bench(const BenchSpec& spec);

// One rank of the bench (a process, `ferry worker --bench`): builds its Producer or
// Consumer, its raw-read ring, then runs the steps the driver posts in the store until
// told to exit.
struct BenchWorkerSpec {
  std::string role;  // "producer" | "consumer"
  int rank = 0;
  std::string model;  // config path (already shrunk)
  std::string trainer;
  std::string inference;
  std::string store;  // URL (token from FERRY_TOKEN)
  std::string job;
  std::string tls = default_worker_tls();
  std::string mode = "pull";
  std::string group_order = "rotated";
  std::string convert_on = "producer";
  std::string quantize_on = "producer";
  std::string quantize = "none";    // BenchSpec::quantize
  bool delta = false;               // BenchSpec::delta
  double changed_fraction = 1.0;    // BenchSpec::changed_fraction
  std::string changes = "scattered";
  uint64_t delta_block_bytes = 0;   // BenchSpec::delta_block_bytes
  bool delta_same_host = false;     // BenchSpec::delta_same_host
  uint64_t seed = 1;
  int timeout_ms = 60000;
  bool in_place = true;
  std::string commit = "in_place";  // BenchSpec::commit
  bool caller_params = false;       // BenchSpec::caller_params
  std::string trace;  // this rank's trace file (BenchSpec::trace); empty: none
};
int run_bench_worker(const BenchWorkerSpec& spec);

}  // namespace ferry::tools
