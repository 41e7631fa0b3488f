// engine/cuda_ipc.h — staging in GPU memory shared between processes of one host: what
// a producer with GPU staging (ProducerOptions::staging_device) publishes in its lease,
// and how a consumer with GPU params (ConsumerOptions::cuda_ipc) maps it to copy device
// to device, with no host hop. Internal to the engine.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "engine/lane.h"
#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry::engine {

// This process's host, for telling whether a peer's device memory can be mapped:
// common::this_host().host (the host name, its boot id and this process's network
// namespace, so the emulated hosts of the multi-host tests count as different;
// common/host.h).
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

// The consumer's CUDA IPC lane (engine/lane.h): a receive ring on its params' device
// and, per producer, that producer's GPU staging mapped here (viable to a producer once
// its export is mapped). A group's staged bytes reach the device ring by device-to-device
// copies; unpack then runs there. It moves staged bytes into the receive slot only (the
// plan gives it nothing else); the transport lane is the other (host receive ring,
// params, in place).
// Threading: connect and copy on the consumer's sync thread, disconnect from any thread
// (a peer failure); a copy holds the mapping it reads, so a disconnect meanwhile is safe.
// Errors name the consumer rank, the group and the producer.
class CudaIpcLane final : public Lane {
 public:
  // A device ring of `ring_bytes` on `device`; the device's error naming the ring.
  static Result<std::unique_ptr<CudaIpcLane>> create(int rank, Device device, uint64_t ring_bytes);
  // Producer p's lease's cuda_ipc field ("": it exports none): mapped when it can be,
  // else why_not(p) says why (another host, a CUDA error).
  void connect(int p, std::string_view exported);
  void disconnect(int p);
  LaneKind kind() const override { return LaneKind::kCudaIpc; }
  bool viable(int p) const override;
  std::string why_not(int p) const override;  // "" when mapped or nothing exported
  // Lane::post: copy() of the transfer's staged bytes into the device ring (done when it
  // returns); kInvalidArgument for a transfer in place or into a param.
  Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
              std::vector<Completion>& ops) override;
  // Copies `n` bytes at `remote` of producer p's staging to `ring_offset` of the device
  // ring, done when it returns: kPeerFailed when p is not mapped (failed meanwhile),
  // kOutOfRange outside its staging, the device's error.
  Status copy(int p, uint64_t remote, uint64_t ring_offset, uint64_t n, int group);
  std::byte* ring() const { return ring_.get(); }
  Device device() const { return device_; }

 private:
  CudaIpcLane(int rank, Device device, std::shared_ptr<std::byte> ring, uint64_t bytes)
      : rank_(rank), device_(device), ring_(std::move(ring)), ring_bytes_(bytes) {}
  struct Mapped {
    std::shared_ptr<std::byte> staging;  // null: not mapped
    uint64_t bytes = 0;
    std::string why;  // why an export is not mapped
  };
  int rank_;
  Device device_;
  std::shared_ptr<std::byte> ring_;
  uint64_t ring_bytes_;
  mutable std::mutex mu_;
  std::map<int, Mapped> peers_;
};

}  // namespace ferry::engine
