// The `ferry` command's sub-command registry. Each src/cli/cmd_*.cpp registers one
// sub-command with a static FERRY_COMMAND(...) object; main() builds the CLI11 app
// from the registry, so adding a command touches only its own file.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace ferry::cli {

// `setup` adds the sub-command's options to `app` and returns the function that runs
// it after parsing (its return value is the process exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& app)>;

struct CommandInfo {
  std::string name;
  std::string help;
  CommandSetup setup;
};

std::vector<CommandInfo>& command_registry();

struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string help, CommandSetup setup) {
    command_registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace ferry::cli

#define FERRY_COMMAND(var, name, help, setup) \
  static ::ferry::cli::CommandRegistrar var{name, help, setup}
