// ModelConfig, InferenceLayout, registry, shrink and checkpoint helpers.
#include <chrono>
#include <map>

#include <nlohmann/json.hpp>

#include "models/test_util.h"
#include "test_paths.h"

namespace ferry {
namespace {

using testing::config_from;
using testing::dense_config;
using testing::layout_from;

const std::string kConfigs = FERRY_CONFIGS_DIR;

TEST(ModelConfig, ReadsSharedConfigs) {
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-8b.json");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->architecture(), "LlamaForCausalLM");
  EXPECT_EQ(c->model_type(), "llama");
  EXPECT_EQ(c->dtype(), DType::kBF16);
  EXPECT_EQ(*c->get_int("hidden_size"), 4096);
  EXPECT_EQ(*c->get_int("rope_scaling.original_max_position_embeddings"), 8192);
  EXPECT_EQ(*c->get_int_or("head_dim", 128), 128);
  EXPECT_FALSE(*c->get_bool_or("tie_word_embeddings", true));
}

TEST(ModelConfig, MissingFieldNamesFieldAndFile) {
  const ModelConfig c = config_from(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})", "cfg/x.json");
  auto v = c.get_int("num_hidden_layers");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kNotFound);
  EXPECT_NE(v.status().message().find("cfg/x.json"), std::string::npos);
  EXPECT_NE(v.status().message().find("'num_hidden_layers'"), std::string::npos);
  // And through the loader.
  auto l = make_model_loader(c, InferenceLayout{});
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("cfg/x.json"), std::string::npos) << l.status().to_string();
  EXPECT_NE(l.status().message().find("num_hidden_layers"), std::string::npos) << l.status().to_string();
}

TEST(ModelConfig, WrongTypesAreErrors) {
  const ModelConfig c = config_from(
      R"({"architectures": ["LlamaForCausalLM"], "hidden_size": "big", "tie_word_embeddings": 1, "x": 2.5, "y": 4.0})");
  auto h = c.get_int("hidden_size");
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("'hidden_size' must be an integer, got string"), std::string::npos)
      << h.status().to_string();
  EXPECT_FALSE(c.get_bool_or("tie_word_embeddings", false).ok());
  EXPECT_FALSE(c.get_int("x").ok());
  EXPECT_EQ(*c.get_int("y"), 4);
  EXPECT_EQ(*c.get_number("x"), 2.5);
}

// A float field outside int64 was cast before its range was checked (UBSan,
// fuzz_config_layout); now refused like any non-integer.
TEST(ModelConfig, HugeFloatIsNotAnInteger) {
  const ModelConfig c = config_from(R"({"architectures": ["LlamaForCausalLM"], "a": 1e300, "b": -1e19, "c": 9e15})");
  auto a = c.get_int("a");
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("'a' must be an integer, got number 1e+300"), std::string::npos)
      << a.status().to_string();
  EXPECT_FALSE(c.get_int_or("b", 0).ok());
  EXPECT_EQ(*c.get_int("c"), 9000000000000000);
}

TEST(ModelConfig, MalformedFiles) {
  EXPECT_EQ(ModelConfig::parse("{not json", "a.json").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ModelConfig::parse("[1]", "a.json").status().message().find("a.json"), std::string::npos);
  auto no_arch = ModelConfig::parse(R"({"hidden_size": 1})", "b.json");
  ASSERT_FALSE(no_arch.ok());
  EXPECT_NE(no_arch.status().message().find("'architectures'"), std::string::npos);
  EXPECT_FALSE(ModelConfig::parse(R"({"architectures": []})").ok());
  EXPECT_FALSE(ModelConfig::parse(R"({"architectures": ["X"], "torch_dtype": "complex"})").ok());
  EXPECT_EQ(ModelConfig::load("/nonexistent/config.json").status().code(), StatusCode::kNotFound);
}

