// Pictures for `--plot` options: a Python script run by Debian's /usr/bin/python3 with
// matplotlib (python3-matplotlib); ferry itself carries no plotting code. Used by
// `ferry simulate --plot` and `ferry trace --plot`.
#pragma once

#include <string>
#include <vector>

#include "ferry/status.h"

namespace ferry::cli {

// Runs `script` (python3 -c) with `args`. The script must `sys.exit(3)` when matplotlib
// cannot be imported (kFailedPrecondition naming the package), and do nothing but that
// check when run with no args. `option` names the option in errors ("--plot").
Status run_plot_script(const char* script, const std::vector<std::string>& args, const std::string& option);

// The preamble every plot script starts with: imports matplotlib (Agg) as plt, or exits 3.
inline constexpr const char* kPlotPreamble = R"PY(
import json, sys
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(3)  # ferry names the package
if len(sys.argv) < 3:
    sys.exit(0)
)PY";

}  // namespace ferry::cli
