// Devices, the CUDA plugin loader and copy_batch's dispatch (host: strided_copy; CUDA:
// the plugin's kernel over batch descriptors).
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "ferry/device.h"
#include "tensor/batch_layout.h"
#include "tensor/device_plugin.h"
#include "tensor/fp8_blocks.h"
#include "tensor/fp8_host.h"

namespace ferry {

std::string device_str(Device device) {
  if (device.is_host()) return "cpu";
  return fmt::format("cuda:{}", device.index);
}

Result<Device> parse_device(std::string_view text) {
  if (text == "cpu") return Device::host();
  if (text == "cuda") return Device::cuda(0);
  if (text.starts_with("cuda:")) {
    const std::string_view n = text.substr(5);
    int index = 0;
    if (n.empty() || n.size() > 6) return invalid_argument("device '{}': expected cpu, cuda or cuda:N", text);
    for (char ch : n) {
      if (ch < '0' || ch > '9') return invalid_argument("device '{}': expected cpu, cuda or cuda:N", text);
      index = index * 10 + (ch - '0');
    }
    return Device::cuda(index);
  }
  return invalid_argument("device '{}': expected cpu, cuda or cuda:N", text);
}

namespace {

struct LoadedPlugin {
  const FerryCudaPlugin* api = nullptr;
  std::string path;
  std::string error;  // why none was loaded: each place looked, and what failed there
};

// Where to look, in order (see ferry/device.h).
std::vector<std::string> plugin_candidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("FERRY_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
    out.emplace_back(env);
    return out;  // an explicit choice is the only one
  }
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&plugin_candidates), &info) != 0 && info.dli_fname != nullptr) {
    // The library (shared build) or the executable (static build) this code is in.
    std::error_code ec;
    const auto self = std::filesystem::canonical(info.dli_fname, ec);
    if (!ec) {
      out.push_back((self.parent_path() / "ferry" / "libferry_cuda.so").string());
      out.push_back((self.parent_path().parent_path() / "lib" / "ferry" / "libferry_cuda.so").string());
    }
  }
#ifdef FERRY_CUDA_PLUGIN_INSTALL_PATH
  out.emplace_back(FERRY_CUDA_PLUGIN_INSTALL_PATH);
#endif
#ifdef FERRY_CUDA_PLUGIN_BUILD_PATH
  out.emplace_back(FERRY_CUDA_PLUGIN_BUILD_PATH);
#endif
  return out;
}

const LoadedPlugin& plugin() {
  static const LoadedPlugin loaded = [] {
    LoadedPlugin p;
    std::vector<std::string> tried;
    for (const std::string& path : plugin_candidates()) {
      std::error_code ec;
      if (!std::filesystem::exists(path, ec)) {
        tried.push_back(path + " (absent)");
        continue;
      }
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        const char* why = dlerror();
        tried.push_back(fmt::format("{} ({})", path, why ? why : "dlopen failed"));
        continue;
      }
      auto entry = reinterpret_cast<FerryCudaPluginEntry>(dlsym(handle, FERRY_CUDA_PLUGIN_SYMBOL));
      const FerryCudaPlugin* api = entry ? entry() : nullptr;
      if (api == nullptr || api->abi != FERRY_CUDA_PLUGIN_ABI || api->desc_size != sizeof(batch::CopyDesc)) {
        tried.push_back(fmt::format("{} (not a ferry CUDA plugin of ABI {})", path, FERRY_CUDA_PLUGIN_ABI));
        dlclose(handle);
        continue;
      }
      p.api = api;  // never unloaded: the CUDA runtime inside it lives until exit
      p.path = path;
      return p;
    }
    std::string list;
    for (const std::string& t : tried) list += (list.empty() ? "" : "; ") + t;
#ifdef FERRY_CUDA_PLUGIN_BUILD_PATH
    p.error = "the CUDA plugin libferry_cuda.so could not be loaded: looked at " + list;
#else
    p.error = "this ferry was built without CUDA (FERRY_CUDA=OFF, or no nvcc at configure time) and no CUDA plugin "
              "was found: looked at " + list;
#endif
    return p;
  }();
  return loaded;
}

}  // namespace

