// Ranks-as-threads tests of the engine with consumers made from recorded plans
// (Consumer::create with a ConsumerModel) instead of the built-in loaders: a loader
// written by hand as an inference engine would, and a plan that disagrees with the
// trainer's metadata. Fixtures in engine_test_util.h, instantiated in engine_test.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine_test_util.h"

namespace ferry::engine_tests {
namespace {

// A loader written by hand as an inference engine would (vLLM's Llama at tensor
// parallel rank r of t): q/k/v fused into one qkv param and gate/up into gate_up,
// vocab-parallel embedding and lm_head padded to a multiple of 64 rows per rank,
// row-parallel o/down, norms whole. The same code records a plan (recording tensors)
// and loads real bytes (the reference a consumer must match).
struct HandWrittenLlamaLoader {
  int r = 0, t = 1;
  std::map<std::string, TensorDecl> ckpt;

  static int64_t layer_of(const std::string& n) { return std::stoll(n.substr(n.find("layers.") + 7)); }
  Shape shape(const std::string& n) const { return ckpt.at(n).shape; }
  int64_t vocab_rows() const {
    const int64_t v = shape("model.embed_tokens.weight")[0];
    return (v + t - 1) / t + 63 - ((v + t - 1) / t + 63) % 64;
  }
  std::vector<TensorDecl> params() const {
    std::vector<TensorDecl> out;
    const DType dt = ckpt.at("model.embed_tokens.weight").dtype;
    const int64_t hidden = shape("model.embed_tokens.weight")[1];
    out.push_back({"embed.weight", dt, {vocab_rows(), hidden}});
    for (const auto& [n, d] : ckpt) {
      if (n.find("layers.") == std::string::npos) continue;
      const std::string l = fmt::format("layers.{}.", layer_of(n));
      if (n.ends_with("q_proj.weight")) {
        const int64_t rows = (d.shape[0] + 2 * shape(n.substr(0, n.size() - 13) + "k_proj.weight")[0]) / t;
        out.push_back({l + "qkv.weight", dt, {rows, d.shape[1]}});
      } else if (n.ends_with("o_proj.weight")) {
        out.push_back({l + "o.weight", dt, {d.shape[0], d.shape[1] / t}});
      } else if (n.ends_with("gate_proj.weight")) {
        out.push_back({l + "gate_up.weight", dt, {2 * d.shape[0] / t, d.shape[1]}});
      } else if (n.ends_with("down_proj.weight")) {
        out.push_back({l + "down.weight", dt, {d.shape[0], d.shape[1] / t}});
      } else if (n.ends_with("layernorm.weight")) {
        out.push_back({l + (n.find("input_") != std::string::npos ? "in_norm.weight" : "post_norm.weight"), dt, d.shape});
      }
    }
    out.push_back({"norm.weight", dt, shape("model.norm.weight")});
    out.push_back({"lm_head.weight", dt, {vocab_rows(), hidden}});
    return out;
  }
  // Loads checkpoint tensor `n` (source `w`) into `p`, as a weight_loader would.
  Status load(const std::string& n, const Tensor& w, const TensorMap& p) const {
    auto rows = [&](const char* param, int64_t at, const Tensor& part) {
      const int64_t k = part.shape()[0] / t;
      return p.at(param).narrow(0, at, k).copy_(part.narrow(0, r * k, k));
    };
    if (n == "model.embed_tokens.weight" || n == "lm_head.weight") {
      const Tensor& dst = p.at(n == "lm_head.weight" ? "lm_head.weight" : "embed.weight");
      const int64_t per = vocab_rows(), v = w.shape()[0];
      const int64_t begin = std::min(v, r * per), end = std::min(v, (r + 1) * per);
      if (end > begin) FERRY_RETURN_IF_ERROR(dst.narrow(0, 0, end - begin).copy_(w.narrow(0, begin, end - begin)));
      return end - begin < per ? dst.narrow(0, end - begin, per - (end - begin)).zero_() : Status::Ok();
    }
    if (n == "model.norm.weight") return p.at("norm.weight").copy_(w);
    const std::string l = fmt::format("layers.{}.", layer_of(n));
    const std::string base = n.substr(0, n.rfind('.', n.size() - 8) + 1);  // "...self_attn." / "...mlp."
    if (n.ends_with("q_proj.weight")) return rows((l + "qkv.weight").c_str(), 0, w);
    if (n.ends_with("k_proj.weight")) return rows((l + "qkv.weight").c_str(), shape(base + "q_proj.weight")[0] / t, w);
    if (n.ends_with("v_proj.weight"))
      return rows((l + "qkv.weight").c_str(), (shape(base + "q_proj.weight")[0] + w.shape()[0]) / t, w);
    if (n.ends_with("gate_proj.weight")) return rows((l + "gate_up.weight").c_str(), 0, w);
    if (n.ends_with("up_proj.weight")) return rows((l + "gate_up.weight").c_str(), w.shape()[0] / t, w);
    if (n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight")) {
      const int64_t k = w.shape()[1] / t;
      return p.at(l + (n.ends_with("o_proj.weight") ? "o.weight" : "down.weight")).copy_(w.narrow(1, r * k, k));
    }
    if (n.ends_with("layernorm.weight"))
      return p.at(l + (n.find("input_") != std::string::npos ? "in_norm.weight" : "post_norm.weight")).copy_(w);
    return not_found("hand-written loader: unexpected checkpoint tensor '{}'", n);
  }
  Result<Plan> record() const {
    TensorMap params;
    for (const auto& d : this->params()) params.emplace(d.name, Tensor::param(d.name, d.shape, d.dtype));
    Recorder rec;
    for (const auto& [n, d] : ckpt) FERRY_RETURN_IF_ERROR(load(n, Tensor::source(n, d.shape, d.dtype), params));
    return rec.finish();
  }
};

// The engine from a plan recorded by hand-written loader code (Consumer::create with a
// ConsumerModel): every consumer's params bit-identical to that loader run on the whole
// checkpoint of the version, post_process called once per group per sync, and replicas
// (equal plans) sharing producers.
TEST_P(EngineTest, ConsumerFromHandWrittenPlan) {
  Cluster k(GetParam());
  std::mutex mu;
  std::map<std::pair<int, std::string>, int> post_calls;  // (consumer, group) -> calls
  std::vector<HandWrittenLlamaLoader> loaders;
  std::vector<TensorMap> buffers(4);
  k.user_model = [&](int c) -> Result<ConsumerModel> {
    const HandWrittenLlamaLoader& l = loaders.at(static_cast<size_t>(c));
    ConsumerModel m;
    FERRY_ASSIGN_OR_RETURN(m.plan, l.record());
    for (const auto& d : l.params()) {
      // Half the params in the caller's buffers, the rest allocated by the engine.
      if (d.name.find("layers.0.") != std::string::npos || d.name == "embed.weight")
        buffers[static_cast<size_t>(c)].emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
    }
    m.params = buffers[static_cast<size_t>(c)];
    m.post_process = [&, c](const ConsumerModel::PostGroup& g, TensorMap& params) {
      for (const auto& n : g.params) {
        if (!params.count(n)) return internal_error("post group {} names unknown param {}", g.name, n);
      }
      std::lock_guard<std::mutex> lk(mu);
      ++post_calls[{c, g.name}];
      return Status::Ok();
    };
    return m;
  };
  // The checkpoint's shapes are only known once the job model is made: build the loaders
  // lazily, before any consumer starts (start() makes the model, then the threads).
  auto model = tools::make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2", true, "");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  for (int c = 0; c < 4; ++c) {
    HandWrittenLlamaLoader l{c % 2, 2, {}};
    for (const auto& d : model->metadata) l.ckpt.emplace(d.name, d);
    loaders.push_back(std::move(l));
  }
  Status s = k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2");
  ASSERT_TRUE(s.ok()) << s.to_string();
  const Routes& routes = k.prod[0]->routes();
  EXPECT_EQ(routes.consumer_plan[0], routes.consumer_plan[2]) << "replicas share a plan class";
  EXPECT_EQ(routes.consumer_plan[1], routes.consumer_plan[3]);
  EXPECT_NE(routes.consumer_plan[0], routes.consumer_plan[1]);
  for (uint64_t v = 1; v <= 2; ++v) {
    auto o = k.sync(v);
    TensorMap ckpt;
    for (const auto& d : k.model.metadata) ckpt.emplace(d.name, synthetic_tensor(k.seed, v, d));
    for (int c = 0; c < 4; ++c) {
      ASSERT_TRUE(o.c[static_cast<size_t>(c)]->ok()) << o.c[static_cast<size_t>(c)]->status().to_string();
      const HandWrittenLlamaLoader& l = loaders[static_cast<size_t>(c)];
      TensorMap want;
      for (const auto& d : l.params()) want.emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
      for (const auto& [n, t] : ckpt) ASSERT_TRUE(l.load(n, t, want).ok());
      const TensorMap& got = k.cons[static_cast<size_t>(c)]->params();
      for (const auto& [n, w] : want) {
        auto it = got.find(n);
        ASSERT_NE(it, got.end()) << n;
        const uint64_t bytes = shape_numel(w.shape()) * dtype_size(w.dtype());
        EXPECT_EQ(std::memcmp(*it->second.data_ptr(), *w.data_ptr(), bytes), 0)
            << "consumer " << c << " param " << n << " version " << v;
        if (auto b = buffers[static_cast<size_t>(c)].find(n); b != buffers[static_cast<size_t>(c)].end()) {
          EXPECT_EQ(*it->second.data_ptr(), *b->second.data_ptr()) << "the caller's buffer is written in place";
        }
      }
      EXPECT_EQ(k.cons[static_cast<size_t>(c)]->state().version, v);
    }
    for (auto& p : o.p) ASSERT_TRUE(p->ok()) << p->status().to_string();
  }
  std::lock_guard<std::mutex> lk(mu);
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ((post_calls[{c, "pre"}]), 2);
    EXPECT_EQ((post_calls[{c, "post"}]), 2);
    EXPECT_EQ((post_calls[{c, "layer 0"}]), 2);
  }
}

// A plan that disagrees with the trainer's metadata is refused at creation, naming the
// tensor and both shapes.
TEST(EngineUserPlan, MismatchedSourceIsNamed) {
  Cluster k;
  k.eo.rendezvous_timeout = 3s;
  k.user_model = [](int) -> Result<ConsumerModel> {
    ConsumerModel m;
    Recorder rec;
    Tensor p = Tensor::param("x", {4, 8}, DType::kBF16);
    FERRY_RETURN_IF_ERROR(p.copy_(Tensor::source("model.norm.weight", {4, 8}, DType::kBF16)));
    FERRY_ASSIGN_OR_RETURN(m.plan, rec.finish());
    return m;
  };
  ASSERT_FALSE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1").ok());
  const Status s = k.started.at(1);  // the consumer's
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("'model.norm.weight' as BF16 [4, 8]"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace ferry::engine_tests