// Sizes that would make the checkpoint implausibly large (intermediate_size 2^40: 8 PiB
// in one tensor; `ferry checkpoint` died of bad_alloc on it, issue 30) are refused while
// the loader declares the checkpoint, naming the tensor and the bytes it would take; the
// declaration of the counts and bytes of real models is unchanged.
TEST(ModelConfig, ImplausibleSizesAreRefusedNamingWhatTheyWouldNeed) {
  const testing::AddressSpaceCap cap(size_t{2} << 30);
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-8b.json");
  ASSERT_TRUE(c.ok());
  for (const char* bad : {R"({"intermediate_size": 1099511627776})", R"({"vocab_size": 4611686018427387904})",
                          R"({"hidden_size": 4294967296, "num_attention_heads": 1, "num_key_value_heads": 1,
                              "head_dim": 1})"}) {
    auto j = nlohmann::json::parse(c->dump());
    j.merge_patch(nlohmann::json::parse(bad));
    auto l = make_model_loader(config_from(j.dump()), InferenceLayout{});
    ASSERT_FALSE(l.ok()) << bad;
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << l.status().to_string();
    EXPECT_NE(l.status().message().find("over ferry's limit of 1125899906842624 bytes (1 PiB)"), std::string::npos)
        << l.status().to_string();
    EXPECT_NE(l.status().message().find("checkpoint tensor 'model."), std::string::npos) << l.status().to_string();
  }
  // The real sizes load (70B: 141 GB).
  auto seventy = ModelConfig::load(kConfigs + "/llama-3.1-70b.json");
  ASSERT_TRUE(seventy.ok());
  EXPECT_TRUE(make_model_loader(*seventy, InferenceLayout{}).ok());
}

TEST(Registry, UnknownArchitectureListsSupported) {
  const ModelConfig c = config_from(R"({"architectures": ["GPT2LMHeadModel"]})", "gpt2.json");
  auto l = make_model_loader(c, InferenceLayout{});
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  const std::string m = l.status().message();
  EXPECT_NE(m.find("GPT2LMHeadModel"), std::string::npos) << m;
  for (const auto& a : supported_architectures()) EXPECT_NE(m.find(a), std::string::npos) << m;
  const auto archs = supported_architectures();
  for (const char* a : {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}) {
    EXPECT_NE(std::find(archs.begin(), archs.end(), a), archs.end()) << a;
  }
}

TEST(Layout, ParsesAndNumbersRanks) {
  auto l = InferenceLayout::parse("tp=4, dp=2,ep=8 ,replicas=3");
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->world_size(), 24);
  EXPECT_EQ(l->to_string(), "tp=4,dp=2,ep=8,replicas=3");
  // global = replica*(D*T) + dp*T + tp; ep rank = dp*T + tp.
  auto r = l->rank(2 * 8 + 1 * 4 + 3);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->replica, 2);
  EXPECT_EQ(r->dp, 1);
  EXPECT_EQ(r->tp, 3);
  EXPECT_EQ(r->engine_rank(), 7);
  EXPECT_EQ(r->expert_ep_rank(), 7);
  EXPECT_EQ(r->expert_tp_size(), 1);
  EXPECT_EQ(l->rank(24).status().code(), StatusCode::kOutOfRange);
  auto d = InferenceLayout::parse("dp=2");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->tp, 1);
  EXPECT_EQ(d->replicas, 1);
  // Without EP, experts are TP-split over all T*D ranks.
  auto noep = InferenceLayout::parse("tp=2,dp=2")->rank(3);
  EXPECT_EQ(noep->expert_tp_rank(), 3);
  EXPECT_EQ(noep->expert_tp_size(), 4);
  EXPECT_EQ(noep->expert_ep_size(), 1);
}

