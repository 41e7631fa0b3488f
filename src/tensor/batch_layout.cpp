// plan_batch and emulate_batch: the host half of the batched strided copy (see
// batch_layout.h).
#include "tensor/batch_layout.h"

#include <algorithm>
#include <cstring>

namespace ferry::batch {

namespace {

// Largest power of two <= 16 dividing every value of `bits` (an OR of them).
uint32_t width_for(uint64_t bits) {
  if (bits == 0) return 16;
  const uint64_t low = bits & (~bits + 1);
  return static_cast<uint32_t>(std::min<uint64_t>(low, 16));
}

}  // namespace

uint8_t element_type(DType d) {
  switch (d) {
    case DType::kBF16: return kElemBF16;
    case DType::kF16: return kElemF16;
    case DType::kF32: return kElemF32;
    case DType::kF8E4M3: return kElemE4M3;
    case DType::kF8E5M2: return kElemE5M2;
    default: return kNoConversion;
  }
}


Result<BatchPlan> plan_batch(std::span<const StridedCopy> copies, uint32_t words_per_task) {
  if (words_per_task == 0) return invalid_argument("copy_batch: words per task must be positive");
  BatchPlan plan;
  for (size_t i = 0; i < copies.size(); ++i) {
    const StridedCopy& c = copies[i];
    const bool zero = c.src == nullptr;
    if (!zero && c.src_layout.shape != c.dst_layout.shape) {
      return invalid_argument("copy_batch: copy {} moves {} into {}: shapes differ", i, shape_str(c.src_layout.shape),
                              shape_str(c.dst_layout.shape));
    }
    if (c.dst_layout.strides.size() != c.dst_layout.shape.size() ||
        (!zero && c.src_layout.strides.size() != c.src_layout.shape.size())) {
      return invalid_argument("copy_batch: copy {} has a layout whose strides and shape differ in rank", i);
    }
    for (int64_t n : c.dst_layout.shape) {
      if (n < 0) return invalid_argument("copy_batch: copy {} has a negative size in {}", i, shape_str(c.dst_layout.shape));
    }
    if (c.dst == nullptr && c.dst_layout.numel() > 0) return invalid_argument("copy_batch: copy {} has no destination", i);
    Layout d = c.dst_layout;
    Layout s = zero ? c.dst_layout : c.src_layout;
    if (zero) {
      coalesce_layout(d);
      s = d;
    } else {
      coalesce_layouts(s, d);
    }
    const int64_t numel = d.numel();
    if (numel == 0) continue;
    if (d.ndim() == 0) {  // one element
      d = Layout{{1}, {1}, d.offset};
      s = Layout{{1}, {1}, s.offset};
    }
    if (!zero && c.src_dtype && *c.src_dtype != c.dtype) {
      // Converting: one word per element, every dim kept (the inner one strided by the
      // element sizes of each side).
      const uint8_t from = element_type(*c.src_dtype), to = element_type(c.dtype);
      if (from == kNoConversion || to == kNoConversion) {
        return invalid_argument("copy_batch: copy {} converts {} to {}: a GPU copy converts between float dtypes only", i,
                                dtype_name(*c.src_dtype), dtype_name(c.dtype));
      }
      if (d.ndim() > kMaxDims) {
        return invalid_argument("copy_batch: copy {} has {} dims after coalescing ({}); a GPU copy takes at most {}", i,
                                d.ndim(), d.to_string(), kMaxDims);
      }
      const int64_t ses = static_cast<int64_t>(dtype_size(*c.src_dtype));
      const int64_t des = static_cast<int64_t>(dtype_size(c.dtype));
      CopyDesc desc;
      desc.dst = reinterpret_cast<uint64_t>(c.dst + d.offset * des);
      desc.src = reinterpret_cast<uint64_t>(c.src + s.offset * ses);
      desc.width = static_cast<uint32_t>(des);
      desc.ndim = static_cast<uint32_t>(d.ndim());
      desc.src_type = from;
      desc.dst_type = to;
      for (int64_t k = 0; k < d.ndim(); ++k) {
        desc.shape[k] = d.shape[k];
        desc.dst_stride[k] = d.strides[k] * des;
        desc.src_stride[k] = s.strides[k] * ses;
      }
      desc.words = static_cast<uint64_t>(numel);
      if (plan.descs.size() >= UINT32_MAX) return invalid_argument("copy_batch: more than 2^32 copies in one batch");
      const uint32_t index = static_cast<uint32_t>(plan.descs.size());
      plan.descs.push_back(desc);
      plan.bytes += static_cast<uint64_t>(numel * des);
      for (uint64_t first = 0; first < desc.words; first += words_per_task) {
        plan.tasks.push_back(BlockTask{first, index, static_cast<uint32_t>(std::min<uint64_t>(words_per_task, desc.words - first))});
      }
      continue;
    }
    const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
    const int64_t nd = d.ndim();
    const bool inner_contiguous = d.strides[nd - 1] == 1 && s.strides[nd - 1] == 1;
    const int64_t outer = inner_contiguous ? nd - 1 : nd;
    const int64_t run = inner_contiguous ? d.shape[nd - 1] * es : es;
    if (outer + 1 > kMaxDims) {
      return invalid_argument("copy_batch: copy {} has {} dims after coalescing ({}); a GPU copy takes at most {}", i,
                              outer + 1, d.to_string(), kMaxDims);
    }
    CopyDesc desc;
    desc.dst = reinterpret_cast<uint64_t>(c.dst + d.offset * es);
    desc.src = zero ? 0 : reinterpret_cast<uint64_t>(c.src + s.offset * es);
    uint64_t bits = static_cast<uint64_t>(run) | desc.dst | desc.src;
    for (int64_t k = 0; k < outer; ++k) {
      desc.shape[k] = d.shape[k];
      desc.dst_stride[k] = d.strides[k] * es;
      desc.src_stride[k] = zero ? 0 : s.strides[k] * es;
      bits |= static_cast<uint64_t>(desc.dst_stride[k]) | static_cast<uint64_t>(desc.src_stride[k]);
    }
    desc.width = width_for(bits);
    desc.ndim = static_cast<uint32_t>(outer + 1);
    desc.shape[outer] = run / desc.width;
    desc.src_stride[outer] = zero ? 0 : desc.width;
    desc.dst_stride[outer] = desc.width;
    desc.words = static_cast<uint64_t>(numel * es) / desc.width;
    if (plan.descs.size() >= UINT32_MAX) return invalid_argument("copy_batch: more than 2^32 copies in one batch");
    const uint32_t index = static_cast<uint32_t>(plan.descs.size());
    plan.descs.push_back(desc);
    plan.bytes += static_cast<uint64_t>(numel * es);
    for (uint64_t first = 0; first < desc.words; first += words_per_task) {
      plan.tasks.push_back(BlockTask{first, index, static_cast<uint32_t>(std::min<uint64_t>(words_per_task, desc.words - first))});
    }
  }
  return plan;
}

void emulate_batch(const BatchPlan& plan) {
  for (const BlockTask& task : plan.tasks) {
    const CopyDesc& d = plan.descs[task.desc];
    for (uint32_t t = 0; t < kThreadsPerBlock && t < task.count; ++t) {
      BatchCursor cur(&d, task.first + t);
      for (uint32_t w = t; w < task.count; w += kThreadsPerBlock) {
        copy_word(d, cur.src_offset(), cur.dst_offset());
        cur.advance(kThreadsPerBlock);
      }
    }
  }
}

}  // namespace ferry::batch
