// The routes' executors: a producer's packs and FP8 quantisation of one group into its
// staging (pack_group, pack_group_packs, quantize_group), a consumer's unpacks of a
// received group into its params (unpack_group) and the gather of params back into
// receive-slot order (gather_group). Every op is bounds-checked before memory is touched
// (route/bounds.h); the wire format is codec.cpp's.
#include <algorithm>
#include <cstring>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ferry/device.h"
#include "ferry/route.h"
#include "route/bounds.h"
#include "route/tiles.h"

namespace ferry {

using route_bounds::bytes_within;
using route_bounds::layout_range;

namespace {

// Copies the elements `sel` selects — a layout over the row-major index space of a box
// of shape `box` — from a view of that box with strides `strides` whose element 0 is at
// `src` (a trainer's own tensor: a row range of a fused weight, a column range, ...),
// into `dst`, contiguous, converted from `dt` to `out_dt`. Runs of `sel` are cut at the
// box's rows and each piece is copied as one strided run of the view (a memcpy when its
// rows are contiguous and nothing converts).
void gather_from_view(const std::byte* src, const Shape& strides, const Shape& box, Layout sel, DType dt,
                      DType out_dt, std::byte* dst) {
  const uint64_t es = dtype_size(dt), out_es = dtype_size(out_dt);
  if (sel.numel() == 0) return;
  if (box.empty()) {  // 0-d: one element
    strided_copy(src, Layout{{1}, {1}, 0}, dt, dst, Layout{{1}, {1}, 0}, out_dt);
    return;
  }
  const Shape box_strides = contiguous_strides(box);
  const int64_t row = box.back();
  const int64_t row_stride = strides.back();
  auto memory_of = [&](int64_t flat) {
    int64_t m = 0;
    for (size_t k = 0; k < box.size(); ++k) {
      const int64_t i = flat / box_strides[k];
      flat -= i * box_strides[k];
      m += i * strides[k];
    }
    return m;
  };
  coalesce_layout(sel);
  const size_t nd = sel.shape.size();
  const int64_t inner = nd ? sel.shape.back() : 1;
  const int64_t inner_stride = nd ? sel.strides.back() : 1;
  Shape idx(nd > 0 ? nd - 1 : 0, 0);
  for (;;) {
    int64_t f = sel.offset;
    for (size_t k = 0; k + 1 < nd; ++k) f += idx[k] * sel.strides[k];
    if (inner_stride == 1) {
      for (int64_t n = inner; n > 0;) {
        const int64_t len = std::min(n, row - f % row);
        strided_copy(src, Layout{{len}, {row_stride}, memory_of(f)}, dt, dst, Layout{{len}, {1}, 0}, out_dt);
        dst += static_cast<uint64_t>(len) * out_es;
        f += len;
        n -= len;
      }
    } else {
      for (int64_t j = 0; j < inner; ++j, dst += out_es) {
        const std::byte* at = src + memory_of(f + j * inner_stride) * static_cast<int64_t>(es);
        if (out_dt == dt) {
          std::memcpy(dst, at, es);
        } else {
          strided_copy(at, Layout{{1}, {1}, 0}, dt, dst, Layout{{1}, {1}, 0}, out_dt);
        }
      }
    }
    size_t k = idx.size();
    while (k > 0 && ++idx[k - 1] == sel.shape[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

// The materialized tensor of held box `box` (`by_box`: LocalBox::box -> its data): a real
// tensor of the box's shape and its tensor's dtype, else an error naming the tensor.
Result<const Tensor*> box_tensor(const std::unordered_map<uint32_t, const Tensor*>& by_box, const Holdings& holdings,
                                 uint32_t box, uint32_t producer, int group) {
  if (box >= holdings.boxes.size()) return out_of_range("pack: box {} of {} held", box, holdings.boxes.size());
  const HeldBox& hb = holdings.boxes[box];
  const TensorDecl& d = holdings.tensors[hb.tensor];
  auto it = by_box.find(box);
  if (it == by_box.end()) {
    return not_found("pack: producer {} group {}: box {} of tensor '{}' was not materialized", producer, group,
                     hb.box.to_string(), d.name);
  }
  const Tensor& t = *it->second;
  if (!t.is_real() || t.shape() != hb.box.size || t.dtype() != d.dtype) {
    return invalid_argument("pack: tensor '{}' box {}: materialized {} but the routes need a real {} {}", d.name,
                            hb.box.to_string(), t.describe(), dtype_name(d.dtype), shape_str(hb.box.size));
  }
  return &t;
}

}  // namespace

Status pack_group(const Routes& routes, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (producer >= routes.producers.size()) return out_of_range("pack: producer {} of {}", producer, routes.producers.size());
  if (group < 0 || group >= routes.num_groups()) return out_of_range("pack: group {} of {}", group, routes.num_groups());
  return pack_group(routes.producers[producer].groups[static_cast<size_t>(group)], producer, group, holdings, boxes,
                    staging);
}

Status pack_group(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  FERRY_RETURN_IF_ERROR(pack_group_packs(pg, producer, group, holdings, boxes, staging));
  return quantize_group(pg, producer, group, holdings, boxes, staging);
}

Status pack_group_packs(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                        const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (staging.size() < pg.staging_bytes) {
    return out_of_range("pack: producer {} group {} needs {} staging bytes, got {}", producer, group, pg.staging_bytes,
                        staging.size());
  }
  std::unordered_map<uint32_t, const Tensor*> by_box;
  for (const LocalBox& lb : boxes) by_box[lb.box] = &lb.data;
  std::optional<Device> on_device;  // boxes in GPU memory: packed in one batch there
  std::vector<StridedCopy> device_packs;
  for (const PackOp& op : pg.packs) {
    FERRY_ASSIGN_OR_RETURN(const Tensor* held, box_tensor(by_box, holdings, op.box, producer, group));
    const Tensor& t = *held;
    const HeldBox& hb = holdings.boxes[op.box];
    const TensorDecl& d = holdings.tensors[hb.tensor];
    // Staging holds the box's dtype, or a float dtype the pack converts to (the router's
    // convert_on); anything else is routes built over other metadata.
    if (op.dtype != d.dtype && !(is_floating(op.dtype) && is_floating(d.dtype))) {
      return invalid_argument("pack: tensor '{}' is {}; can't pack it as {}", d.name, dtype_name(d.dtype),
                              dtype_name(op.dtype));
    }
    int64_t n, lo, hi;
    if (!layout_range(op.src, n, lo, hi) || (n > 0 && (lo < 0 || hi >= t.numel()))) {
      return out_of_range("pack: layout {} outside box {} of tensor '{}'", op.src.to_string(), hb.box.to_string(), d.name);
    }
    if (!bytes_within(op.offset, n, dtype_size(op.dtype), staging.size())) {
      return out_of_range("pack: tensor '{}' at {} overflows staging", d.name, op.offset);
    }
    if (!t.device().is_host()) {
      // In GPU memory: packed by a kernel with the others of this group, below.
      if (!t.is_contiguous()) {
        return invalid_argument("pack: tensor '{}' box {} is a strided view in {} memory; materialize it contiguous",
                                d.name, hb.box.to_string(), device_str(t.device()));
      }
      if (on_device && t.device() != *on_device) {
        return invalid_argument("pack: producer {} group {}: boxes on {} and {}; one GPU per rank", producer, group,
                                device_str(*on_device), device_str(t.device()));
      }
      on_device = t.device();
      FERRY_ASSIGN_OR_RETURN(std::byte * dev, t.device_ptr());
      std::optional<DType> from;
      if (op.dtype != d.dtype) from = d.dtype;
      device_packs.push_back({dev, op.src, staging.data() + op.offset, Layout::contiguous(op.src.shape), op.dtype, from});
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(std::byte * src, t.data_ptr());
    if (t.is_contiguous()) {
      strided_copy(src, op.src, d.dtype, staging.data() + op.offset, Layout::contiguous(op.src.shape), op.dtype);
    } else {
      gather_from_view(src, t.strides(), hb.box.size, op.src, d.dtype, op.dtype, staging.data() + op.offset);
    }
  }
  if (!device_packs.empty()) {
    Status st = copy_batch(*on_device, device_packs);
    if (!st.ok()) return st.with_context(fmt::format("pack: producer {} group {} on {}", producer, group, device_str(*on_device)));
  }
  return Status::Ok();
}


Status quantize_group(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                      const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (pg.quants.empty()) return Status::Ok();
  std::unordered_map<uint32_t, const Tensor*> by_box;
  for (const LocalBox& lb : boxes) by_box[lb.box] = &lb.data;
  std::unordered_map<uint32_t, std::vector<std::byte>> on_host;  // GPU boxes, copied once each
  // Regions this producer quantises: filled in the param's dtype, with the conversion a
  // consumer's unpack would run, then quantised by the code the consumer's hook runs.
  std::vector<std::byte> scratch, gathered;
  std::shared_ptr<std::byte> on_device;  // device scratch: the region, then its values and scales
  size_t on_device_bytes = 0;
  for (const QuantOp& q : pg.quants) {
    if (q.region.size() != 3 || !bytes_within(q.offset, static_cast<int64_t>(q.bytes()), 1, staging.size())) {
      return out_of_range("pack: producer {} group {}: quant op at {} overflows staging", producer, group, q.offset);
    }
    const uint64_t numel = q.numel();
    // A fill's box, checked: a real float tensor, the fill inside it and inside the region.
    auto checked_fill = [&](const FillOp& f) -> Result<const Tensor*> {
      FERRY_ASSIGN_OR_RETURN(const Tensor* held, box_tensor(by_box, holdings, f.box, producer, group));
      const HeldBox& hb = holdings.boxes[f.box];
      const TensorDecl& d = holdings.tensors[hb.tensor];
      if (!is_floating(d.dtype)) return invalid_argument("pack: tensor '{}' is {}; can't quantise it", d.name, dtype_name(d.dtype));
      int64_t n, lo, hi, dn, dlo, dhi;
      if (!layout_range(f.src, n, lo, hi) || (n > 0 && (lo < 0 || hi >= held->numel())) ||
          !layout_range(f.dst, dn, dlo, dhi) || dn != n || (n > 0 && (dlo < 0 || static_cast<uint64_t>(dhi) >= numel))) {
        return out_of_range("pack: quant fill {} -> {} outside box {} of tensor '{}' or its region {}",
                            f.src.to_string(), f.dst.to_string(), hb.box.to_string(), d.name, shape_str(q.region));
      }
      return held;
    };
    // Every box of the region in one GPU's memory (contiguous): filled by one copy kernel
    // and quantised by the device kernel (the host's arithmetic: fp8_blocks.h) into device
    // scratch, then copied into staging.
    std::optional<Device> gpu;
    bool all_gpu = !q.fills.empty();
    for (const FillOp& f : q.fills) {
      auto it = by_box.find(f.box);
      const Tensor* t = it == by_box.end() ? nullptr : it->second;
      if (!t || !t->device().is_cuda() || !t->is_contiguous() || (gpu && t->device() != *gpu)) {
        all_gpu = false;
        break;
      }
      gpu = t->device();
    }
    if (all_gpu) {
      // [region][values][scales], each 256-byte aligned (the kernels' stores stay aligned).
      auto aligned = [](size_t b) { return (b + 255) / 256 * 256; };
      const size_t region_bytes = numel * dtype_size(q.dtype), scale_bytes = q.bytes() - numel;
      const size_t need = aligned(region_bytes) + aligned(numel) + scale_bytes;
      if (need > on_device_bytes) {
        FERRY_ASSIGN_OR_RETURN(on_device, device_alloc(*gpu, need));
        on_device_bytes = need;
      }
      std::byte* region = on_device.get();
      std::byte* values = region + aligned(region_bytes);
      std::byte* scales = values + aligned(numel);
      std::vector<StridedCopy> fills;
      for (const FillOp& f : q.fills) {
        FERRY_ASSIGN_OR_RETURN(const Tensor* held, checked_fill(f));
        const TensorDecl& d = holdings.tensors[holdings.boxes[f.box].tensor];
        FERRY_ASSIGN_OR_RETURN(std::byte * dev, held->device_ptr());
        std::optional<DType> from;
        if (d.dtype != q.dtype) from = d.dtype;
        fills.push_back({dev, f.src, region, f.dst, q.dtype, from});
      }
      Status st = copy_batch(*gpu, fills);
      if (st.ok()) {
        st = fp8_block_quantize(*gpu, region, q.dtype, q.region[0], q.region[1], q.region[2], q.block, values,
                                scales, nullptr, static_cast<Fp8Scales>(q.format));
      }
      if (st.ok()) st = device_memcpy(staging.data() + q.offset, values, numel);
      if (st.ok()) st = device_memcpy(staging.data() + q.offset + numel, scales, scale_bytes);
      if (!st.ok()) {
        return st.with_context(fmt::format("pack: producer {} group {}: quantising a region on {}", producer, group,
                                           device_str(*gpu)));
      }
      continue;
    }
    scratch.assign(numel * dtype_size(q.dtype), std::byte{0});
    for (const FillOp& f : q.fills) {
      FERRY_ASSIGN_OR_RETURN(const Tensor* held, checked_fill(f));
      const Tensor& t = *held;
      const HeldBox& hb = holdings.boxes[f.box];
      const TensorDecl& d = holdings.tensors[hb.tensor];
      const std::byte* src = nullptr;
      if (!t.device().is_host()) {
        // In GPU memory beside boxes elsewhere (a region fed from host and device): quantised
        // on the host from a copy of the box.
        if (!t.is_contiguous()) {
          return invalid_argument("pack: tensor '{}' box {} is a strided view in {} memory; materialize it contiguous",
                                  d.name, hb.box.to_string(), device_str(t.device()));
        }
        auto [at, fresh] = on_host.try_emplace(f.box);
        if (fresh) {
          at->second.resize(static_cast<size_t>(t.numel()) * dtype_size(d.dtype));
          FERRY_ASSIGN_OR_RETURN(std::byte * dev, t.device_ptr());
          Status st = device_memcpy(at->second.data(), dev, at->second.size());
          if (!st.ok()) return st.with_context(fmt::format("pack: copying '{}' from {} to quantise it", d.name, device_str(t.device())));
        }
        src = at->second.data();
      } else {
        FERRY_ASSIGN_OR_RETURN(std::byte * host, t.data_ptr());
        src = host;
      }
      if (!t.device().is_host() || t.is_contiguous()) {
        strided_copy(src, f.src, d.dtype, scratch.data(), f.dst, q.dtype);
      } else {
        gathered.resize(static_cast<size_t>(f.src.numel()) * dtype_size(q.dtype));
        gather_from_view(src, t.strides(), hb.box.size, f.src, d.dtype, q.dtype, gathered.data());
        strided_copy(gathered.data(), Layout::contiguous(f.src.shape), q.dtype, scratch.data(), f.dst, q.dtype);
      }
    }
    std::byte* values = staging.data() + q.offset;
    Status st = fp8_block_quantize(Device::host(), scratch.data(), q.dtype, q.region[0], q.region[1], q.region[2],
                                   q.block, values, values + numel, nullptr, static_cast<Fp8Scales>(q.format));
    if (!st.ok()) return st.with_context(fmt::format("pack: producer {} group {}: quantising a region", producer, group));
  }
  return Status::Ok();
}

namespace {

// An unpack op checked against its plan and a receive buffer of `recv_bytes` (`what`:
// "unpack" or "gather", naming the caller in errors): its param, its destination inside
// that param, its bytes inside the buffer. Its element count.
Result<int64_t> checked_unpack(const char* what, const PlanRoute& plan, const UnpackOp& op, uint64_t recv_bytes) {
  if (op.param >= plan.params.size()) return out_of_range("{}: param {} of {}", what, op.param, plan.params.size());
  const TensorDecl& d = plan.params[op.param];
  int64_t n, lo, hi;
  if (!layout_range(op.dst, n, lo, hi) || (n > 0 && (lo < 0 || hi >= shape_numel(d.shape)))) {
    return out_of_range("{}: layout {} outside param '{}' {}", what, op.dst.to_string(), d.name, shape_str(d.shape));
  }
  if (!bytes_within(op.offset, n, dtype_size(op.src_dtype), recv_bytes)) {
    return out_of_range("{}: param '{}' lies past the receive buffer", what, d.name);
  }
  return n;
}

// The caller's tensor for plan param `d`: present, real, contiguous, of its dtype and shape.
Result<const Tensor*> plan_param(const char* what, const TensorMap& params, const TensorDecl& d) {
  auto it = params.find(d.name);
  if (it == params.end()) return not_found("{}: param '{}' is missing", what, d.name);
  const Tensor& t = it->second;
  if (!t.is_real() || !t.is_contiguous() || t.shape() != d.shape || t.dtype() != d.dtype) {
    return invalid_argument("{}: param '{}' is {}, the plan declares a contiguous {} {}", what, d.name, t.describe(),
                            dtype_name(d.dtype), shape_str(d.shape));
  }
  return &t;
}

}  // namespace

Status unpack_group(const PlanRoute& plan, int group, std::span<const std::byte> recv, const TensorMap& params) {
  if (group < 0 || static_cast<size_t>(group) >= plan.groups.size()) {
    return out_of_range("unpack: group {} of {}", group, plan.groups.size());
  }
  const PlanGroup& cg = plan.groups[static_cast<size_t>(group)];
  if (recv.size() < cg.recv_bytes) {
    return out_of_range("unpack: group {} needs {} received bytes, got {}", group, cg.recv_bytes, recv.size());
  }
  std::vector<std::byte*> base(plan.params.size(), nullptr);
  std::vector<Device> where(plan.params.size());
  std::optional<Device> on_device;  // params in GPU memory: unpacked in one batch there
  std::vector<StridedCopy> device_unpacks;
  for (const UnpackOp& op : cg.unpacks) {
    FERRY_RETURN_IF_ERROR(checked_unpack("unpack", plan, op, recv.size()).status());
    const TensorDecl& d = plan.params[op.param];
    if (!base[op.param]) {
      FERRY_ASSIGN_OR_RETURN(const Tensor* tp, plan_param("unpack", params, d));
      const Tensor& t = *tp;
      if (!t.device().is_host()) {
        if (on_device && t.device() != *on_device) {
          return invalid_argument("unpack: group {}: params on {} and {}; one GPU per rank", group,
                                  device_str(*on_device), device_str(t.device()));
        }
        on_device = t.device();
      }
      where[op.param] = t.device();
      FERRY_ASSIGN_OR_RETURN(base[op.param], t.device_ptr());
    }
    if (!where[op.param].is_host()) {
      // A dtype conversion (float dtypes) runs in the unpack kernel, as strided_copy would.
      std::optional<DType> from;
      if (op.src_dtype != d.dtype) from = op.src_dtype;
      device_unpacks.push_back(
          {recv.data() + op.offset, Layout::contiguous(op.dst.shape), base[op.param], op.dst, d.dtype, from});
      continue;
    }
    strided_copy(recv.data() + op.offset, Layout::contiguous(op.dst.shape), op.src_dtype, base[op.param], op.dst, d.dtype);
  }
  if (!device_unpacks.empty()) {
    Status st = copy_batch(*on_device, device_unpacks);
    if (!st.ok()) return st.with_context(fmt::format("unpack: group {} on {}", group, device_str(*on_device)));
  }
  return Status::Ok();
}

Status gather_group(const PlanRoute& plan, int group, uint64_t lo, uint64_t hi, const TensorMap& params,
                    std::span<std::byte> recv) {
  if (group < 0 || static_cast<size_t>(group) >= plan.groups.size()) {
    return out_of_range("gather: group {} of {}", group, plan.groups.size());
  }
  const PlanGroup& cg = plan.groups[static_cast<size_t>(group)];
  if (lo > hi || hi > cg.recv_bytes || recv.size() < cg.recv_bytes) {
    return out_of_range("gather: bytes [{}, {}) of group {} ({} received bytes, a buffer of {})", lo, hi, group,
                        cg.recv_bytes, recv.size());
  }
  for (const UnpackOp& op : cg.unpacks) {
    FERRY_ASSIGN_OR_RETURN(const int64_t n, checked_unpack("gather", plan, op, recv.size()));
    const TensorDecl& d = plan.params[op.param];
    const uint64_t end = op.offset + static_cast<uint64_t>(n) * dtype_size(op.src_dtype);
    if (end <= lo || op.offset >= hi) continue;  // another producer's bytes
    if (op.offset < lo || end > hi) {
      return invalid_argument("gather: param '{}' bytes [{}, {}) straddle [{}, {})", d.name, op.offset, end, lo, hi);
    }
    FERRY_ASSIGN_OR_RETURN(const Tensor* tp, plan_param("gather", params, d));
    const Tensor& t = *tp;
    if (!t.device().is_host()) return invalid_argument("gather: param '{}' is on {}: host params only", d.name, device_str(t.device()));
    FERRY_ASSIGN_OR_RETURN(std::byte * b, t.device_ptr());
    strided_copy(b, op.dst, d.dtype, recv.data() + op.offset, Layout::contiguous(op.dst.shape), op.src_dtype);
  }
  return Status::Ok();
}

}  // namespace ferry
