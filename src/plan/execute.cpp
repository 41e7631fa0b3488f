// The plan executor: strided copies from real sources into real params.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>

#include "ferry/device.h"
#include "ferry/plan.h"

namespace ferry {

namespace {

struct Bound {
  std::byte* base = nullptr;  // element 0 of the tensor's flat storage
  DType dtype = DType::kF32;
  Device device;
  const std::string* name = nullptr;
};

Result<Bound> bind_tensor(const TensorMap& map, const TensorDecl& decl, std::string_view kind) {
  auto it = map.find(decl.name);
  if (it == map.end()) return not_found("execute: {} '{}' {} {} is missing", kind, decl.name, shape_str(decl.shape), dtype_name(decl.dtype));
  const Tensor& t = it->second;
  if (!t.ok()) return t.status().with_context(fmt::format("execute: {} '{}'", kind, decl.name));
  if (!t.is_real()) return invalid_argument("execute: {} '{}' must be a real tensor, got {}", kind, decl.name, t.describe());
  if (t.dtype() != decl.dtype) {
    return invalid_argument("execute: {} '{}' has dtype {} but the plan expects {}", kind, decl.name, dtype_name(t.dtype()),
                            dtype_name(decl.dtype));
  }
  if (t.shape() != decl.shape) {
    return invalid_argument("execute: {} '{}' has shape {} but the plan expects {}", kind, decl.name, shape_str(t.shape()),
                            shape_str(decl.shape));
  }
  if (!t.is_contiguous()) return invalid_argument("execute: {} '{}' must be contiguous", kind, decl.name);
  FERRY_ASSIGN_OR_RETURN(std::byte* p, t.device_ptr());
  return Bound{p, t.dtype(), t.device(), &decl.name};
}

// A unit of work: a copy (or zero), possibly restricted to a range of its outer dim.
struct Unit {
  int32_t copy = -1;  // index into copies; -1 for a zero
  int32_t zero = -1;
  int64_t begin = 0;  // outer-dim range [begin, end); whole when end == -1
  int64_t end = -1;
};

Layout restrict_outer(const Layout& l, int64_t begin, int64_t end) {
  if (end < 0 || l.ndim() == 0) return l;
  Layout r = l;
  r.offset += begin * l.strides[0];
  r.shape[0] = end - begin;
  return r;
}

// A plan over tensors in one CUDA device's memory: every copy and zero in one batch.
Status execute_on_device(const Plan& plan, const std::vector<Bound>& src, const std::vector<Bound>& dst, Device device,
                         DeviceStream stream) {
  std::vector<StridedCopy> batch;
  batch.reserve(plan.copies().size() + plan.zeros().size());
  for (const Copy& c : plan.copies()) {
    // A dtype conversion (between float dtypes, as on the host) runs in the same kernel.
    std::optional<DType> from;
    if (src[c.source].dtype != dst[c.param].dtype) from = src[c.source].dtype;
    batch.push_back({src[c.source].base, c.src, dst[c.param].base, c.dst, dst[c.param].dtype, from});
  }
  for (const Zero& z : plan.zeros()) batch.push_back({nullptr, {}, dst[z.param].base, z.dst, dst[z.param].dtype});
  return copy_batch(device, batch, stream);
}

}  // namespace

Status execute(const Plan& plan, const TensorMap& sources, const TensorMap& params, const ExecuteOptions& options) {
  std::vector<Bound> src(plan.sources().size());
  std::vector<Bound> dst(plan.params().size());
  std::vector<bool> src_used(src.size(), false), dst_used(dst.size(), false);
  for (const Copy& c : plan.copies()) {
    src_used[c.source] = true;
    dst_used[c.param] = true;
  }
  for (const Zero& z : plan.zeros()) dst_used[z.param] = true;
  for (size_t i = 0; i < src.size(); ++i) {
    if (!src_used[i]) continue;
    FERRY_ASSIGN_OR_RETURN(src[i], bind_tensor(sources, plan.sources()[i], "source"));
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    if (!dst_used[i]) continue;
    FERRY_ASSIGN_OR_RETURN(dst[i], bind_tensor(params, plan.params()[i], "param"));
  }

  // Host memory everywhere, or one CUDA device everywhere.
  std::optional<Device> device;
  for (const auto* side : {&src, &dst}) {
    for (size_t i = 0; i < side->size(); ++i) {
      const Bound& b = (*side)[i];
      if (b.name == nullptr) continue;  // not used by the plan
      if (!device) device = b.device;
      if (b.device != *device) {
        return invalid_argument("execute: '{}' is on {} but other tensors of the plan are on {}; a plan runs on one device",
                                *b.name, device_str(b.device), device_str(*device));
      }
    }
  }
  if (device && !device->is_host()) return execute_on_device(plan, src, dst, *device, options.stream);

  const auto stats = plan.stats();
  int threads = options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (stats.bytes < options.parallel_min_bytes) threads = 1;

  auto run_copy = [&](const Copy& c, int64_t b, int64_t e) {
    strided_copy(src[c.source].base, restrict_outer(c.src, b, e), src[c.source].dtype, dst[c.param].base,
                 restrict_outer(c.dst, b, e), dst[c.param].dtype);
  };
  if (threads == 1) {
    for (const Copy& c : plan.copies()) run_copy(c, 0, -1);
    for (const Zero& z : plan.zeros()) strided_zero(dst[z.param].base, z.dst, dst[z.param].dtype);
    return Status::Ok();
  }

  // Cut large copies along their outer dim so that units are about total/(4*threads).
  const uint64_t target = std::max<uint64_t>(stats.bytes / (4 * static_cast<uint64_t>(threads)), 1 << 20);
  std::vector<Unit> units;
  for (size_t i = 0; i < plan.copies().size(); ++i) {
    const Copy& c = plan.copies()[i];
    const uint64_t bytes = static_cast<uint64_t>(c.src.numel()) * dtype_size(src[c.source].dtype);
    if (bytes <= target || c.src.ndim() == 0 || c.src.shape[0] < 2) {
      units.push_back({static_cast<int32_t>(i), -1, 0, -1});
      continue;
    }
    const int64_t outer = c.src.shape[0];
    const int64_t pieces = std::min<int64_t>(outer, static_cast<int64_t>((bytes + target - 1) / target));
    for (int64_t p = 0; p < pieces; ++p) {
      units.push_back({static_cast<int32_t>(i), -1, outer * p / pieces, outer * (p + 1) / pieces});
    }
  }
  for (size_t i = 0; i < plan.zeros().size(); ++i) units.push_back({-1, static_cast<int32_t>(i), 0, -1});

  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t u = next.fetch_add(1); u < units.size(); u = next.fetch_add(1)) {
      const Unit& unit = units[u];
      if (unit.copy >= 0) {
        run_copy(plan.copies()[unit.copy], unit.begin, unit.end);
      } else {
        const Zero& z = plan.zeros()[unit.zero];
        strided_zero(dst[z.param].base, z.dst, dst[z.param].dtype);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  return Status::Ok();
}

}  // namespace ferry