const CudaStatus& cuda_status() {
  static const CudaStatus status = [] {
    CudaStatus s;
    const LoadedPlugin& p = plugin();
    if (p.api == nullptr) {
      s.detail = p.error;
      return s;
    }
    s.plugin_loaded = true;
    s.plugin_path = p.path;
    char err[512] = {};
    const int n = p.api->device_count(err, sizeof(err));
    if (n < 0) {
      s.detail = fmt::format("no usable CUDA device: {}", err);
      return s;
    }
    s.device_count = n;
    if (n == 0) {
      s.detail = "the CUDA driver reports no device";
      return s;
    }
    for (int i = 0; i < n; ++i) {
      char name[256] = {};
      p.api->device_name(i, name, sizeof(name));
      s.detail += fmt::format("{}cuda:{} {}", i ? "; " : "", i, name);
    }
    return s;
  }();
  return status;
}

namespace {
Status usable_cuda(Device device, std::string_view op) {
  const CudaStatus& cs = cuda_status();
  if (!cs.usable()) return unavailable("{} on {}: {}", op, device_str(device), cs.detail);
  if (device.index < 0 || device.index >= cs.device_count) {
    return invalid_argument("{}: {} does not exist ({} CUDA device(s))", op, device_str(device), cs.device_count);
  }
  return Status::Ok();
}
}  // namespace

std::optional<std::string> cuda_unusable(Device device) {
  const CudaStatus& cs = cuda_status();
  if (!cs.usable()) return cs.detail;
  if (device.index < 0 || device.index >= cs.device_count) return fmt::format("the driver reports {} device(s)", cs.device_count);
  return std::nullopt;
}

Result<std::shared_ptr<std::byte>> device_alloc(Device device, size_t bytes) {
  if (device.is_host()) return std::shared_ptr<std::byte>(new std::byte[std::max<size_t>(bytes, 1)](), std::default_delete<std::byte[]>());
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "device_alloc"));
  void* p = nullptr;
  char err[512] = {};
  if (plugin().api->alloc(device.index, bytes, &p, err, sizeof(err)) != 0) {
    return unavailable("device_alloc of {} bytes on {}: {}", bytes, device_str(device), err);
  }
  const FerryCudaPlugin* api = plugin().api;
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [api](std::byte* q) { api->release(q); });
}

Status device_memcpy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  const LoadedPlugin& p = plugin();
  if (!cuda_status().usable()) {  // no CUDA device here: all memory is host memory
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  char err[512] = {};
  if (p.api->copy_bytes(dst, src, bytes, err, sizeof(err)) != 0) return unavailable("device_memcpy of {} bytes: {}", bytes, err);
  return Status::Ok();
}

Status register_host_for_cuda(Device device, void* ptr, size_t bytes) {
  if (!device.is_cuda()) return invalid_argument("register_host_for_cuda: {} is not a CUDA device", device_str(device));
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "register_host_for_cuda"));
  char err[512] = {};
  if (plugin().api->host_register(device.index, ptr, bytes, err, sizeof(err)) != 0) {
    return unavailable("making {} bytes of host memory visible to {}: {}", bytes, device_str(device), err);
  }
  return Status::Ok();
}

void unregister_host_for_cuda(void* ptr) {
  if (plugin().api != nullptr) plugin().api->host_release(ptr);
}

