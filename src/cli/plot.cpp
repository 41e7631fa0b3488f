#include "cli/plot.h"

#include <chrono>

#include "tools/subprocess.h"

namespace ferry::cli {

Status run_plot_script(const char* script, const std::vector<std::string>& args, const std::string& option) {
  tools::ProcessSpec spec;
  spec.argv = {"/usr/bin/python3", "-c", std::string(kPlotPreamble) + script};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.name = "python3 (" + option + ")";
  FERRY_ASSIGN_OR_RETURN(auto child, tools::spawn(spec));
  const int code = tools::reap(child, std::chrono::seconds(60));
  if (code == 3) return failed_precondition("{} needs matplotlib: apt-get install python3-matplotlib", option);
  if (code != 0) return io_error("{}: /usr/bin/python3 with matplotlib exited with {} drawing the picture", option, code);
  return Status::Ok();
}

}  // namespace ferry::cli
