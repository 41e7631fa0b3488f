// Checkpoints read from safetensors folders (ferry_io): loader and `ferry check --checkpoint`.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "ferry/safetensors.h"
#include "models/test_util.h"
#include "test_paths.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("ferry-models-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// Writes `ckpt` as two shard files (a sharded HF checkpoint) and config.json.
void write_checkpoint(const fs::path& dir, const std::string& config, const std::vector<TensorDecl>& decls,
                      const TensorMap& ckpt) {
  std::vector<SafetensorsEntry> a, b;
  for (size_t i = 0; i < decls.size(); ++i) (i % 2 ? a : b).push_back({decls[i].name, ckpt.at(decls[i].name)});
  ASSERT_TRUE(write_safetensors((dir / "model-00001-of-00002.safetensors").string(), a).ok());
  ASSERT_TRUE(write_safetensors((dir / "model-00002-of-00002.safetensors").string(), b).ok());
  std::ofstream(dir / "config.json") << config;
}

const std::string kConfig =
    testing::dense_config("Qwen2ForCausalLM", 2, 64, 8, 2, 128, 1000, true);

TEST(CheckpointDir, LoadsLikeInMemory) {
  TempDir tmp;
  const ModelConfig cfg = testing::config_from(kConfig);
  auto loader = testing::loader_for(cfg, "tp=4");
  auto ckpt = random_checkpoint(loader->checkpoint(), 31);
  ASSERT_TRUE(ckpt.ok());
  write_checkpoint(tmp.path, kConfig, loader->checkpoint(), *ckpt);
  auto read = read_checkpoint_dir(tmp.path.string());
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  ASSERT_TRUE(check_checkpoint(loader->checkpoint(), *read).ok());
  for (int r = 0; r < 4; ++r) {
    auto plan = record_plan(*loader, r);
    ASSERT_TRUE(plan.ok());
    auto from_files = load_rank_from_plan(*loader, r, *plan, *read);
    ASSERT_TRUE(from_files.ok()) << from_files.status().to_string();
    auto direct_files = load_rank_direct(*loader, r, *read);
    ASSERT_TRUE(direct_files.ok()) << direct_files.status().to_string();
    auto in_memory = load_rank_direct(*loader, r, *ckpt);
    ASSERT_TRUE(in_memory.ok());
    const auto decls = (*loader->rank(r))->final_params();
    EXPECT_FALSE(compare_params(decls, *from_files, *in_memory)->has_value());
    EXPECT_FALSE(compare_params(decls, *direct_files, *in_memory)->has_value());
  }
  EXPECT_EQ(read_checkpoint_dir((tmp.path / "missing").string()).status().code(), StatusCode::kNotFound);
}

TEST(CheckpointDir, FerryCheckReadsIt) {
  TempDir tmp;
  const ModelConfig cfg = testing::config_from(kConfig);
  auto loader = testing::loader_for(cfg, "tp=1");
  auto ckpt = random_checkpoint(loader->checkpoint(), 32);
  ASSERT_TRUE(ckpt.ok());
  write_checkpoint(tmp.path, kConfig, loader->checkpoint(), *ckpt);
  const std::string base = std::string(FERRY_BIN) + " check --model " + (tmp.path / "config.json").string() +
                           " --checkpoint " + tmp.path.string();
  const std::string out = (tmp.path / "out.txt").string();
  EXPECT_EQ(std::system((base + " --inference tp=2,replicas=2 > " + out + " 2>&1").c_str()), 0);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("safetensors in"), std::string::npos) << text;
  EXPECT_NE(text.find("summary: 4/4 ranks match"), std::string::npos) << text;
  // A checkpoint that does not fit the config: non-zero exit naming the tensor.
  fs::remove(tmp.path / "model-00002-of-00002.safetensors");
  EXPECT_NE(std::system((base + " > " + out + " 2>&1").c_str()), 0);
  std::ifstream in2(out);
  std::string text2((std::istreambuf_iterator<char>(in2)), std::istreambuf_iterator<char>());
  EXPECT_NE(text2.find("is missing"), std::string::npos) << text2;
}

}  // namespace
}  // namespace ferry
