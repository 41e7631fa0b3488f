// The 1 GiB bf16 tensor both plan-replay benchmarks cut into 8 TP shards (host:
// plan_replay.cpp; CUDA device: device_copy.cpp), and the plan of one shard.
#pragma once

#include <cstdlib>

#include "ferry/plan.h"

namespace ferry_bench {

inline constexpr int64_t kRows = 16384;
inline constexpr int64_t kCols = 32768;  // 16384 x 32768 bf16 = 1 GiB
inline constexpr int kTp = 8;
inline constexpr int64_t kBytes = kRows * kCols * 2;

// Shard `rank` of kTp of source "w" cut along `dim` (0: rows, 1: columns), into param "shard".
inline ferry::Plan shard_plan(int rank, int dim) {
  using namespace ferry;
  Recorder rec;
  Tensor w = Tensor::source("w", {kRows, kCols}, DType::kBF16);
  const int64_t n = (dim == 0 ? kRows : kCols) / kTp;
  Shape shape = dim == 0 ? Shape{n, kCols} : Shape{kRows, n};
  if (!Tensor::param("shard", shape, DType::kBF16).copy_(w.narrow(dim, rank * n, n)).ok()) std::abort();
  return *rec.finish();
}

}  // namespace ferry_bench
