// Runs a command line for the end-to-end CLI tests: its stdout, exit code and stderr.
#pragma once

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

namespace ferry_cli_test {

struct CommandRun {
  int exit_code = -1;  // -1: killed by a signal (a crash), or not run
  std::string out, err;
};

// Runs `cmd` through the shell. stderr goes through a file of this process's own: ctest
// runs tests as parallel processes, and a shared name let one test read another's.
inline CommandRun run_command(const std::string& cmd) {
  const std::string err_path = ::testing::TempDir() + "/ferry_cli_test." + std::to_string(::getpid()) + ".err";
  CommandRun r;
  FILE* f = ::popen((cmd + " 2>" + err_path).c_str(), "r");
  if (!f) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) r.out.append(buf, n);
  const int status = ::pclose(f);
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  std::ifstream e(err_path);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  std::remove(err_path.c_str());
  return r;
}

}  // namespace ferry_cli_test
