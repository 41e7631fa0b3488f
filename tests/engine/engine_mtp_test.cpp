// A DeepSeek-V3 checkpoint with its MTP layer through the engine (issue 47): with
// LoaderOptions::mtp skip the inference ranks receive the main model only, with draft
// the MTP layer as well (vLLM's DeepSeekMTP params), from a Megatron-style trainer
// (tp=2, pp=2, ep=2; the checkpoint in bf16) that holds it; every rank verified bit for bit
// over two versions.
#include <gtest/gtest.h>

#include "engine/engine_test_util.h"

namespace ferry::engine_tests {
namespace {

TEST(EngineMtp, TheMtpLayerIsSkippedOrSyncedAsTheDraft) {
  for (const MtpLayers mtp : {MtpLayers::kSkip, MtpLayers::kDraft}) {
    SCOPED_TRACE(std::string(mtp_layers_name(mtp)));
    Cluster k;
    k.loader_options.mtp = mtp;
    const Status started =
        k.start(cfg("deepseek-v3.json"), "tp=2,pp=2,ep=2", "tp=2,ep=2", R"({"quantization_config": null})");
    ASSERT_TRUE(started.ok()) << started.to_string();
    for (uint64_t v : {1, 2}) {
      k.expect_all_ok(k.sync(v), v);
      for (int c = 0; c < k.C(); ++c) k.expect_verified(c, v);
    }
    bool has_draft = false;
    for (const auto& [name, t] : k.cons[0]->params()) has_draft |= name.find(".mtp_block.") != std::string::npos;
    EXPECT_EQ(has_draft, mtp == MtpLayers::kDraft);
    // The trainer holds the MTP layer either way (its tensors are in the metadata).
    bool held = false;
    for (const TensorDecl& d : k.model.metadata) held |= d.name.find(".eh_proj.") != std::string::npos;
    EXPECT_TRUE(held);
  }
}

}  // namespace
}  // namespace ferry::engine_tests
