// `ferry checkpoint`: writes a synthetic safetensors checkpoint of a model (config.json
// and model.safetensors, random weights from a seed), to try `ferry serve` / `ferry
// fetch` without a real checkpoint, and for the device checks (scripts/device-check.sh).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cli/command.h"
#include "ferry/models.h"
#include "ferry/safetensors.h"
#include "tools/job_model.h"

namespace ferry::cli {
namespace {

struct CheckpointArgs {
  std::string model, overrides, out;
  bool shrink = false;
  uint64_t seed = 1;
};

int run_checkpoint(const CheckpointArgs& a) {
  // Layouts only matter to the loader; the checkpoint is the model's, whole.
  auto m = tools::make_job_model(a.model, "tp=1", "tp=1", a.shrink, a.overrides);
  if (!m.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", m.status().to_string().c_str());
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) {
    std::fprintf(stderr, "ferry checkpoint: creating %s: %s\n", a.out.c_str(), ec.message().c_str());
    return 2;
  }
  auto ckpt = random_checkpoint(m->metadata, a.seed);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", ckpt.status().to_string().c_str());
    return 2;
  }
  std::vector<SafetensorsEntry> entries;
  for (const TensorDecl& d : m->metadata) entries.push_back({d.name, ckpt->at(d.name)});
  const std::string file = a.out + "/model.safetensors";
  if (Status st = write_safetensors(file, entries); !st.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", st.to_string().c_str());
    return 2;
  }
  std::ofstream(a.out + "/config.json") << m->config.dump() << "\n";
  std::printf("ferry checkpoint: %s: %zu tensors, %llu bytes (seed %llu), config.json beside it\n", file.c_str(),
              entries.size(), static_cast<unsigned long long>(m->checkpoint_bytes),
              static_cast<unsigned long long>(a.seed));
  return 0;
}

std::function<int()> setup_checkpoint(CLI::App& app) {
  auto a = std::make_shared<CheckpointArgs>();
  app.add_option("--model", a->model, "HF config.json of the model")->required();
  app.add_option("--out", a->out, "Directory to write config.json and model.safetensors into")->required();
  app.add_flag("--shrink", a->shrink, "A structurally equal small variant of the model (as ferry demo and plan --shrink)");
  app.add_option("--config-overrides", a->overrides, "JSON merged into the config, e.g. '{\"num_hidden_layers\": 2}'");
  app.add_option("--seed", a->seed, "Seed of the random weights")->default_val(1);
  return [a] { return run_checkpoint(*a); };
}

FERRY_COMMAND(checkpoint_cmd, "checkpoint",
              "Write a synthetic safetensors checkpoint of a model (random weights from a seed) with its config.json",
              setup_checkpoint);

}  // namespace
}  // namespace ferry::cli
