// Child processes of the tools' drivers (internal): the rank workers of `ferry demo` and
// of the multi-process tests, `ferry bench`'s ranks and its mpirun. One way to start a
// process, wait for it, kill it and reap it, for every driver.
//
// Threading: the drivers are multithreaded (store client, transport progress threads),
// so spawn() prepares everything the child needs (argv, environment, executable path)
// before fork(), and the child makes only async-signal-safe calls (prctl, getppid, open,
// dup2, execve, write, _exit) — no allocation, no stdio, no fmt. A Child is owned by one
// thread of the driver; the functions below are not safe to call on the same Child from
// two threads.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.h"

namespace ferry::tools {

struct ProcessSpec {
  // argv[0]: run as is when it names a path (has a '/'), else looked up on $PATH (as
  // execvp would, but before fork).
  std::vector<std::string> argv;
  // The child's environment, "NAME=value" each; nullopt: this process's environment at
  // the call (see environment_with).
  std::optional<std::vector<std::string>> env;
  std::string log;   // the child's stdout and stderr (created or truncated); empty: inherited
  std::string name;  // for messages: "producer 0", "mpirun"
};

// A started child. pid -1: not running under this handle (never started, reaped, or
// given up on); no function below signals or waits for a Child with pid -1.
struct Child {
  pid_t pid = -1;
  std::string name;
  std::string log;
};

// Starts `spec`. The child gets SIGKILL when the thread that called spawn() exits
// (PR_SET_PDEATHSIG; it exits at once when that thread is already gone). Returns once
// the child has exec'd or failed to: an exec failure ("exec ARGV0: strerror") is written
// to the child's log (stderr when it has none), and the child exits with status 127 (the
// caller sees it as an early exit, as from a process that failed on its own). Errors:
// IoError when fork or the pipe that reports exec failures cannot be made.
Result<Child> spawn(const ProcessSpec& spec);

// This process's environment without NAME, plus NAME=value when `value` is not empty.
std::vector<std::string> environment_with(const std::string& name, const std::string& value);

// Whether `exe` can be run: a path (has a '/') that is executable, or a name found
// executable in a directory of $PATH.
bool is_executable(const std::string& exe);

// Waits, polling every 5 ms, until `c` exits or `deadline` passes (checked at least once
// even when it has passed). Exited: its wait status (as from waitpid), and c.pid = -1.
// nullopt: still running at the deadline, or not a child of this process (waitpid
// failed), or c.pid is -1; the Child is left as it was.
std::optional<int> wait_exit(Child& c, std::chrono::steady_clock::time_point deadline);

// SIGKILLs `c` and reaps it, waiting at most 10 s (a SIGKILLed process only outlives
// that in an uninterruptible sleep; it is then left unreaped). c.pid = -1 afterwards.
void kill_now(Child& c);

// Waits up to `timeout` for `c` to exit, then kill_now(). Its exit code when it exited
// normally within the time, else -1. c.pid = -1 afterwards.
int reap(Child& c, std::chrono::milliseconds timeout);

// SIGTERM (which mpirun passes on to its ranks; a SIGKILLed mpirun would orphan them),
// then reap(c, grace).
void terminate(Child& c, std::chrono::milliseconds grace);

// The text of the child's log so far (empty when it has none or it cannot be read).
std::string read_log(const Child& c);

// The running executable's path (/proc/self/exe): what the drivers start their rank
// workers as, and where the installed data directory is found from. "ferry" when it
// cannot be read (spawn then looks that up on $PATH).
std::string exe_path();

// Figures of a running process read from /proc (any pid, not only children).
// Resident set (KiB) and open descriptors; -1 for what cannot be read.
std::pair<int64_t, int64_t> proc_usage(pid_t pid);
// CPU seconds (user + system) so far; 0 when the process is gone.
double proc_cpu(pid_t pid);
// CPU seconds of `pid` and its direct children (mpirun's ranks).
double tree_cpu(pid_t pid);

}  // namespace ferry::tools
