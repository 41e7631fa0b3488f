// engine/cuda_ipc.h — staging in GPU memory shared between processes of one host: what
// a producer with GPU staging (ProducerOptions::staging_device) publishes in its lease,
// and how a consumer with GPU params (ConsumerOptions::cuda_ipc) maps it to copy device
// to device, with no host hop. Internal to the engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry::engine {

// This process's host, for telling whether a peer's device memory can be mapped: the
// host name, its boot id and this process's network namespace (so the emulated hosts
// of the multi-host tests, network namespaces of one machine, count as different).
std::string host_identity();
// A random number drawn once per process: tells this very process from another with the
// same pid (containers of one host with their own PID namespaces).
uint64_t process_token();

// A producer's GPU staging ring, as its lease carries it.
struct CudaIpcExport {
  std::string host;     // host_identity() of the producer's process
  uint64_t pid = 0;     // its process (informational: pids repeat across PID namespaces)
  uint64_t process = 0; // process_token() of the producer's process: same process iff equal
  int device = 0;       // the CUDA device the ring is on
  uint64_t ptr = 0;     // the ring's address in the producer's process
  uint64_t bytes = 0;   // the ring's size
  std::string handle;   // cuda_ipc_export of the ring (kCudaIpcHandleBytes)
  friend bool operator==(const CudaIpcExport&, const CudaIpcExport&) = default;
};
std::string encode_cuda_ipc(const CudaIpcExport& e);
Result<CudaIpcExport> decode_cuda_ipc(std::string_view blob);

// Maps `e` for this process on `device`: the pointer itself when `e` is this very
// process (ranks as threads: CUDA cannot open its own handles), the IPC handle when it
// is another process on this host. kUnavailable naming why not otherwise (another host,
// a CUDA error).
Result<std::shared_ptr<std::byte>> map_cuda_ipc(const CudaIpcExport& e, Device device);

}  // namespace ferry::engine
