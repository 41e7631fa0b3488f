#include "tools/config_path.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <system_error>

#include "tools/subprocess.h"

namespace ferry::tools {
namespace fs = std::filesystem;

namespace {

// <prefix> of the running executable installed as <prefix>/FERRY_BINDIR/ferry; empty
// when /proc/self/exe cannot be read (exe_path).
fs::path install_prefix() {
  const fs::path exe = exe_path();
  if (!exe.is_absolute()) return {};
  fs::path prefix = exe.parent_path();
  for (const auto& part : fs::path(FERRY_BINDIR)) {
    if (!part.empty()) prefix = prefix.parent_path();
  }
  return prefix;
}

}  // namespace

std::string source_tree() { return FERRY_SOURCE_DIR; }

std::vector<std::string> model_config_candidates(const std::string& path) {
  const fs::path p(path);
  if (p.is_absolute()) return {path};
  std::vector<std::string> out = {path};
  const fs::path prefix = install_prefix();
  if (!prefix.empty()) out.push_back((prefix / FERRY_DATADIR / p).string());
  out.push_back((fs::path(source_tree()) / p).string());
  return out;
}

Result<std::string> find_model_config(const std::string& path) {
  const auto candidates = model_config_candidates(path);
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::is_regular_file(c, ec)) return c;
  }
  return not_found("model config '{}': not found (looked in {})", path, fmt::join(candidates, ", "));
}

}  // namespace ferry::tools
