// Digests of route ops (Routes::fingerprint): one fold over a group's ops in order, the
// same whether the router made the ops or elided them (RouterOptions::packs_of).
#pragma once

#include <cstdint>

#include <xxhash.h>

#include "ferry/route.h"

namespace ferry::route_detail {

inline uint64_t digest_op(uint64_t seed, uint64_t index, DType dtype, uint64_t offset, const Layout& l) {
  const size_t nd = l.shape.size();
  int64_t buf[5 + 2 * 8];
  buf[0] = static_cast<int64_t>(index);
  buf[1] = static_cast<int64_t>(dtype);
  buf[2] = static_cast<int64_t>(offset);
  buf[3] = static_cast<int64_t>(nd);
  buf[4] = l.offset;
  if (nd <= 8 && l.strides.size() == nd) {
    for (size_t k = 0; k < nd; ++k) {
      buf[5 + k] = l.shape[k];
      buf[5 + nd + k] = l.strides[k];
    }
    return XXH64(buf, (5 + 2 * nd) * sizeof(int64_t), seed);
  }
  uint64_t h = XXH64(buf, 5 * sizeof(int64_t), seed);
  h = XXH64(l.shape.data(), l.shape.size() * sizeof(int64_t), h);
  return XXH64(l.strides.data(), l.strides.size() * sizeof(int64_t), h);
}
inline uint64_t digest_op(uint64_t seed, const PackOp& op) { return digest_op(seed, op.box, op.dtype, op.offset, op.src); }
inline uint64_t digest_op(uint64_t seed, const UnpackOp& op) {
  return digest_op(seed, op.param, op.src_dtype, op.offset, op.dst);
}

}  // namespace ferry::route_detail
