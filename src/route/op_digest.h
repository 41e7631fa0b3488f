// Digests of route ops (Routes::fingerprint): one fold over a group's ops in order, the
// same whether the router made the ops or elided them (RouterOptions::packs_of).
#pragma once

#include <cstdint>
#include <utility>

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
// A quant op: its fields, the region as a layout's shape, then each fill.
inline uint64_t digest_op(uint64_t seed, const QuantOp& op) {
  uint64_t h = digest_op(seed, uint64_t{op.format} << 32 | op.block, op.dtype, op.offset,
                         Layout{op.region, Shape(op.region.size(), 0), static_cast<int64_t>(op.fills.size())});
  for (const FillOp& f : op.fills) {
    h = digest_op(h, f.box, op.dtype, 0, f.src);
    h = digest_op(h, f.box, op.dtype, 1, f.dst);
  }
  return h;
}
// A producer group's ops as every rank agrees on them: its packs, then its quant ops.
inline std::pair<uint64_t, uint64_t> group_digest(const ProducerGroup& g) {
  if (g.elided_packs) return {g.elided_packs, g.elided_digest};
  uint64_t d = 0;
  for (const PackOp& op : g.packs) d = digest_op(d, op);
  for (const QuantOp& op : g.quants) d = digest_op(d, op);
  return {g.packs.size() + g.quants.size(), d};
}

}  // namespace ferry::route_detail
