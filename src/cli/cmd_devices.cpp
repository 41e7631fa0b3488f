// `ferry devices`: where this ferry can put weights: the host, and CUDA devices when the
// CUDA plugin loads and the driver reports some (ferry/device.h's cuda_status()); and
// which memory each transport backend moves itself (Transport::supports_memory): where
// ucx moves CUDA memory, GPU params can be read into directly, otherwise GPU memory is
// staged through host memory.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "ferry/device.h"
#include "ferry/transport.h"

namespace ferry::cli {
namespace {

// What each backend moves, from a transport made for the question (nothing connects).
std::vector<std::pair<std::string, std::pair<bool, std::string>>> transport_memory() {
  std::vector<std::pair<std::string, std::pair<bool, std::string>>> out;
  for (const std::string& b : Transport::backends()) {
    TransportOptions o;
    o.backend = b;
    auto t = Transport::create(o);
    if (!t.ok()) {
      out.push_back({b, {false, "could not start: " + t.status().to_string()}});
      continue;
    }
    out.push_back({b, {(*t)->supports_memory(MemoryKind::kCuda), (*t)->memory_support()}});
  }
  return out;
}

// Copy rates on each CUDA device, median of 5 copies of `bytes`: device to device, and
// between the device and pinned host memory both ways (what the staged path crosses).
// Empty when no device can be used.
struct Rates {
  double d2d = 0, h2d = 0, d2h = 0;  // GB/s
};
Result<Rates> copy_rates(Device d, size_t bytes) {
  FERRY_ASSIGN_OR_RETURN(auto a, device_alloc(d, bytes));
  FERRY_ASSIGN_OR_RETURN(auto b, device_alloc(d, bytes));
  std::vector<std::byte> host(bytes, std::byte{0x5a});
  FERRY_RETURN_IF_ERROR(register_host_for_cuda(d, host.data(), bytes));
  auto rate = [&](void* dst, const void* src) -> Result<double> {
    std::vector<double> s;
    for (int i = 0; i < 6; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      FERRY_RETURN_IF_ERROR(device_memcpy(dst, src, bytes));
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) s.push_back(dt);  // the first warms up
    }
    std::sort(s.begin(), s.end());
    return static_cast<double>(bytes) / s[s.size() / 2] / 1e9;
  };
  Rates r;
  auto d2d = rate(b.get(), a.get());
  auto h2d = d2d.ok() ? rate(a.get(), host.data()) : d2d;
  auto d2h = h2d.ok() ? rate(host.data(), a.get()) : h2d;
  unregister_host_for_cuda(host.data());
  if (!d2h.ok()) return d2h.status();
  r.d2d = *d2d;
  r.h2d = *h2d;
  r.d2h = *d2h;
  return r;
}

int run_devices(bool json, uint64_t bandwidth_bytes) {
  const CudaStatus& cs = cuda_status();
  const auto moves = transport_memory();
  std::vector<std::pair<int, Result<Rates>>> rates;
  if (bandwidth_bytes > 0 && cs.usable()) {
    for (int i = 0; i < cs.device_count; ++i) rates.emplace_back(i, copy_rates(Device::cuda(i), bandwidth_bytes));
  }
  if (json) {
    nlohmann::json j;
    j["host"] = true;
    j["cuda_plugin"] = cs.plugin_loaded ? nlohmann::json(cs.plugin_path) : nlohmann::json(nullptr);
    j["cuda_devices"] = cs.device_count;
    j["cuda_usable"] = cs.usable();
    j["detail"] = cs.detail;
    for (const auto& [b, m] : moves) j["transports"][b] = {{"cuda_memory", m.first}, {"detail", m.second}};
    for (const auto& [i, r] : rates) {
      nlohmann::json e = {{"device", i}, {"bytes", bandwidth_bytes}};
      if (r.ok()) {
        e["d2d_gbps"] = r->d2d;
        e["h2d_gbps"] = r->h2d;
        e["d2h_gbps"] = r->d2h;
      } else {
        e["error"] = r.status().to_string();
      }
      j["copy_rates"].push_back(e);
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("host: yes\n");
  std::printf("cuda plugin: %s\n", cs.plugin_loaded ? cs.plugin_path.c_str() : "none");
  std::printf("cuda devices: %d\n%s\n", cs.device_count, cs.detail.c_str());
  for (const auto& [b, m] : moves) std::printf("transport %s moves: %s\n", b.c_str(), m.second.c_str());
  if (bandwidth_bytes > 0 && !cs.usable()) std::printf("copy rates: no usable CUDA device, nothing measured\n");
  for (const auto& [i, r] : rates) {
    if (r.ok()) {
      std::printf("cuda:%d copy rates (%llu bytes, median of 5): device to device %.1f GB/s, pinned host to device "
                  "%.1f GB/s, device to pinned host %.1f GB/s\n",
                  i, static_cast<unsigned long long>(bandwidth_bytes), r->d2d, r->h2d, r->d2h);
    } else {
      std::printf("cuda:%d copy rates: %s\n", i, r.status().to_string().c_str());
    }
  }
  return 0;
}

std::function<int()> setup_devices(CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  auto bandwidth = std::make_shared<uint64_t>(0);
  app.add_flag("--json", *json, "One JSON object instead of text");
  app.add_option("--bandwidth", *bandwidth,
                 "Also measure each CUDA device's copy rates with copies of this many bytes (device to device, pinned "
                 "host to device and back; median of 5)")
      ->check(number_in(0, 1ull << 40));
  return [json, bandwidth] { return run_devices(*json, *bandwidth); };
}

FERRY_COMMAND(devices_cmd, "devices",
              "Show the memory ferry can use: the host, and CUDA devices (the CUDA plugin and what the driver says)",
              setup_devices);

}  // namespace
}  // namespace ferry::cli
