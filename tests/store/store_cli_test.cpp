// `ferry store` as a process: it prints its URL, serves a client, and exits 0 on SIGTERM.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <regex>

#include "ferry/store.h"
#include "store/redis_server.h"
#include "test_paths.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// A child process running `ferry ...` with its stdout and stderr on pipes.
struct Child {
  pid_t pid = -1;
  int out = -1;
  int err = -1;
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      testing::wait_for_exit(pid, 5000);
    }
    if (out >= 0) ::close(out);
    if (err >= 0) ::close(err);
  }
};

std::unique_ptr<Child> spawn(std::vector<std::string> args, const std::vector<std::string>& env) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) return nullptr;
  args.insert(args.begin(), FERRY_BINARY);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_copy = env;
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  auto c = std::make_unique<Child>();
  c->pid = pid;
  c->out = out[0];
  c->err = err[0];
  return c;
}

// Reads from `fd` until `pattern` matches or `within` passes; returns what was read.
std::string read_until(int fd, const std::regex& pattern, std::chrono::milliseconds within) {
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (!std::regex_search(text, pattern) && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buf[512];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  return text;
}

constexpr const char* kCliToken = "cli-token-0123456789";

// A token file in a fresh temporary directory; removed by the destructor.
struct TokenFile {
  explicit TokenFile(const std::string& text) {
    char tmpl[] = "/tmp/ferry-cli-token-XXXXXX";
    dir = ::mkdtemp(tmpl);
    path = dir + "/token";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  ~TokenFile() {
    std::remove(path.c_str());
    ::rmdir(dir.c_str());
  }
  std::string dir, path;
};

TEST(StoreCliTest, ServesUntilSigterm) {
  TokenFile file(std::string(kCliToken) + "\n");
  auto child = spawn({"store", "--port", "0", "--token-file", file.path}, {});
  ASSERT_NE(child, nullptr);
  const std::regex url_re("tcp://127\\.0\\.0\\.1:[0-9]+");
  std::string out = read_until(child->out, url_re, 30s);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, url_re)) << "stdout: " << out;
  const std::string url = m.str();

  StoreOptions o;
  o.token = kCliToken;
  o.connect_timeout = 5s;
  auto s = Store::open(url, o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_TRUE((*s)->set("hello", "world").ok());
  EXPECT_EQ((*s)->get("hello").value_or("?"), "world");
  o.token = "wrong-token-0123456789";
  EXPECT_EQ(Store::open(url, o).status().code(), StatusCode::kPermissionDenied);

  ASSERT_EQ(::kill(child->pid, SIGTERM), 0);
  int status = testing::wait_for_exit(child->pid, 30000);
  ASSERT_NE(status, -1) << "ferry store did not exit within 5 s of SIGTERM";
  child->pid = -1;
  EXPECT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The client notices the server is gone.
  EXPECT_FALSE((*s)->get("hello").ok());
}

TEST(StoreCliTest, TokenFromEnvironmentAndSigint) {
  auto port = testing::free_loopback_port();
  ASSERT_TRUE(port.ok());
  auto child = spawn({"store", "--port", std::to_string(*port)}, {"FERRY_TOKEN=env-token-0123456789"});
  ASSERT_NE(child, nullptr);
  const std::string url = "tcp://127.0.0.1:" + std::to_string(*port);
  std::string out = read_until(child->out, std::regex(url), 30s);
  ASSERT_NE(out.find(url), std::string::npos) << out;
  StoreOptions o;
  o.token = "env-token-0123456789";
  auto s = Store::open(url, o);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ((*s)->add("n", 2).value_or(-1), 2);
  ASSERT_EQ(::kill(child->pid, SIGINT), 0);
  int status = testing::wait_for_exit(child->pid, 30000);
  ASSERT_NE(status, -1);
  child->pid = -1;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(StoreCliTest, WithoutATokenItRefusesToStart) {
  auto child = spawn({"store", "--port", "0"}, {});  // empty environment: no FERRY_TOKEN
  ASSERT_NE(child, nullptr);
  int status = testing::wait_for_exit(child->pid, 30000);
  ASSERT_NE(status, -1);
  child->pid = -1;
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  std::string err = read_until(child->err, std::regex("FERRY_TOKEN"), 2s);
  EXPECT_NE(err.find("FERRY_TOKEN"), std::string::npos) << err;
}

TEST(StoreCliTest, TokenOnTheCommandLineWarnsAndAShortTokenIsRefused) {
  {
    auto child = spawn({"store", "--port", "0", "--token", kCliToken}, {});
    ASSERT_NE(child, nullptr);
    std::string err = read_until(child->err, std::regex("--token-file or FERRY_TOKEN"), 30s);
    EXPECT_NE(err.find("warning: --token puts the secret on the command line"), std::string::npos) << err;
    const std::regex url_re("tcp://127\\.0\\.0\\.1:[0-9]+");
    std::string out = read_until(child->out, url_re, 30s);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(out, m, url_re)) << "stdout: " << out;
    StoreOptions o;
    o.token = kCliToken;
    o.connect_timeout = 5s;
    EXPECT_TRUE(Store::open(m.str(), o).ok());  // still served
    ASSERT_EQ(::kill(child->pid, SIGTERM), 0);
    ASSERT_NE(testing::wait_for_exit(child->pid, 30000), -1);
    child->pid = -1;
  }
  {
    auto child = spawn({"store", "--port", "0"}, {"FERRY_TOKEN=short"});
    ASSERT_NE(child, nullptr);
    int status = testing::wait_for_exit(child->pid, 30000);
    ASSERT_NE(status, -1);
    child->pid = -1;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status;
    std::string err = read_until(child->err, std::regex("at least 16"), 2s);
    EXPECT_NE(err.find("is 5 bytes; at least 16"), std::string::npos) << err;
  }
  TokenFile shorty("abc\n");
  auto child = spawn({"store", "--port", "0", "--token-file", shorty.path}, {});
  ASSERT_NE(child, nullptr);
  int status = testing::wait_for_exit(child->pid, 30000);
  ASSERT_NE(status, -1);
  child->pid = -1;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << status;
  std::string err = read_until(child->err, std::regex("at least 16"), 2s);
  EXPECT_NE(err.find(shorty.path), std::string::npos) << err;
}

}  // namespace
}  // namespace ferry
