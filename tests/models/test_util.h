// Helpers shared by the models tests.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ferry/models.h"
#include "sanitizers.h"

namespace ferry::testing {

inline ModelConfig config_from(const std::string& text, const std::string& path = "test.json") {
  auto c = ModelConfig::parse(text, path);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : ModelConfig();
}

// Caps this process's address space at what it maps now plus `extra` bytes for its
// lifetime (the soft RLIMIT_AS; restored after), so a test of an input that once ran
// away ends in an allocation failure instead of the machine swapping. A no-op under
// sanitizers, which reserve terabytes of shadow memory up front.
class AddressSpaceCap {
 public:
  explicit AddressSpaceCap(size_t extra) {
#if FERRY_TEST_SANITIZED
    (void)extra;
#else
    size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    if (pages == 0 || ::getrlimit(RLIMIT_AS, &old_) != 0) return;
    rlimit cap = old_;
    cap.rlim_cur = static_cast<rlim_t>(pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE)) + extra);
    if (old_.rlim_cur != RLIM_INFINITY && old_.rlim_cur < cap.rlim_cur) return;
    set_ = ::setrlimit(RLIMIT_AS, &cap) == 0;
#endif
  }
  ~AddressSpaceCap() {
    if (set_) ::setrlimit(RLIMIT_AS, &old_);
  }
  AddressSpaceCap(const AddressSpaceCap&) = delete;
  AddressSpaceCap& operator=(const AddressSpaceCap&) = delete;

 private:
  rlimit old_{};
  bool set_ = false;
};

inline InferenceLayout layout_from(const std::string& text) {
  auto l = InferenceLayout::parse(text);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return l.ok() ? *l : InferenceLayout();
}

inline std::unique_ptr<ModelLoader> loader_for(const ModelConfig& cfg, const std::string& layout,
                                               LoaderOptions opts = {}) {
  auto l = make_model_loader(cfg, layout_from(layout), opts);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return l.ok() ? std::move(*l) : nullptr;
}

// Values of a real tensor in row-major order.
inline std::vector<double> values(const Tensor& t) {
  auto v = t.to_vector();
  EXPECT_TRUE(v.ok()) << v.status().to_string();
  return v.ok() ? *v : std::vector<double>();
}

// Row `row` of a 2-D (or 1-D: element) real tensor.
inline std::vector<double> row_of(const Tensor& t, int64_t row) {
  if (t.dim() == 1) return values(t.narrow(0, row, 1));
  return values(t.select(0, row));
}

// Every rank: recorded plan replay == direct load, bit for bit; returns the plan hashes.
inline std::vector<uint64_t> expect_replay_equals_direct(const ModelLoader& loader, uint64_t seed = 1) {
  std::vector<uint64_t> hashes;
  auto ckpt = random_checkpoint(loader.checkpoint(), seed);
  EXPECT_TRUE(ckpt.ok());
  if (!ckpt.ok()) return hashes;
  for (int r = 0; r < loader.layout().world_size(); ++r) {
    auto plan = record_plan(loader, r);
    EXPECT_TRUE(plan.ok()) << "rank " << r << ": " << plan.status().to_string();
    if (!plan.ok()) return hashes;
    hashes.push_back(plan->hash());
    auto direct = load_rank_direct(loader, r, *ckpt);
    EXPECT_TRUE(direct.ok()) << direct.status().to_string();
    auto replay = load_rank_from_plan(loader, r, *plan, *ckpt);
    EXPECT_TRUE(replay.ok()) << replay.status().to_string();
    if (!direct.ok() || !replay.ok()) return hashes;
    auto rl = loader.rank(r);
    auto mm = compare_params((*rl)->final_params(), *direct, *replay);
    EXPECT_TRUE(mm.ok()) << mm.status().to_string();
    if (mm.ok() && mm->has_value()) {
      ADD_FAILURE() << "rank " << r << ": param " << (*mm)->param << " index " << (*mm)->index << " " << (*mm)->detail;
    }
  }
  return hashes;
}

// A small Llama-like config (dense, GQA).
inline std::string dense_config(const std::string& arch, int64_t layers, int64_t hidden, int64_t heads, int64_t kv,
                                int64_t inter, int64_t vocab, bool tie, const std::string& extra = "") {
  return "{\"architectures\": [\"" + arch + "\"], \"hidden_size\": " + std::to_string(hidden) +
         ", \"num_hidden_layers\": " + std::to_string(layers) + ", \"num_attention_heads\": " + std::to_string(heads) +
         ", \"num_key_value_heads\": " + std::to_string(kv) + ", \"intermediate_size\": " + std::to_string(inter) +
         ", \"vocab_size\": " + std::to_string(vocab) + ", \"tie_word_embeddings\": " + (tie ? "true" : "false") +
         ", \"torch_dtype\": \"bfloat16\"" + extra + "}";
}

}  // namespace ferry::testing