Status copy_batch(Device device, std::span<const StridedCopy> copies, DeviceStream stream) {
  if (device.is_host()) {
    for (size_t i = 0; i < copies.size(); ++i) {
      const StridedCopy& c = copies[i];
      if (c.src == nullptr) {
        strided_zero(c.dst, c.dst_layout, c.dtype);
        continue;
      }
      if (c.src_layout.shape != c.dst_layout.shape) {
        return invalid_argument("copy_batch: copy {} moves {} into {}: shapes differ", i, shape_str(c.src_layout.shape),
                                shape_str(c.dst_layout.shape));
      }
      strided_copy(c.src, c.src_layout, c.src_dtype.value_or(c.dtype), c.dst, c.dst_layout, c.dtype);
    }
    return Status::Ok();
  }
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "copy_batch"));
  FERRY_ASSIGN_OR_RETURN(batch::BatchPlan plan, batch::plan_batch(copies));
  if (plan.tasks.empty()) return Status::Ok();
  char err[512] = {};
  if (plugin().api->run_batch(device.index, plan.descs.data(), plan.descs.size(), plan.tasks.data(), plan.tasks.size(),
                              stream, err, sizeof(err)) != 0) {
    return unavailable("copy_batch on {} ({} copies, {} bytes): {}", device_str(device), copies.size(), plan.bytes,
                          err);
  }
  return Status::Ok();
}

Status fp8_block_quantize(Device device, const std::byte* src, DType src_dtype, int64_t batch, int64_t rows,
                          int64_t cols, int64_t block, std::byte* q, std::byte* scales, DeviceStream stream,
                          Fp8Scales format) {
  const auto fmt_code = static_cast<uint8_t>(format);
  if (fmt_code > batch::kScaleMx) return invalid_argument("fp8_block_quantize: unknown scale format {}", fmt_code);
  const uint8_t type = batch::element_type(src_dtype);
  if (type == batch::kNoConversion) {
    return invalid_argument("fp8_block_quantize: {} is not a float dtype", dtype_name(src_dtype));
  }
  if (block <= 0) return invalid_argument("fp8_block_quantize: block {} must be positive", block);
  if (batch < 0 || rows < 0 || cols < 0) {
    return invalid_argument("fp8_block_quantize: negative size ({} x {} x {})", batch, rows, cols);
  }
  if (batch == 0 || rows == 0 || cols == 0) return Status::Ok();
  if (device.is_host()) {
    detail::fp8_quantize_host(reinterpret_cast<const unsigned char*>(src), type, batch, rows, cols, block, fmt_code,
                              reinterpret_cast<unsigned char*>(q), reinterpret_cast<unsigned char*>(scales));
    return Status::Ok();
  }
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "fp8_block_quantize"));
  char err[512] = {};
  if (plugin().api->fp8_blocks(device.index, src, type, batch, rows, cols, block, fmt_code, q, scales, stream, err,
                               sizeof(err)) != 0) {
    return unavailable("fp8_block_quantize on {} ({} x {} x {}, block {}): {}", device_str(device), batch, rows, cols,
                       block, err);
  }
  return Status::Ok();
}

Result<std::string> cuda_ipc_export(Device device, void* ptr) {
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "cuda_ipc_export"));
  std::string handle(kCudaIpcHandleBytes, '\0');
  char err[512] = {};
  if (plugin().api->ipc_export(ptr, handle.data(), err, sizeof(err)) != 0) {
    return unavailable("cuda_ipc_export of {} memory at {}: {}", device_str(device), ptr, err);
  }
  return handle;
}

Result<std::shared_ptr<std::byte>> cuda_ipc_open(Device device, std::string_view handle) {
  FERRY_RETURN_IF_ERROR(usable_cuda(device, "cuda_ipc_open"));
  if (handle.size() != kCudaIpcHandleBytes) {
    return invalid_argument("cuda_ipc_open: a handle has {} bytes, not {}", handle.size(), kCudaIpcHandleBytes);
  }
  void* p = nullptr;
  char err[512] = {};
  if (plugin().api->ipc_open(device.index, handle.data(), &p, err, sizeof(err)) != 0) {
    return unavailable("cuda_ipc_open on {}: {}", device_str(device), err);
  }
  const FerryCudaPlugin* api = plugin().api;
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [api](std::byte* q) { api->ipc_close(q); });
}

}  // namespace ferry
