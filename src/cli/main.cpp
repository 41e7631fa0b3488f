// ferry — the command-line entry point. Sub-commands live in cmd_*.cpp.
#include <algorithm>
#include <cstdio>
#include <map>
#include <new>
#include <string>

#include "cli/command.h"
#include "ferry/version.h"

namespace ferry::cli {
std::vector<CommandInfo>& command_registry() {
  static std::vector<CommandInfo> registry;
  return registry;
}
}  // namespace ferry::cli

int main(int argc, char** argv) {
  using namespace ferry::cli;
  CLI::App app{"ferry: moves model weights from RL trainer ranks to inference ranks"};
  app.set_version_flag("--version", std::string("ferry ") + ferry::kVersion, "Print the version and exit");
  app.require_subcommand(1);
  auto& registry = command_registry();
  std::sort(registry.begin(), registry.end(),
            [](const CommandInfo& a, const CommandInfo& b) { return a.name < b.name; });
  std::map<CLI::App*, std::function<int()>> runners;
  for (auto& cmd : registry) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.help);
    runners[sub] = cmd.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the refusal (or the help, or the version); a refused command line
    // exits 2 as every other refused input does (CLI11's own codes are 101-120).
    return app.exit(e) == 0 ? 0 : 2;
  }
  for (auto& [sub, run] : runners) {
    if (!sub->parsed()) continue;
    // The last boundary for an allocation the code below did not turn into a Status
    // (a container growing): an error naming the command, never SIGABRT.
    try {
      return run();
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "ferry %s: out of memory: an allocation failed (ulimit -v, or the machine's memory)\n",
                   sub->get_name().c_str());
      return 2;
    }
  }
  return 2;
}
