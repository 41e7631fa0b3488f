// The rank worker of `ferry demo` and of the multi-process tests (internal): one trainer
// or inference rank as its own process (`ferry worker ...`), started by run_demo.
//
// Protocol, through the store: the worker writes {job}/ready/{role}{rank} (its pid) once
// its Producer or Consumer is created; the driver writes {job}/go/{v}; the worker syncs v
// and writes {job}/result/{v}/{role}{rank} (JSON: ok, error, bytes, seconds, verified,
// mismatch, torn, dropped, failures, phases). It exits 0 after its last version, 2 on an
// error of its own (the message on stderr).
#pragma once

#include <cstdint>
#include <string>

namespace ferry::tools {

struct WorkerSpec {
  std::string role;  // "producer" | "consumer"
  int rank = 0;
  std::string model;       // config path (already shrunk)
  std::string trainer;
  std::string inference;
  std::string store;       // URL (token from FERRY_TOKEN)
  std::string job = "ferry";
  std::string backend = "ucx";  // one-host settings; ucx: UCX_TLS from FERRY_UCX_TLS, else sm,tcp,self
  std::string mode = "pull";
  bool checksums = false;
  uint64_t seed = 1;
  int first_version = 1;
  int last_version = 1;
  int crash_version = -1;  // SIGKILL itself at `crash_point` of this sync
  int crash_point = 0;     // consumer: group * 4 + phase (see engine::TestHooks::consumer_point);
                           // producer: the group it is about to materialise
  int stall_ms = 20000;
  int timeout_ms = 20000;
};
int run_worker(const WorkerSpec& spec);

// The protocol's store keys.
std::string worker_ready_key(const std::string& job, const std::string& role, int rank);
std::string worker_go_key(const std::string& job, int version);
std::string worker_result_key(const std::string& job, int version, const std::string& role, int rank);

}  // namespace ferry::tools
