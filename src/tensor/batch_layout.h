// The index arithmetic of a batched strided copy, shared by the CUDA kernel
// (src/tensor/cuda/) and the host: plan_batch() turns StridedCopy's into fixed-size
// descriptors and block tasks; BatchCursor walks one thread's words of one task. The
// kernel runs exactly this code per thread, and emulate_batch() runs it on the CPU,
// thread by thread, so tests check the kernel's arithmetic against strided_copy without
// a GPU.
//
// A copy is cut into *words* of `width` bytes (16, 8, 4, 2 or 1: the largest that
// divides both addresses, every byte stride and the contiguous run), so a row shard
// moves 16 bytes per load where alignment allows. The innermost dim of a descriptor
// is always a run of words with stride `width` on both sides: either a whole
// contiguous row (inner elements contiguous on both sides), or the bytes of one element
// when the inner dim is strided. A copy that converts between float dtypes is cut into
// elements instead: one word is one element, read as its source dtype and written as
// its destination dtype (element_convert.h).
#pragma once

#include <cstdint>

#include "tensor/element_convert.h"

#if defined(__CUDACC__)
#define FERRY_HD __host__ __device__
#else
#define FERRY_HD
#endif

#if !defined(__CUDACC__)
#include <span>
#include <vector>

#include "ferry/device.h"
#endif

namespace ferry::batch {

// Dims of a descriptor after coalescing, innermost word dim included. Plans' copies
// coalesce to 1-4 dims; more is refused by plan_batch with an error.
inline constexpr int kMaxDims = 10;
// Threads per block in the kernel and in emulate_batch.
inline constexpr uint32_t kThreadsPerBlock = 256;
// Words one block task covers (each thread does kWordsPerTask / kThreadsPerBlock).
inline constexpr uint32_t kWordsPerTask = 256 * 16;

struct CopyDesc {
  uint64_t src = 0;  // address of the first word (0: zero-fill)
  uint64_t dst = 0;
  uint32_t width = 1;  // bytes per word (a converting copy: the destination element's)
  uint32_t ndim = 1;   // dims used in shape/strides; [ndim-1] is the word dim
  // A converting copy: the source and destination ElementType; kNoConversion: bytes.
  uint8_t src_type = kNoConversion;
  uint8_t dst_type = kNoConversion;
  uint64_t words = 0;  // product of shape
  int64_t shape[kMaxDims] = {};
  int64_t src_stride[kMaxDims] = {};  // bytes
  int64_t dst_stride[kMaxDims] = {};  // bytes
};

// Block `blockIdx.x` copies words [first, first + count) of descriptor `desc`.
struct BlockTask {
  uint64_t first = 0;
  uint32_t desc = 0;
  uint32_t count = 0;
};

// One thread's walk over the words of a task: starts at word `first + thread`, steps by
// `step` (the block's thread count). Divides only when it enters a new row.
struct BatchCursor {
  const CopyDesc* d;
  uint64_t row;     // index over the outer dims (all but the word dim)
  int64_t col;      // word within the row
  int64_t src_row;  // byte offsets of the row's first word
  int64_t dst_row;

  FERRY_HD void place_row() {
    uint64_t rem = row;
    src_row = 0;
    dst_row = 0;
    for (int k = static_cast<int>(d->ndim) - 2; k >= 0; --k) {
      const uint64_t n = static_cast<uint64_t>(d->shape[k]);
      const uint64_t i = rem % n;
      rem /= n;
      src_row += static_cast<int64_t>(i) * d->src_stride[k];
      dst_row += static_cast<int64_t>(i) * d->dst_stride[k];
    }
  }

  FERRY_HD BatchCursor(const CopyDesc* desc, uint64_t word) : d(desc) {
    const uint64_t inner = static_cast<uint64_t>(d->shape[d->ndim - 1]);
    row = word / inner;
    col = static_cast<int64_t>(word - row * inner);
    place_row();
  }

  FERRY_HD int64_t src_offset() const { return src_row + col * d->src_stride[d->ndim - 1]; }
  FERRY_HD int64_t dst_offset() const { return dst_row + col * d->dst_stride[d->ndim - 1]; }

  FERRY_HD void advance(uint32_t step) {
    const int64_t inner = d->shape[d->ndim - 1];
    col += step;
    if (col < inner) return;
    const int64_t rows = col / inner;
    col -= rows * inner;
    row += static_cast<uint64_t>(rows);
    place_row();
  }
};

// Copies (or zeroes) one word: the kernel's inner step, also run by emulate_batch.
FERRY_HD inline void copy_word(const CopyDesc& d, int64_t src_off, int64_t dst_off) {
  unsigned char* dst = reinterpret_cast<unsigned char*>(d.dst) + dst_off;
  if (d.src == 0) {
    for (uint32_t b = 0; b < d.width; ++b) dst[b] = 0;
    return;
  }
  const unsigned char* src = reinterpret_cast<const unsigned char*>(d.src) + src_off;
  if (d.dst_type != kNoConversion) {
    store_float(dst, d.dst_type, load_float(src, d.src_type));
    return;
  }
#if defined(__CUDA_ARCH__)
  // Aligned by construction (plan_batch picks width from the addresses and strides).
  switch (d.width) {
    case 16: *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src); break;
    case 8: *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src); break;
    case 4: *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src); break;
    case 2: *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src); break;
    default: *dst = *src; break;
  }
#else
  __builtin_memcpy(dst, src, d.width);
#endif
}

#if !defined(__CUDACC__)
// The kernel's ElementType of a float dtype; kNoConversion for the others.
uint8_t element_type(DType d);

struct BatchPlan {
  std::vector<CopyDesc> descs;
  std::vector<BlockTask> tasks;
  uint64_t bytes = 0;  // bytes written
};

// Descriptors and tasks for `copies` (host code; the addresses are only stored, never
// read). Errors: unequal shapes, a negative numel, too many dims after coalescing, a
// conversion other than between float dtypes.
Result<BatchPlan> plan_batch(std::span<const StridedCopy> copies, uint32_t words_per_task = kWordsPerTask);

// Runs `plan` on the CPU exactly as the kernel does: for every task, every thread of
// kThreadsPerBlock, a BatchCursor from its first word, stepping by the block size. For
// tests (the oracle is strided_copy); host memory only.
void emulate_batch(const BatchPlan& plan);
#endif

}  // namespace ferry::batch
