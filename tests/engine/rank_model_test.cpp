// What a consumer rank loads into (engine/rank_model.h), with no transport or store: a
// built-in loader's recorded plan and post-processing groups, and a caller's plan
// adopted only when it reads the trainer's tensors as the trainer holds them.
#include <gtest/gtest.h>

#include "engine/rank_model.h"
#include "tools/job_model.h"
#include "test_paths.h"

namespace ferry::engine {
namespace {

std::string cfg(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/configs/" + name; }

TEST(RankModel, RecordedFromALoaderItsParamsGroupsAndPlan) {
  auto m = tools::make_job_model(cfg("qwen3-235b-a22b-fp8.json"), "tp=1", "tp=2", true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  auto rl = m->loader->rank(1);
  ASSERT_TRUE(rl.ok());
  auto rm = record_rank_model(*m->loader, *rl, 1, m->metadata);
  ASSERT_TRUE(rm.ok()) << rm.status().to_string();
  ASSERT_EQ(rm->param_decls.size(), (*rl)->params().size());
  for (size_t i = 0; i < rm->param_decls.size(); ++i) {
    const ParamInfo& p = (*rl)->params()[i];
    EXPECT_EQ(rm->param_decls[i].name, p.decl.name);
    EXPECT_EQ(rm->post_group_of.at(p.decl.name), p.group);
  }
  ASSERT_EQ(rm->post_group_names.size(), (*rl)->groups().size());
  EXPECT_TRUE(rm->post_process) << "the FP8 loader post-processes";
  auto direct = record_plan(*m->loader, 1, m->metadata);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(rm->plan.hash(), direct->hash()) << "the plan is the loader's own";
}

TEST(RankModel, AdoptedPlanMustReadTheTrainersTensorsAsHeld) {
  auto m = tools::make_job_model(cfg("llama-3.1-8b.json"), "tp=1", "tp=1", true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  auto plan = record_plan(*m->loader, 0, m->metadata);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  {
    ConsumerModel cm;
    cm.plan = *plan;
    int calls = 0;
    cm.post_process = [&calls](const ConsumerModel::PostGroup&, TensorMap&) {
      ++calls;
      return Status::Ok();
    };
    auto rm = adopt_rank_model(std::move(cm), 0, m->metadata);
    ASSERT_TRUE(rm.ok()) << rm.status().to_string();
    EXPECT_EQ(rm->param_decls, plan->params());
    // Post-processing groups are the layer groups of the param names: pre, 2 layers, post.
    EXPECT_EQ(rm->post_group_names.size(), 4u);
    for (const TensorDecl& d : rm->param_decls) EXPECT_TRUE(rm->post_group_of.count(d.name)) << d.name;
    TensorMap none;
    ASSERT_TRUE(rm->post_process(0, none).ok());
    EXPECT_EQ(calls, 1);
  }
  // A trainer holding a float tensor in another float dtype (fp32 masters): the plan
  // reads it as held, its copies convert.
  {
    std::vector<TensorDecl> masters = m->metadata;
    masters[0].dtype = masters[0].dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
    ConsumerModel cm;
    cm.plan = *plan;
    auto rm = adopt_rank_model(std::move(cm), 0, masters);
    ASSERT_TRUE(rm.ok()) << rm.status().to_string();
    EXPECT_EQ(rm->plan.sources()[*rm->plan.find_source(masters[0].name)].dtype, masters[0].dtype);
    EXPECT_TRUE(rm->plan.validate().ok());
  }
  // The trainer's metadata with one tensor in a dtype nothing converts to, and with one
  // tensor missing.
  std::vector<TensorDecl> other_dtype = m->metadata;
  other_dtype[0].dtype = DType::kI32;
  std::vector<TensorDecl> missing(m->metadata.begin() + 1, m->metadata.end());
  for (const auto& [meta, what] : {std::pair{other_dtype, "as "}, std::pair{missing, "does not have"}}) {
    ConsumerModel cm;
    cm.plan = *plan;
    auto rm = adopt_rank_model(std::move(cm), 3, meta);
    ASSERT_FALSE(rm.ok());
    EXPECT_EQ(rm.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(rm.status().message().find("consumer 3"), std::string::npos) << rm.status().message();
    EXPECT_NE(rm.status().message().find("'" + m->metadata[0].name + "'"), std::string::npos) << rm.status().message();
    EXPECT_NE(rm.status().message().find(what), std::string::npos) << rm.status().message();
  }
}

TEST(RankModel, HostParamsPassTheDeviceCheck) {
  TensorMap params{{"w", Tensor::empty({4}, DType::kF32, "w")}};
  EXPECT_TRUE(check_param_devices(0, params).ok());
  EXPECT_TRUE(check_param_devices(0, {}).ok());
}

}  // namespace
}  // namespace ferry::engine