TEST(Layout, MalformedStrings) {
  for (const char* bad : {"", "tp", "tp=", "tp=0", "tp=-1", "tp=2x", "tp=2,tp=4", "pp=2", "tp=2,dp=2,ep=2",
                          "tp=2;dp=2", "tp=99999999999"}) {
    auto l = InferenceLayout::parse(bad);
    EXPECT_FALSE(l.ok()) << "'" << bad << "' parsed";
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  auto ep = InferenceLayout::parse("tp=2,dp=2,ep=2");
  EXPECT_NE(ep.status().message().find("ep must be 1 (off) or tp*dp = 4"), std::string::npos) << ep.status().to_string();
  EXPECT_NE(InferenceLayout::parse("pp=2").status().message().find("unknown key 'pp'"), std::string::npos);
  EXPECT_TRUE(InferenceLayout::parse("tp=2,dp=2,ep=4").ok());
  EXPECT_TRUE(InferenceLayout::parse("ep=1").ok());
}

TEST(Options, Quantize) {
  EXPECT_EQ(*parse_quantize("fp8"), Quantize::kFp8);
  EXPECT_EQ(*parse_quantize("none"), Quantize::kNone);
  EXPECT_FALSE(parse_quantize("int4").ok());
}

// --- shrink ----------------------------------------------------------------------------

std::map<std::string, std::pair<std::string, std::string>> changes_of(const ShrinkResult& s) {
  std::map<std::string, std::pair<std::string, std::string>> m;
  for (const auto& c : s.changes) m[c.field] = {c.before, c.after};
  return m;
}

TEST(Shrink, Llama8bAtTp2) {
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-8b.json");
  ASSERT_TRUE(c.ok());
  auto s = shrink_config(*c, layout_from("tp=2"));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  const auto m = changes_of(*s);
  EXPECT_EQ(m.at("num_hidden_layers"), std::make_pair(std::string("32"), std::string("2")));
  EXPECT_EQ(m.at("hidden_size"), std::make_pair(std::string("4096"), std::string("128")));
  EXPECT_EQ(m.at("num_key_value_heads").second, "4");
  EXPECT_EQ(m.at("num_attention_heads").second, "8");
  EXPECT_EQ(m.at("head_dim"), std::make_pair(std::string("(derived 128)"), std::string("16")));
  EXPECT_EQ(m.at("intermediate_size").second, "192");
  // 128256 is a multiple of 64 (no padding) and stays one.
  EXPECT_EQ(*s->config.get_int("vocab_size") % 64, 0);
  EXPECT_EQ(s->config.architecture(), "LlamaForCausalLM");
  EXPECT_FALSE(s->config.has("unrelated"));
  EXPECT_EQ(*s->config.get_number("rope_theta"), 500000.0);  // untouched fields stay
}

TEST(Shrink, KeepsKvReplicationAndPadding) {
  // 8 kv heads at tp=16 are replicated at full size; the shrunk config keeps 8 < 16.
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-70b.json");
  ASSERT_TRUE(c.ok());
  auto s = shrink_config(*c, layout_from("tp=16"));
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(*s->config.get_int("num_key_value_heads"), 8);
  EXPECT_EQ(*s->config.get_int("num_attention_heads") % 16, 0);
  // Vocab 1000 (24 padding rows) keeps 24 padding rows; padded vocab divisible by tp.
  const ModelConfig small = config_from(dense_config("Qwen2ForCausalLM", 4, 256, 16, 4, 512, 100000 + 1000, false));
  auto s2 = shrink_config(small, layout_from("tp=4"));
  ASSERT_TRUE(s2.ok()) << s2.status().to_string();
  const int64_t v = *s2->config.get_int("vocab_size");
  EXPECT_EQ((v + 63) / 64 * 64 - v, (101000 + 63) / 64 * 64 - 101000);
  EXPECT_EQ(((v + 63) / 64 * 64) % 4, 0);
  EXPECT_LT(v, 1000);
}

TEST(Shrink, FailsLikeTheLoader) {
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-8b.json");
  ASSERT_TRUE(c.ok());
  auto s = shrink_config(*c, layout_from("tp=3"));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("tp 3"), std::string::npos) << s.status().to_string();
}

TEST(Shrink, SharedDenseConfigsLoadAtManyLayouts) {
  for (const char* file : {"llama-3.1-8b.json", "llama-3.1-70b.json"}) {
    auto c = ModelConfig::load(kConfigs + "/" + file);
    ASSERT_TRUE(c.ok());
    for (const char* layout : {"tp=1", "tp=2", "tp=4", "tp=8", "tp=16", "tp=2,dp=2,replicas=2"}) {
      SCOPED_TRACE(std::string(file) + " " + layout);
      auto s = shrink_config(*c, layout_from(layout));
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      auto l = testing::loader_for(s->config, layout);
      ASSERT_NE(l, nullptr);
      testing::expect_replay_equals_direct(*l);
    }
  }
}

