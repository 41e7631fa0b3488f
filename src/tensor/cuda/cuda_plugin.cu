// libferry_cuda.so: the CUDA half of copy_batch (ferry/device.h). One kernel runs a
// whole batch: block b copies the words of task b (batch_layout.h), each thread walking
// its words with a BatchCursor, the same code the host tests run in emulate_batch().
// Loaded by the core with dlopen; carries the CUDA runtime statically.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "tensor/device_plugin.h"
#include "tensor/fp8_blocks.h"

namespace {

using ferry::batch::BatchCursor;
using ferry::batch::BlockTask;
using ferry::batch::CopyDesc;
using ferry::batch::kThreadsPerBlock;

__global__ void __launch_bounds__(kThreadsPerBlock) run_tasks(const CopyDesc* descs, const BlockTask* tasks) {
  const BlockTask task = tasks[blockIdx.x];
  if (threadIdx.x >= task.count) return;
  const CopyDesc& d = descs[task.desc];
  BatchCursor cur(&d, task.first + threadIdx.x);
  for (uint32_t w = threadIdx.x; w < task.count; w += blockDim.x) {
    ferry::batch::copy_word(d, cur.src_offset(), cur.dst_offset());
    cur.advance(blockDim.x);
  }
}

// One block per tile (fp8_blocks.h): amax over the tile (a shared-memory reduction),
// then every value divided by the tile's scale and encoded as e4m3.
__global__ void __launch_bounds__(kThreadsPerBlock) fp8_tiles(const unsigned char* src, uint8_t type, int64_t rows,
                                                              int64_t cols, int64_t block, uint8_t format,
                                                              int64_t first, unsigned char* q, unsigned char* scales) {
  using namespace ferry::batch;
  const int64_t tile = first + blockIdx.x;
  const Fp8Tile tl = fp8_tile(tile, rows, cols, fp8_tile_rows(format, block), block);
  const int64_t base = tl.b * rows * cols, w = tl.c1 - tl.c0, n = (tl.r1 - tl.r0) * w;
  const uint32_t es = element_size(type);
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    amax = fp8_amax(amax, load_float(src + (base + (tl.r0 + i / w) * cols + tl.c0 + i % w) * es, type));
  }
  __shared__ float red[kThreadsPerBlock];
  red[threadIdx.x] = amax;
  __syncthreads();
  for (unsigned s = kThreadsPerBlock / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && red[threadIdx.x + s] > red[threadIdx.x]) red[threadIdx.x] = red[threadIdx.x + s];
    __syncthreads();
  }
  unsigned char stored[4];
  const float scale = fp8_scale(format, red[0], stored);
  if (threadIdx.x == 0) {
    for (uint32_t k = 0; k < fp8_scale_bytes(format); ++k) scales[tile * fp8_scale_bytes(format) + k] = stored[k];
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t at = base + (tl.r0 + i / w) * cols + tl.c0 + i % w;
    q[at] = fp8_quantize(load_float(src + at * es, type), scale);
  }
}

int fail(char* err, size_t len, const char* call, cudaError_t e) {
  std::snprintf(err, len, "%s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
  return 1;
}

#define FERRY_CUDA_TRY(call)                           \
  do {                                                 \
    const cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) return fail(err, err_len, #call, e_); \
  } while (0)

int device_count(char* err, size_t err_len) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice) return 0;
  if (e != cudaSuccess) {
    fail(err, err_len, "cudaGetDeviceCount", e);
    return -1;
  }
  return n;
}

int device_name(int device, char* out, size_t out_len) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::snprintf(out, out_len, "(unknown)");
    return 1;
  }
  std::snprintf(out, out_len, "%s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return 0;
}

// Restores the calling thread's current device on every return.
struct DeviceGuard {
  int previous = -1;
  ~DeviceGuard() {
    if (previous >= 0) cudaSetDevice(previous);
  }
};

