// The `ferry` command's sub-command registry. Each src/cli/cmd_*.cpp registers one
// sub-command with a static FERRY_COMMAND(...) object; main() builds the CLI11 app
// from the registry, so adding a command touches only its own file.
#pragma once

#include <sys/resource.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "ferry/engine.h"
#include "ferry/status.h"

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

// Prints "ferry <command>: <status>" to stderr and returns 2, the exit code of a command
// that failed on its input or its work.
inline int fail_with(const char* command, const Status& st) {
  std::fprintf(stderr, "ferry %s: %s\n", command, st.to_string().c_str());
  return 2;
}

// This process's CPU time (user + system) and peak RSS so far, for the commands that
// report what their own work cost (plan, simulate).
inline double self_cpu_seconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}
inline uint64_t self_peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;  // kilobytes on Linux
}

// A validator for every numeric option: the value must be a finite number in [lo, hi].
// CLI11's own NonNegativeNumber/Range compare with < and >, which NaN passes ("--max-gib
// nan" skipped the size guard), and an int option otherwise takes any negative number.
inline CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || !std::isfinite(v)) {
          return "'" + text + "' is not a finite number";
        }
        if (v < lo || v > hi) {
          return "'" + text + "' is outside [" + fmt::format("{}", lo) + ", " + fmt::format("{}", hi) + "]";
        }
        return std::string();
      },
      "NUMBER in [" + fmt::format("{}", lo) + ", " + fmt::format("{}", hi) + "]");
}

// --delta-block-bytes: 0 (keep a copy) or a block of kMinDeltaBlockBytes to 2^40 bytes.
inline CLI::Validator delta_block_bytes_in() {
  const CLI::Validator in_range = number_in(static_cast<double>(kMinDeltaBlockBytes), static_cast<double>(1ull << 40));
  return CLI::Validator(
      [in_range](std::string& text) -> std::string {
        if (text == "0") return std::string();
        std::string t = text;
        std::string why = in_range(t);
        return why.empty() ? why : why + fmt::format(" (0 keeps a copy; a block is at least {} bytes: a hash of 8 "
                                                     "bytes per smaller block takes more than it saves)",
                                                     kMinDeltaBlockBytes);
      },
      fmt::format("0 or NUMBER in [{}, {}]", kMinDeltaBlockBytes, 1ull << 40));
}

// The delta-sync options `ferry bench` and `ferry demo` share (docs/delta.md): --delta,
// and how much of the synthetic weights changes per version (SyntheticChanges).
inline void add_delta_options(CLI::App& app, bool& delta, double& changed_fraction, std::string& changes,
                              uint64_t& block_bytes, bool& same_host) {
  CLI::Option* on = app.add_flag("--delta", delta,
                                 "delta syncs: producers send each inference rank a patch of what changed since the "
                                 "version it holds (EngineOptions::delta, docs/delta.md)");
  app.add_option("--changed-fraction", changed_fraction,
                 "fraction of the synthetic weights that changes between versions (default 1: all)")
      ->check(number_in(0, 1));
  app.add_option("--changes", changes, "scattered (elements) | clustered (whole tensors) changes")
      ->check(CLI::IsMember({"scattered", "clustered"}));
  app.add_option("--delta-block-bytes", block_bytes,
                 "with --delta: trainer ranks keep no copy, only a hash per block of this many bytes, and send "
                 "changed blocks whole (0, the default: keep a copy, send changed elements)")
      ->check(delta_block_bytes_in())
      ->needs(on);
  app.add_flag("--delta-same-host", same_host,
               "with --delta: patches over shared memory too (by default a job whose every rank is on one host runs "
               "without delta, and trainer ranks send dense bytes to inference ranks on their host: shared memory "
               "moves them faster than they are encoded and applied)")
      ->needs(on);
}

// A byte size (CLI::AsSizeValue's suffixes) that must not be negative: an unsigned option
// takes "-1" as 2^64 - 1 otherwise (ferry plan --staging-budget -1 was 16,777,216 TiB).
inline CLI::Validator size_not_negative() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const size_t at = text.find_first_not_of(" \t");
        return at != std::string::npos && text[at] == '-' ? "'" + text + "' is negative: a size is 0 or more bytes"
                                                           : std::string();
      },
      "SIZE");
}

struct CommandRegistrar {
  CommandRegistrar(std::string name, std::string help, CommandSetup setup) {
    command_registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace ferry::cli

#define FERRY_COMMAND(var, name, help, setup) \
  static ::ferry::cli::CommandRegistrar var{name, help, setup}
