// ferry/device.h — where a tensor's bytes live (host memory or a CUDA device), and the
// batched strided copies that plan replay (and later pack and unpack) run there.
//
// Plans are element maps and do not change with the memory kind: the same copies run on
// the host (strided_copy, ferry/tensor.h) or on a GPU (many copies per kernel launch).
//
// CUDA is a plugin. The core never links the CUDA runtime: the first time CUDA memory
// is touched it loads libferry_cuda.so (built when nvcc is found at configure time,
// FERRY_CUDA=AUTO; it carries the CUDA runtime statically, so only the NVIDIA driver is
// needed where it runs). It is looked for in $FERRY_CUDA_PLUGIN (a file), then in the
// install's library folder (lib/ferry/), then in the build tree it was built in.
// cuda_status() says what was found and, when nothing can run, why.
//
// Threading: every function here may be called from any thread. copy_batch on a CUDA
// device runs on the stream it is given and returns once the copies have finished
// there; copies in one batch must not overlap in their destinations.
// Errors: Status, never exceptions; a CUDA error names the CUDA call and its message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ferry/status.h"
#include "ferry/tensor.h"  // Device, Layout, DType

namespace ferry {

// torch's names: "cpu", "cuda:0".
std::string device_str(Device device);
// Parses "cpu", "cuda" (device 0) or "cuda:N".
Result<Device> parse_device(std::string_view text);

// What this build and this machine can do with CUDA memory.
struct CudaStatus {
  bool plugin_loaded = false;  // libferry_cuda.so was found and loaded
  int device_count = 0;        // CUDA devices the driver reports (0 when none or no driver)
  std::string plugin_path;     // the plugin that was loaded, when one was
  std::string detail;          // why no device can be used, or the devices' names
  bool usable() const { return plugin_loaded && device_count > 0; }
};
// Probes once (loads the plugin, asks the driver) and caches the answer.
const CudaStatus& cuda_status();
// Why CUDA device `device` cannot be used here (cuda_status().detail, or how many devices
// the driver reports); nullopt when it can. For callers' own errors naming what needs it.
std::optional<std::string> cuda_unusable(Device device);

// A CUDA stream (cudaStream_t) as an opaque handle; nullptr is the calling thread's
// default stream. ferry never creates or destroys the caller's streams.
using DeviceStream = void*;

// `bytes` of memory on `device` (host: new[]; CUDA: cudaMalloc), freed when the last
// owner lets go. For staging and tests; a caller's own tensors stay the caller's.
Result<std::shared_ptr<std::byte>> device_alloc(Device device, size_t bytes);
// Copies `bytes` between any host and CUDA memory (unified addressing), and returns
// when they have arrived.
Status device_memcpy(void* dst, const void* src, size_t bytes);

// Makes host memory [ptr, ptr + bytes) readable and writable by kernels on `device`
// (pinned and mapped: cudaHostRegister), at the same address: what a kernel packs into
// or unpacks from when staging is in host memory (the path across hosts: UCX moves
// host memory). Refused when the GPU cannot use host pointers for registered memory
// (all current data-center GPUs can). Lasts until unregister_host_for_cuda(ptr).
Status register_host_for_cuda(Device device, void* ptr, size_t bytes);
void unregister_host_for_cuda(void* ptr);

// One strided copy of a batch: the `src_layout`-shaped elements at `src` (flat element
// space of `dtype` starting at `src`) go to the `dst_layout`-shaped elements at `dst`,
// index by index (equal shapes). `src == nullptr` zero-fills the destination instead.
// Both pointers are in the batch's device's memory.
struct StridedCopy {
  const std::byte* src = nullptr;
  Layout src_layout;
  std::byte* dst = nullptr;
  Layout dst_layout;
  DType dtype = DType::kBF16;  // of dst (and of src, unless src_dtype says otherwise)
  // The source's dtype when it differs from `dtype`: the copy converts, between float
  // dtypes only (bf16, f16, f32, float8 e4m3fn / e5m2), with the bits strided_copy gives.
  std::optional<DType> src_dtype;
};

// Runs every copy of `copies` on `device`: on the host with strided_copy/strided_zero,
// on a CUDA device with as few kernel launches as the batch needs, on `stream`, and
// returns when they have finished. Layouts must lie within the caller's buffers (not
// checked here: callers validate against their tensors, as execute() does). Errors:
// unequal shapes, a layout of more dims than a kernel takes after coalescing, no CUDA
// plugin or device, or a CUDA error.
Status copy_batch(Device device, std::span<const StridedCopy> copies, DeviceStream stream = nullptr);

// CUDA IPC, for processes on one host. cuda_ipc_export: the handle (kCudaIpcHandleBytes
// bytes) of device memory `ptr` on `device`, which must be the start of a device_alloc
// allocation. cuda_ipc_open: maps a handle another process exported, for kernels and
// copies on `device`; unmapped when the last owner lets go (the exporter must keep the
// memory until then). Errors: no usable device, a CUDA error (a handle of this very
// process cannot be opened: use the pointer itself).
inline constexpr size_t kCudaIpcHandleBytes = 64;
Result<std::string> cuda_ipc_export(Device device, void* ptr);
Result<std::shared_ptr<std::byte>> cuda_ipc_open(Device device, std::string_view handle);

// FP8 e4m3 block quantisation on `device` (the host, or a CUDA device: one kernel, on
// `stream`, returning when done): `src` holds `batch` contiguous rows x cols matrices of
// float dtype `src_dtype`; each block x block tile gets scale = amax / 448 (1 when its
// amax is 0) in `scales` (f32, batch x ceil(rows / block) x ceil(cols / block),
// row-major) and its values e4m3(v / scale) in `q` (batch x rows x cols bytes). The
// same bits on every device (src/tensor/fp8_blocks.h). All three buffers in `device`'s
// memory. Errors: a non-float dtype, a non-positive block, no usable device.
//
// `format` chooses the tiles and how their scales are kept (Fp8Scales): kF32 as above;
// kUe8m0 the same tiles with the scale rounded up to a power of two, 2^ceil(log2(amax /
// 448)), stored as its E8M0 byte (exponent + 127; `scales` then holds one byte per tile:
// DeepGEMM / SGLang's UE8M0); kMx tiles of 1 x block (a run of one row: MXFP8 with block
// 32, OCP MX v1.0) with scale 2^(floor(log2 amax) - 8) as an E8M0 byte. E8M0 exponents
// are clamped to [-127, 127]; an all-zero tile's scale is 1 (byte 127) in every format.
enum class Fp8Scales : uint8_t { kF32 = 0, kUe8m0 = 1, kMx = 2 };
Status fp8_block_quantize(Device device, const std::byte* src, DType src_dtype, int64_t batch, int64_t rows,
                          int64_t cols, int64_t block, std::byte* q, std::byte* scales, DeviceStream stream = nullptr,
                          Fp8Scales format = Fp8Scales::kF32);

}  // namespace ferry
