// `ferry devices`: where this ferry can put weights: the host, and CUDA devices when the
// CUDA plugin loads and the driver reports some (ferry/device.h's cuda_status()); and
// which memory each transport backend moves itself (Transport::supports_memory): where
// ucx moves CUDA memory, GPU params can be read into directly, otherwise GPU memory is
// staged through host memory.
#include <cstdio>
#include <memory>

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

int run_devices(bool json) {
  const CudaStatus& cs = cuda_status();
  const auto moves = transport_memory();
  if (json) {
    nlohmann::json j;
    j["host"] = true;
    j["cuda_plugin"] = cs.plugin_loaded ? nlohmann::json(cs.plugin_path) : nlohmann::json(nullptr);
    j["cuda_devices"] = cs.device_count;
    j["cuda_usable"] = cs.usable();
    j["detail"] = cs.detail;
    for (const auto& [b, m] : moves) j["transports"][b] = {{"cuda_memory", m.first}, {"detail", m.second}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("host: yes\n");
  std::printf("cuda plugin: %s\n", cs.plugin_loaded ? cs.plugin_path.c_str() : "none");
  std::printf("cuda devices: %d\n%s\n", cs.device_count, cs.detail.c_str());
  for (const auto& [b, m] : moves) std::printf("transport %s moves: %s\n", b.c_str(), m.second.c_str());
  return 0;
}

std::function<int()> setup_devices(CLI::App& app) {
  auto json = std::make_shared<bool>(false);
  app.add_flag("--json", *json, "One JSON object instead of text");
  return [json] { return run_devices(*json); };
}

FERRY_COMMAND(devices_cmd, "devices",
              "Show the memory ferry can use: the host, and CUDA devices (the CUDA plugin and what the driver says)",
              setup_devices);

}  // namespace
}  // namespace ferry::cli
