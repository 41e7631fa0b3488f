// The C ABI between the core (src/tensor/device.cpp) and the CUDA plugin
// (src/tensor/cuda/, libferry_cuda.so). C types only, so a plugin built by another
// compiler (nvcc's host compiler) loads safely; the ABI number changes with any change
// here or in batch::CopyDesc / batch::BlockTask.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/batch_layout.h"

extern "C" {

#define FERRY_CUDA_PLUGIN_ABI 4
#define FERRY_CUDA_PLUGIN_SYMBOL "ferry_cuda_plugin_v1"

struct FerryCudaPlugin {
  uint32_t abi;  // FERRY_CUDA_PLUGIN_ABI
  uint32_t desc_size;  // sizeof(batch::CopyDesc) the plugin was built with
  // CUDA devices the driver reports (>= 0); negative on error, with a message in err.
  int (*device_count)(char* err, size_t err_len);
  // "NVIDIA H200 (sm_90, 139 GiB)" for device `device`; 0 on success.
  int (*device_name)(int device, char* out, size_t out_len);
  // Runs the batch on `device` and `stream` (a cudaStream_t, null: default stream) and
  // waits for it there. 0 on success; otherwise a message in err naming the CUDA call.
  // Device memory: cudaMalloc on `device` (0 on success, *out set) and cudaFree.
  int (*alloc)(int device, size_t bytes, void** out, char* err, size_t err_len);
  int (*release)(void* ptr);
  // cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault) on the default stream, then waits
  // for it: any direction under unified addressing, done on return (device to device too).
  int (*copy_bytes)(void* dst, const void* src, size_t bytes, char* err, size_t err_len);
  // cudaHostRegister(ptr, bytes, mapped | portable) on `device`, refused (nonzero, a
  // message in err) when the device cannot use the host pointer itself; host_release
  // undoes it (cudaHostUnregister).
  int (*host_register)(int device, void* ptr, size_t bytes, char* err, size_t err_len);
  int (*host_release)(void* ptr);
  int (*run_batch)(int device, const ferry::batch::CopyDesc* descs, uint64_t num_descs,
                   const ferry::batch::BlockTask* tasks, uint64_t num_tasks, void* stream, char* err,
                   size_t err_len);
  // FP8 block quantisation (fp8_blocks.h) of `batch` contiguous rows x cols matrices of
  // ElementType `src_type` at `src` into e4m3 `q` and `scales` (Fp8ScaleFormat `format`:
  // f32, or E8M0 bytes), on `device` and `stream`, waiting for it there. 0 on success;
  // otherwise a message in err.
  int (*fp8_blocks)(int device, const void* src, uint8_t src_type, int64_t batch, int64_t rows, int64_t cols,
                    int64_t block, uint8_t format, void* q, void* scales, void* stream, char* err, size_t err_len);
  // CUDA IPC: the 64-byte handle of the allocation at `ptr` (cudaIpcGetMemHandle); another
  // process opens it on `device` (cudaIpcOpenMemHandle, peer access enabled lazily) and
  // closes it (cudaIpcCloseMemHandle). 0 on success; otherwise a message in err.
  int (*ipc_export)(void* ptr, void* handle, char* err, size_t err_len);
  int (*ipc_open)(int device, const void* handle, void** out, char* err, size_t err_len);
  int (*ipc_close)(void* ptr);
};

typedef const FerryCudaPlugin* (*FerryCudaPluginEntry)(void);

}  // extern "C"
