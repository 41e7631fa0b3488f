// Where the commands find a model config given by a relative path, such as their
// defaults (`configs/qwen3-30b-a3b.json`), so that an installed `ferry` runs from any
// working directory (internal).
#pragma once

#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::tools {

// The places a relative `path` is looked for, in order: the working directory; the
// installed data directory beside the running executable (<exe>/../share/ferry/<path>,
// which is also where the Python package keeps its copy); the source tree ferry was
// built from. An absolute path is only itself.
std::vector<std::string> model_config_candidates(const std::string& path);

// The source tree this ferry was built from (the last place looked in).
std::string source_tree();

// The first candidate that exists; kNotFound naming every place tried otherwise.
Result<std::string> find_model_config(const std::string& path);

}  // namespace ferry::tools
