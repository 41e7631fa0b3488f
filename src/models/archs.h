// src/models/archs.h — the architecture registry. Each architecture lives in its own
// arch_*.cpp and exposes one `ArchEntry NAME_arch()`; registry.cpp lists them (explicit
// calls, so a static library can't drop an architecture the way it drops unreferenced
// static registrars). Adding an architecture: write arch_x.cpp, declare x_arch() here,
// add it to registry.cpp and to src/models/CMakeLists.txt.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/shrink.h"

namespace ferry::models {

using MakeLoaderFn = std::function<Result<std::unique_ptr<ModelLoader>>(const ModelConfig&, const InferenceLayout&,
                                                                        const LoaderOptions&)>;

struct ArchEntry {
  std::string name;   // config.json architectures[0]
  MakeLoaderFn make;  // validates the layout and makes the loader
  ShrinkFn shrink;    // rewrites the config JSON small; null: shrink_dense_fields(root, "")
};

// Every registered architecture, sorted by name.
const std::vector<ArchEntry>& architectures();
const ArchEntry* find_architecture(const std::string& name);

ArchEntry llama_arch();
ArchEntry qwen2_arch();
ArchEntry qwen3_arch();
ArchEntry phi3_arch();
// MoE / MLA (moe.h)
ArchEntry qwen3_moe_arch();
ArchEntry mixtral_arch();
ArchEntry deepseek_v3_arch();
ArchEntry llama4_arch();

}  // namespace ferry::models
