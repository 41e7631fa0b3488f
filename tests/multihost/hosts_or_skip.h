// tests/multihost: emulated hosts for a test, or a skip that says why this process cannot
// have them (not root, or the kernel refuses network namespaces). Any other failure to
// create them fails the test.
#pragma once

#include <unistd.h>

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "tools/emulated_hosts.h"

#define MAKE_HOSTS_OR_SKIP(var, n, link)                                                          \
  auto var##_r = ::ferry::tools::EmulatedHosts::create(n, link);                                  \
  if (!var##_r.ok() && (::geteuid() != 0 || var##_r.status().message().find("ip netns add") !=   \
                                                 std::string::npos)) {                             \
    GTEST_SKIP() << "emulated hosts unavailable: " << var##_r.status().to_string();               \
  }                                                                                               \
  ASSERT_TRUE(var##_r.ok()) << var##_r.status().to_string();                                      \
  std::unique_ptr<::ferry::tools::EmulatedHosts> var = std::move(*var##_r)
