// The cluster a sync is simulated on (docs/simulation.md, "Describing a cluster"): nodes
// per role, GPUs and NICs per node, link rates, the switch fabric, latencies and the
// per-operation overheads. Parsed from JSON and validated field by field; every error
// names the field and the value.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/status.h"

namespace ferry::simulate {

// One role's nodes (trainer or inference). Rates in bytes per second, latencies in seconds.
struct NodeSpec {
  int nodes = 0;
  int gpus_per_node = 8;
  double nics_per_gpu = 1;      // 0.5: one NIC shared by two GPUs; 2: two NICs per GPU
  double nic_rate = 50e9;       // one NIC, one direction (400 Gbit/s = 50e9)
  double nic_efficiency = 1.0;  // payload / wire bytes (framing, headers)
  double nvlink_rate = 450e9;   // one GPU into the node's switch, one direction
  double device_copy_rate = 1.6e12;  // pack / unpack: bytes copied per second on one GPU
  double host_device_rate = 55e9;    // host<->device copy (documented; used by no design yet)
};

enum class Topology : uint8_t { kSingleSwitch, kLeafSpine };

struct FabricSpec {
  Topology topology = Topology::kLeafSpine;
  int nodes_per_leaf = 4;        // leaf-spine: nodes under one leaf switch
  double oversubscription = 1;   // leaf-spine: leaf down bandwidth / up bandwidth
};

struct LatencySpec {
  double nic = 2e-6;      // one NIC traversal (each end of an inter-node path)
  double nvlink = 1e-6;   // one NVLink traversal
  double switch_hop = 0.5e-6;  // each switch on an inter-node path
};

struct OverheadSpec {
  double message = 5e-6;     // send + receive of one control message (announce, release, ...)
  double read = 1e-6;        // posting one RDMA read or write
  double group = 20e-6;      // per layer group per rank (bookkeeping, stream sync)
  double collective = 50e-6; // per collective call (NCCL launch + sync) in the baselines
  double bucket_bytes = 1e9; // the broadcast design's bucket (bytes per broadcast call)
};

struct ClusterSpec {
  std::string name;
  NodeSpec trainer;
  NodeSpec inference;
  FabricSpec fabric;
  LatencySpec latency;
  OverheadSpec overhead;

  // Parses and validates (every error names the field: "cluster.json: trainer.nodes: must be
  // a positive integer, got -1"). Unknown fields are errors (a typo must not silently
  // leave a default in place).
  static Result<ClusterSpec> parse(std::string_view text, const std::string& origin = "<cluster>");
  static Result<ClusterSpec> load(const std::string& path);
};

}  // namespace ferry::simulate
