// The architecture registry and make_model_loader.
#include <algorithm>

#include "models/archs.h"

namespace ferry::models {

const std::vector<ArchEntry>& architectures() {
  static const std::vector<ArchEntry> all = [] {
    std::vector<ArchEntry> v = {
        llama_arch(),
        phi3_arch(),
        qwen2_arch(),
        qwen3_arch(),
        qwen3_moe_arch(),
        mixtral_arch(),
        deepseek_v3_arch(),
        llama4_arch(),
    };
    std::sort(v.begin(), v.end(), [](const ArchEntry& a, const ArchEntry& b) { return a.name < b.name; });
    return v;
  }();
  return all;
}

const ArchEntry* find_architecture(const std::string& name) {
  for (const auto& a : architectures()) {
    if (a.name == name) return &a;
  }
  return nullptr;
}

}  // namespace ferry::models

namespace ferry {

std::vector<std::string> supported_architectures() {
  std::vector<std::string> out;
  for (const auto& a : models::architectures()) out.push_back(a.name);
  return out;
}

namespace {
Status unknown_architecture(const ModelConfig& config) {
  return invalid_argument("{}: unknown architecture '{}' (supported: {})", config.path(), config.architecture(),
                          fmt::format("{}", fmt::join(supported_architectures(), ", ")));
}
}  // namespace

Result<std::unique_ptr<ModelLoader>> make_model_loader(const ModelConfig& config, const InferenceLayout& layout,
                                                       const LoaderOptions& options) {
  const models::ArchEntry* a = models::find_architecture(config.architecture());
  if (a == nullptr) return unknown_architecture(config);
  return a->make(config, layout, options);
}

Result<ShrinkResult> shrink_config(const ModelConfig& config, const InferenceLayout& layout,
                                   const LoaderOptions& options) {
  const models::ArchEntry* a = models::find_architecture(config.architecture());
  if (a == nullptr) return unknown_architecture(config);
  // The original must take the layout (so the small one proves something about it).
  FERRY_RETURN_IF_ERROR(a->make(config, layout, options).status());
  nlohmann::json j = config.json();
  std::vector<ShrinkChange> changes;
  models::ShrinkContext ctx{config, layout, options, &changes};
  if (a->shrink) {
    FERRY_RETURN_IF_ERROR(a->shrink(j, ctx));
  } else {
    FERRY_RETURN_IF_ERROR(models::shrink_dense_fields(j, "", ctx));
  }
  FERRY_ASSIGN_OR_RETURN(ModelConfig small, ModelConfig::from_json(j, config.path() + " (shrunk)"));
  FERRY_RETURN_IF_ERROR(a->make(small, layout, options).status().with_context("shrunk config"));
  return ShrinkResult{std::move(small), std::move(changes)};
}

}  // namespace ferry
