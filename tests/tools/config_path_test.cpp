// Where a relative model config is found (tools/config_path.h): the working directory
// first, then the installed share directory beside the executable, then the source tree;
// `ferry demo` and friends run from any directory (issue 16).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tools/config_path.h"
#include "test_paths.h"

namespace ferry::tools {
namespace {
namespace fs = std::filesystem;

// Runs the test body from a fresh temporary directory, restoring the old one after.
class InOtherDirectory : public ::testing::Test {
 protected:
  void SetUp() override {
    old_ = fs::current_path();
    dir_ = fs::temp_directory_path() / fmt::format("ferry-config-path-{}", ::getpid());
    fs::create_directories(dir_);
    fs::current_path(dir_);
  }
  void TearDown() override {
    fs::current_path(old_);
    fs::remove_all(dir_);
  }
  fs::path old_, dir_;
};

TEST(ConfigPath, AbsolutePathIsOnlyItself) {
  EXPECT_EQ(model_config_candidates("/no/such/config.json"), std::vector<std::string>{"/no/such/config.json"});
  auto r = find_model_config("/no/such/config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
}

TEST(ConfigPath, RelativeLooksInCwdThenShareThenSourceTree) {
  const auto c = model_config_candidates("configs/x.json");
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0], "configs/x.json");
  EXPECT_TRUE(c[1].ends_with("share/ferry/configs/x.json")) << c[1];
  EXPECT_EQ(c[2], std::string(FERRY_SOURCE_DIR) + "/configs/x.json");
}

TEST_F(InOtherDirectory, DefaultConfigIsFoundOutsideTheRepository) {
  auto r = find_model_config("configs/qwen3-30b-a3b.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, std::string(FERRY_SOURCE_DIR) + "/configs/qwen3-30b-a3b.json");
}

TEST_F(InOtherDirectory, WorkingDirectoryComesFirst) {
  fs::create_directories("configs");
  std::ofstream("configs/qwen3-30b-a3b.json") << "{}";
  auto r = find_model_config("configs/qwen3-30b-a3b.json");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, "configs/qwen3-30b-a3b.json");
}

TEST_F(InOtherDirectory, NotFoundNamesEveryPlaceTried) {
  auto r = find_model_config("configs/no-such-model.json");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  for (const auto& c : model_config_candidates("configs/no-such-model.json"))
    EXPECT_NE(r.status().message().find(c), std::string::npos) << r.status().to_string();
}

}  // namespace
}  // namespace ferry::tools
