// `ferry devices`: where this ferry can put weights: the host, and CUDA devices when the
// CUDA plugin loads and the driver reports some (ferry/device.h's cuda_status()).
#include <cstdio>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "ferry/device.h"

namespace ferry::cli {
namespace {

int run_devices(bool json) {
  const CudaStatus& cs = cuda_status();
  if (json) {
    nlohmann::json j;
    j["host"] = true;
    j["cuda_plugin"] = cs.plugin_loaded ? nlohmann::json(cs.plugin_path) : nlohmann::json(nullptr);
    j["cuda_devices"] = cs.device_count;
    j["cuda_usable"] = cs.usable();
    j["detail"] = cs.detail;
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("host: yes\n");
  std::printf("cuda plugin: %s\n", cs.plugin_loaded ? cs.plugin_path.c_str() : "none");
  std::printf("cuda devices: %d\n%s\n", cs.device_count, cs.detail.c_str());
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