TEST(Shrink, HandWrittenConfigsLoadAtManyLayouts) {
  const std::string dir = FERRY_TEST_CONFIGS_DIR;
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"qwen2.5-7b.json", {"tp=1", "tp=2", "tp=4", "tp=4,dp=2,replicas=2"}},
      {"qwen2.5-0.5b.json", {"tp=1", "tp=2", "tp=2,dp=2", "tp=2,replicas=2"}},
      {"qwen3-8b.json", {"tp=1", "tp=2", "tp=4", "tp=8", "tp=16", "tp=2,dp=2,replicas=2"}},
      {"qwen3-0.6b.json", {"tp=1", "tp=4", "tp=8", "tp=16"}},
      {"phi-3-mini-4k.json", {"tp=1", "tp=2", "tp=4", "tp=8", "tp=2,dp=2,replicas=2"}},
      {"phi-4-mini.json", {"tp=1", "tp=2", "tp=4", "tp=8", "tp=4,dp=2"}},
  };
  for (const auto& [file, layouts] : cases) {
    auto c = ModelConfig::load(dir + "/" + file);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    for (const auto& layout : layouts) {
      SCOPED_TRACE(file + " " + layout);
      // The full-size model takes the layout too (the shrunk one is only meaningful then).
      ASSERT_TRUE(make_model_loader(*c, layout_from(layout)).ok());
      auto s = shrink_config(*c, layout_from(layout));
      ASSERT_TRUE(s.ok()) << s.status().to_string();
      EXPECT_EQ(s->config.architecture(), c->architecture());
      EXPECT_EQ(*s->config.get_bool_or("tie_word_embeddings", false), *c->get_bool_or("tie_word_embeddings", false));
      auto l = testing::loader_for(s->config, layout);
      ASSERT_NE(l, nullptr);
      testing::expect_replay_equals_direct(*l);
    }
  }
}

// Full size, no data: recording is cheap (llama-3.1-70b, tp=8, one rank). Cheap as a
// count of work, not a time: the plan of 8.8e9 elements is a few copies per checkpoint
// tensor (its size follows the tensors, never the elements).
TEST(Record, FullSizeLlama70bRank) {
  auto c = ModelConfig::load(kConfigs + "/llama-3.1-70b.json");
  ASSERT_TRUE(c.ok());
  auto l = testing::loader_for(*c, "tp=8,replicas=2");
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->checkpoint().size(), 3u + 80u * 9u);
  auto plan = record_plan(*l, 11);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_GE(plan->stats().copies, l->checkpoint().size());
  EXPECT_LE(plan->stats().copies, 2 * l->checkpoint().size()) << "copies per checkpoint tensor";
  EXPECT_LT(plan->encode().size(), 256u * l->checkpoint().size()) << "encoded bytes per checkpoint tensor";
  auto params = l->params(11);
  ASSERT_TRUE(params.ok());
  uint64_t numel = 0;
  for (const auto& d : *params) numel += static_cast<uint64_t>(shape_numel(d.shape));
  EXPECT_EQ(plan->stats().elements, numel);
  EXPECT_EQ(plan->stats().zeros, 0u);
  // ~70.6e9 parameters / 8 plus replicated norms.
  EXPECT_NEAR(static_cast<double>(numel), 70.55e9 / 8, 0.1e9);
  auto same = record_plan(*l, 3);  // rank 3 of replica 0
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->hash(), plan->hash());
}

// --- checkpoints -------------------------------------------------------------------------

TEST(Checkpoint, RandomIsDeterministicAndVaried) {
  std::vector<TensorDecl> decls = {{"a", DType::kBF16, {64, 8}}, {"b", DType::kF32, {5}}, {"c", DType::kF8E4M3, {4, 4}},
                                   {"d", DType::kI64, {3}}};
  auto x = random_checkpoint(decls, 3), y = random_checkpoint(decls, 3), z = random_checkpoint(decls, 4);
  ASSERT_TRUE(x.ok() && y.ok() && z.ok());
  for (const auto& d : decls) EXPECT_TRUE(*x->at(d.name).equal(y->at(d.name))) << d.name;
  EXPECT_FALSE(*x->at("a").equal(z->at("a")));
  const auto v = testing::values(x->at("a"));
  std::set<double> distinct(v.begin(), v.end());
  EXPECT_GT(distinct.size(), v.size() / 2);
  for (double e : v) EXPECT_TRUE(std::isfinite(e));
  EXPECT_TRUE(check_checkpoint(decls, *x).ok());
  TensorMap extra = *x;
  extra["zzz"] = Tensor::empty({1}, DType::kBF16);
  EXPECT_EQ(check_checkpoint(decls, extra).code(), StatusCode::kNotFound);
  TensorMap wrong = *x;
  wrong["b"] = Tensor::empty({6}, DType::kF32);
  EXPECT_NE(check_checkpoint(decls, wrong).message().find("'b'"), std::string::npos);
}

}  // namespace
}  // namespace ferry