int run_batch(int device, const CopyDesc* descs, uint64_t num_descs, const BlockTask* tasks, uint64_t num_tasks,
              void* stream_handle, char* err, size_t err_len) {
  DeviceGuard guard;
  FERRY_CUDA_TRY(cudaGetDevice(&guard.previous));
  FERRY_CUDA_TRY(cudaSetDevice(device));
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const size_t desc_bytes = num_descs * sizeof(CopyDesc);
  const size_t task_bytes = num_tasks * sizeof(BlockTask);
  void* table = nullptr;
  FERRY_CUDA_TRY(cudaMallocAsync(&table, desc_bytes + task_bytes, stream));
  auto* d_descs = static_cast<CopyDesc*>(table);
  auto* d_tasks = reinterpret_cast<BlockTask*>(static_cast<char*>(table) + desc_bytes);
  cudaError_t e = cudaMemcpyAsync(d_descs, descs, desc_bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaMemcpyAsync(d_tasks, tasks, task_bytes, cudaMemcpyHostToDevice, stream);
  // Grids of at most 2^31 - 1 blocks.
  constexpr uint64_t kMaxGrid = 0x7fffffffull;
  for (uint64_t first = 0; e == cudaSuccess && first < num_tasks; first += kMaxGrid) {
    const uint64_t n = num_tasks - first < kMaxGrid ? num_tasks - first : kMaxGrid;
    run_tasks<<<static_cast<unsigned>(n), kThreadsPerBlock, 0, stream>>>(d_descs, d_tasks + first);
    e = cudaGetLastError();
  }
  // The host tables are pageable: the copies above finished reading them before
  // returning, and the stream waits below before the caller may free anything.
  const cudaError_t freed = cudaFreeAsync(table, stream);
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(err, err_len, "batch kernel", e);
  if (freed != cudaSuccess) return fail(err, err_len, "cudaFreeAsync", freed);
  if (synced != cudaSuccess) return fail(err, err_len, "cudaStreamSynchronize", synced);
  return 0;
}

int fp8_blocks(int device, const void* src, uint8_t src_type, int64_t batch, int64_t rows, int64_t cols,
               int64_t block, uint8_t format, void* q, void* scales, void* stream_handle, char* err, size_t err_len) {
  DeviceGuard guard;
  FERRY_CUDA_TRY(cudaGetDevice(&guard.previous));
  FERRY_CUDA_TRY(cudaSetDevice(device));
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int64_t tiles = ferry::batch::fp8_num_tiles(batch, rows, cols, ferry::batch::fp8_tile_rows(format, block), block);
  constexpr int64_t kMaxGrid = 0x7fffffff;
  cudaError_t e = cudaSuccess;
  for (int64_t first = 0; e == cudaSuccess && first < tiles; first += kMaxGrid) {
    const int64_t n = tiles - first < kMaxGrid ? tiles - first : kMaxGrid;
    fp8_tiles<<<static_cast<unsigned>(n), kThreadsPerBlock, 0, stream>>>(
        static_cast<const unsigned char*>(src), src_type, rows, cols, block, format, first,
        static_cast<unsigned char*>(q), static_cast<unsigned char*>(scales));
    e = cudaGetLastError();
  }
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return fail(err, err_len, "fp8 block kernel", e);
  if (synced != cudaSuccess) return fail(err, err_len, "cudaStreamSynchronize", synced);
  return 0;
}

int ipc_export(void* ptr, void* handle, char* err, size_t err_len) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "the core carries 64-byte handles");
  cudaIpcMemHandle_t h;
  FERRY_CUDA_TRY(cudaIpcGetMemHandle(&h, ptr));
  std::memcpy(handle, &h, sizeof(h));
  return 0;
}

int ipc_open(int device, const void* handle, void** out, char* err, size_t err_len) {
  DeviceGuard guard;
  FERRY_CUDA_TRY(cudaGetDevice(&guard.previous));
  FERRY_CUDA_TRY(cudaSetDevice(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  FERRY_CUDA_TRY(cudaIpcOpenMemHandle(out, h, cudaIpcMemLazyEnablePeerAccess));
  return 0;
}

int ipc_close(void* ptr) { return cudaIpcCloseMemHandle(ptr) == cudaSuccess ? 0 : 1; }

int alloc(int device, size_t bytes, void** out, char* err, size_t err_len) {
  DeviceGuard guard;
  FERRY_CUDA_TRY(cudaGetDevice(&guard.previous));
  FERRY_CUDA_TRY(cudaSetDevice(device));
  FERRY_CUDA_TRY(cudaMalloc(out, bytes == 0 ? 1 : bytes));
  return 0;
}

int release(void* ptr) { return cudaFree(ptr) == cudaSuccess ? 0 : 1; }

int copy_bytes(void* dst, const void* src, size_t bytes, char* err, size_t err_len) {
  // cudaMemcpy does not wait for a device-to-device copy: on the default stream, then
  // wait, so that the bytes are there (and the source free to reuse) on return.
  FERRY_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, 0));
  FERRY_CUDA_TRY(cudaStreamSynchronize(0));
  return 0;
}

int host_register(int device, void* ptr, size_t bytes, char* err, size_t err_len) {
  DeviceGuard guard;
  FERRY_CUDA_TRY(cudaGetDevice(&guard.previous));
  FERRY_CUDA_TRY(cudaSetDevice(device));
  int same = 0;
  FERRY_CUDA_TRY(cudaDeviceGetAttribute(&same, cudaDevAttrCanUseHostPointerForRegisteredMem, device));
  if (!same) {
    std::snprintf(err, err_len, "device %d cannot use host pointers for registered memory "
                  "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0)", device);
    return 1;
  }
  FERRY_CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  return 0;
}

int host_release(void* ptr) { return cudaHostUnregister(ptr) == cudaSuccess ? 0 : 1; }

const FerryCudaPlugin kPlugin = {FERRY_CUDA_PLUGIN_ABI, sizeof(CopyDesc), device_count, device_name,
                                 alloc,                 release,          copy_bytes,   host_register,
                                 host_release,          run_batch,        fp8_blocks,   ipc_export,
                                 ipc_open,              ipc_close};

}  // namespace

extern "C" __attribute__((visibility("default"))) const FerryCudaPlugin* ferry_cuda_plugin_v1(void) { return &kPlugin; }
