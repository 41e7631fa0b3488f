// The backend registry and the backends' options: what each declares, how params are
// validated (an unknown or malformed one is refused, naming it and the known ones), the
// UCX defaults, and the precedence of the FERRY_UCX_* environment variables.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "ferry/transport.h"
#include "transport/ucx/config.h"

namespace ferry {
namespace {

// Clears every variable the UCX backend reads for the test's lifetime, restoring them.
class CleanEnv {
 public:
  CleanEnv() {
    for (const char* n : kNames) {
      const char* v = std::getenv(n);
      saved_.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(n);
    }
  }
  ~CleanEnv() {
    for (const auto& [n, v] : saved_) {
      if (v) {
        ::setenv(n, v->c_str(), 1);
      } else {
        ::unsetenv(n);
      }
    }
  }
  void set(const char* name, const char* value) { ::setenv(name, value, 1); }

 private:
  static constexpr const char* kNames[] = {"FERRY_UCX_TLS",   "FERRY_UCX_TCP_CONTROL", "FERRY_UCX_SPIN_US",
                                           "FERRY_UCX_BUSY_SPIN_US", "FERRY_UCX_READS", "FERRY_UCX_EP_INFO",
                                           "UCX_NET_DEVICES", "UCX_TLS"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

TransportParams resolved(const TransportParams& params) {
  auto r = Transport::resolve_params("ucx", params);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? *r : TransportParams{};
}

TEST(TransportBackendOptions, RegistryListsBackendsAndTheirOptions) {
  EXPECT_EQ(Transport::backends(), (std::vector<std::string>{"inproc", "ucx"}));
  for (const std::string& name : Transport::backends()) {
    auto info = Transport::backend_info(name);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    EXPECT_EQ(info->name, name);
    EXPECT_FALSE(info->doc.empty());
    for (const BackendOption& o : info->options) EXPECT_FALSE(o.doc.empty()) << o.name;
  }
  auto inproc = Transport::backend_info("inproc");
  ASSERT_TRUE(inproc.ok());
  EXPECT_TRUE(inproc->options.empty());
  auto ucx = Transport::backend_info("ucx");
  ASSERT_TRUE(ucx.ok());
  std::vector<std::string> names;
  for (const BackendOption& o : ucx->options) names.push_back(o.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tls", "net_devices", "ucx.", "route_to", "one_host", "tcp_control", "keepalive_ms",
                                             "spin_us", "busy_spin_us", "reads", "ep_info", "unsafe_shm"}));
  EXPECT_TRUE(ucx->accepts("tls"));
  EXPECT_TRUE(ucx->accepts("ucx.RNDV_THRESH"));
  EXPECT_FALSE(ucx->accepts("ucx."));  // a prefix needs a KEY
  EXPECT_FALSE(ucx->accepts("TLS"));
  EXPECT_EQ(Transport::backend_info("carrier-pigeon").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Transport::resolve_params("carrier-pigeon", {}).status().code(), StatusCode::kNotFound);
}

TEST(TransportBackendOptions, UnknownParamIsRefusedNamingTheKnownOnes) {
  CleanEnv env;
  TransportOptions o;
  o.backend = "ucx";
  o.params = {{"tls", "tcp,self"}, {"spin_usec", "5"}};
  Status st = Transport::create(o).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'spin_usec'"), std::string::npos) << st.message();
  for (const char* known : {"tls", "net_devices", "ucx.<KEY>", "tcp_control", "keepalive_ms", "spin_us"}) {
    EXPECT_NE(st.message().find(known), std::string::npos) << known << ": " << st.message();
  }
  // inproc has no options: any param is refused.
  o.backend = "inproc";
  o.params = {{"tls", "tcp,self"}};
  st = Transport::create(o).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("unknown param 'tls' (its params: none)"), std::string::npos) << st.message();
  EXPECT_EQ(Transport::resolve_params("inproc", {{"x", "1"}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Transport::resolve_params("inproc", {}).ok());
}

TEST(TransportBackendOptions, MalformedUcxParamIsRefused) {
  CleanEnv env;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"spin_us", "abc"},   {"spin_us", "-1"},       {"busy_spin_us", "1.5"}, {"keepalive_ms", ""},
      {"tcp_control", "2"}, {"one_host", "maybe"},   {"ep_info", "Yes!"},     {"reads", "fast"},
      {"unsafe_shm", "sure"},
  };
  for (const auto& [name, value] : bad) {
    auto r = Transport::resolve_params("ucx", {{name, value}});
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << name << "=" << value;
    EXPECT_NE(r.status().message().find("'" + name + "'"), std::string::npos) << r.status().message();
    TransportOptions o;
    o.params = {{name, value}};
    EXPECT_EQ(Transport::create(o).status().code(), StatusCode::kInvalidArgument) << name;
  }
  // Two forms of one UCX setting.
  auto r = Transport::resolve_params("ucx", {{"tls", "tcp"}, {"ucx.TLS", "sm"}});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("ucx.TLS"), std::string::npos) << r.status().message();
  // A ucx.<KEY> value UCX refuses is refused at create (UCX itself only warns about a
  // KEY it does not know).
  TransportOptions o;
  o.params = {{"ucx.RNDV_THRESH", "lots"}};
  Status st = Transport::create(o).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("RNDV_THRESH=lots"), std::string::npos) << st.message();
}

TEST(TransportBackendOptions, UcxDefaultsAndParams) {
  CleanEnv env;
  EXPECT_EQ(resolved({}), (TransportParams{{"tls", ""}, {"net_devices", ""}, {"route_to", ""}, {"one_host", "0"}, {"tcp_control", "1"},
                                           {"keepalive_ms", "500"}, {"spin_us", "0"}, {"busy_spin_us", "0"},
                                           {"reads", "auto"}, {"ep_info", "0"}, {"unsafe_shm", "0"}}));
  auto info = Transport::backend_info("ucx");
  ASSERT_TRUE(info.ok());
  const TransportParams defaults = resolved({});
  for (const BackendOption& o : info->options) {
    if (!o.name.ends_with('.')) {
      EXPECT_EQ(defaults.at(o.name), o.default_value) << o.name;
    }
  }
  auto p = resolved({{"tls", "sm,self"}, {"ucx.NET_DEVICES", "lo"}, {"ucx.RNDV_THRESH", "8k"}, {"tcp_control", "off"},
                     {"keepalive_ms", "250"}, {"spin_us", "20"}, {"busy_spin_us", "3"}, {"reads", "rma"},
                     {"ep_info", "yes"}});
  EXPECT_EQ(p["tls"], "sm,self");
  EXPECT_EQ(p["net_devices"], "lo");
  EXPECT_EQ(p["ucx.RNDV_THRESH"], "8k");
  EXPECT_EQ(p["tcp_control"], "0");
  EXPECT_EQ(p["keepalive_ms"], "250");
  EXPECT_EQ(p["spin_us"], "20");
  EXPECT_EQ(p["busy_spin_us"], "3");
  EXPECT_EQ(p["reads"], "rma");
  EXPECT_EQ(p["ep_info"], "1");
  EXPECT_EQ(resolved({{"ucx.TLS", "tcp"}})["tls"], "tcp");
}

TEST(TransportBackendOptions, UcxEnvironmentOverridesParams) {
  CleanEnv env;
  const TransportParams params = {{"tcp_control", "1"}, {"spin_us", "3"}, {"busy_spin_us", "4"}, {"reads", "rma"}};
  env.set("FERRY_UCX_TCP_CONTROL", "off");
  env.set("FERRY_UCX_SPIN_US", "70");
  env.set("FERRY_UCX_BUSY_SPIN_US", "80");
  env.set("FERRY_UCX_READS", "message");
  env.set("FERRY_UCX_EP_INFO", "0");  // set at all: on
  auto p = resolved(params);
  EXPECT_EQ(p["tcp_control"], "0");
  EXPECT_EQ(p["spin_us"], "70");
  EXPECT_EQ(p["busy_spin_us"], "80");
  EXPECT_EQ(p["reads"], "message");
  EXPECT_EQ(p["ep_info"], "1");
  // Values the variables never understood leave the param alone (reads), or mean on.
  env.set("FERRY_UCX_TCP_CONTROL", "whatever");
  env.set("FERRY_UCX_READS", "auto");
  p = resolved({{"tcp_control", "0"}, {"reads", "rma"}});
  EXPECT_EQ(p["tcp_control"], "1");
  EXPECT_EQ(p["reads"], "rma");
  // FERRY_UCX_TLS means nothing without one_host.
  env.set("FERRY_UCX_TLS", "tcp,self");
  EXPECT_EQ(resolved({})["tls"], "");
  EXPECT_EQ(resolved({{"tls", "sm,self"}})["tls"], "sm,self");
}

TEST(TransportBackendOptions, UcxOneHost) {
  CleanEnv env;
  auto p = resolved({{"one_host", "1"}});
  EXPECT_EQ(p["tls"], "sm,tcp,self");  // bytes over shared memory, messages over loopback tcp
  EXPECT_EQ(p["net_devices"], "lo");
  env.set("FERRY_UCX_TLS", "tcp,self");  // the tools' selector: the default of tls
  p = resolved({{"one_host", "1"}});
  EXPECT_EQ(p["tls"], "tcp,self");
  EXPECT_EQ(p["net_devices"], "lo");
  env.set("FERRY_UCX_TLS", "sm,self");  // no tcp named: net_devices left to UCX (tcp_control adds lo)
  p = resolved({{"one_host", "1"}});
  EXPECT_EQ(p["tls"], "sm,self");
  EXPECT_EQ(p["net_devices"], "");
  // A tls param wins over FERRY_UCX_TLS (ferry bench --tls), net_devices over lo.
  p = resolved({{"one_host", "1"}, {"tls", "sm,tcp,self"}, {"net_devices", "eth0"}});
  EXPECT_EQ(p["tls"], "sm,tcp,self");
  EXPECT_EQ(p["net_devices"], "eth0");
  env.set("FERRY_UCX_TLS", "");  // empty: unset
  EXPECT_EQ(resolved({{"one_host", "1"}})["tls"], "sm,tcp,self");
  // UCX_NET_DEVICES is the user's explicit choice: one_host no longer forces lo over it
  // (it did, and a rank in a network namespace could then reach no other host).
  env.set("UCX_NET_DEVICES", "eth0");
  EXPECT_EQ(resolved({{"one_host", "1"}})["net_devices"], "");
}

// Whether a configuration moves bytes over shared memory (what ferry bench picks MPI's
// fabric by): the tls in force, as create() would use it, with UCX's own names.
TEST(TransportBackendOptions, SharedMemoryIsWhatTheTlsInForceLists) {
  CleanEnv env;
  auto shm = [](const TransportParams& params) {
    auto r = Transport::moves_bytes_over_shared_memory("ucx", params);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() && *r;
  };
  EXPECT_TRUE(shm({{"one_host", "1"}}));  // sm,tcp,self
  for (const char* tls : {"sm,tcp,self", "shm", "mm,self", "posix", "sysv,tcp", "cma", "xpmem", "knem", "all", "^tcp"})
    EXPECT_TRUE(shm({{"tls", tls}})) << tls;
  for (const char* tls : {"tcp,self", "tcp", "self", "rc,ud", "^sm", "^posix,sysv", "smx"})
    EXPECT_FALSE(shm({{"tls", tls}})) << tls;
  EXPECT_TRUE(shm({}));  // UCX's own default: every transport
  env.set("UCX_TLS", "tcp,self");  // what UCX reads when ferry sets no tls
  EXPECT_FALSE(shm({}));
  EXPECT_TRUE(shm({{"tls", "sm,self"}}));  // the param wins
  env.set("FERRY_UCX_TLS", "tcp,self");  // the workers' default (one_host)
  EXPECT_FALSE(shm({{"one_host", "1"}}));
  auto inproc = Transport::moves_bytes_over_shared_memory("inproc", {});
  ASSERT_TRUE(inproc.ok());
  EXPECT_TRUE(*inproc);
  EXPECT_FALSE(Transport::moves_bytes_over_shared_memory("ucx", {{"no_such_param", "1"}}).ok());
  EXPECT_FALSE(Transport::moves_bytes_over_shared_memory("nope", {}).ok());
}

// Issue 30: the tls in force never has a shared-memory transport whose memory other
// users' processes reach (sysv: segments mode 0660, the user's group attaches them;
// knem: a cookie), unless the param unsafe_shm says so. TransportTest.SharedMemoryIsOwnerOnly
// checks the segments themselves.
TEST(TransportBackendOptions, UcxSharedMemoryIsOwnerOnly) {
  using detail::ucx::owner_only_tls;
  const std::vector<std::string> debian = {"self", "tcp", "sysv", "posix", "cma"};  // Debian 12's UCX 1.13
  auto safe = [&](const std::string& tls, const std::vector<std::string>& available) {
    auto r = owner_only_tls(tls, available);
    EXPECT_TRUE(r.ok()) << tls << ": " << r.status().to_string();
    return r.ok() ? *r : std::string("?");
  };
  EXPECT_EQ(safe("sm,tcp,self", debian), "posix,cma,tcp,self");
  EXPECT_EQ(safe("sm,self,tcp", debian), "posix,cma,self,tcp");
  EXPECT_EQ(safe("shm,self", debian), "posix,cma,self");
  EXPECT_EQ(safe("mm,cma", debian), "posix,cma");
  EXPECT_EQ(safe("sm,posix,cma", debian), "posix,cma");  // no duplicates
  EXPECT_EQ(safe("sm,self", {"self", "sysv", "posix", "cma", "xpmem", "knem"}), "posix,cma,xpmem,self");
  EXPECT_EQ(safe("sm,self", {}), "posix,cma,xpmem,self");  // unknown availability: all of them
  EXPECT_EQ(safe("tcp,self", debian), "tcp,self");
  EXPECT_EQ(safe("posix,cma,tcp,self", debian), "posix,cma,tcp,self");
  EXPECT_EQ(safe("rc,ud:aux,sm", debian), "rc,ud:aux,posix,cma");
  EXPECT_EQ(safe("", debian), "^sysv,knem");     // UCX's default: every transport
  EXPECT_EQ(safe("all", debian), "^sysv,knem");
  EXPECT_EQ(safe("tcp,all", debian), "^sysv,knem");
  EXPECT_EQ(safe("^tcp", debian), "^tcp,sysv,knem");
  EXPECT_EQ(safe("^sysv", debian), "^sysv,knem");
  EXPECT_EQ(safe("^knem,sysv", debian), "^knem,sysv");
  for (const char* named : {"sysv", "sysv,tcp,self", "posix,knem"}) {
    auto r = owner_only_tls(named, debian);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << named;
    EXPECT_NE(r.status().message().find("unsafe_shm=1"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(std::string(named).find("knem") != std::string::npos ? "knem" : "sysv"),
              std::string::npos)
        << r.status().message();
  }
  // Through create: a tls naming sysv is refused, naming it and the param; with
  // unsafe_shm=1 it is the user's choice.
  CleanEnv env;
  TransportOptions o;
  o.backend = "ucx";
  o.params = {{"tls", "sysv,tcp,self"}, {"net_devices", "lo"}};
  Status st = Transport::create(o).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("sysv"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("unsafe_shm"), std::string::npos) << st.message();
  env.set("UCX_TLS", "sysv,tcp,self");  // UCX's own variable, when ferry sets no tls
  o.params = {{"net_devices", "lo"}};
  EXPECT_EQ(Transport::create(o).status().code(), StatusCode::kInvalidArgument);
  o.params = {{"tls", "sysv,tcp,self"}, {"net_devices", "lo"}, {"unsafe_shm", "1"}};
  auto t = Transport::create(o);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_EQ(resolved({{"unsafe_shm", "yes"}})["unsafe_shm"], "1");
}

// The device follows the route to route_to (the tools pass the store's host), unless the
// user named one; an address with no route, or no address at all, is an error naming it.
TEST(TransportBackendOptions, UcxRouteToPicksTheInterface) {
  CleanEnv env;
  auto lo = resolved({{"route_to", "127.0.0.1"}});
  EXPECT_EQ(lo["net_devices"], "lo");
  EXPECT_EQ(lo["route_to"], "127.0.0.1");
  // route_to wins over one_host's loopback (several hosts, ranks on each use sm within).
  EXPECT_EQ(resolved({{"route_to", "localhost"}, {"one_host", "1"}})["net_devices"], "lo");
  EXPECT_EQ(resolved({{"route_to", "127.0.0.1"}, {"net_devices", "eth7"}})["net_devices"], "eth7");
  env.set("UCX_NET_DEVICES", "eth7");
  EXPECT_EQ(resolved({{"route_to", "127.0.0.1"}})["net_devices"], "");  // UCX reads the variable itself
  ::unsetenv("UCX_NET_DEVICES");
  auto bad = Transport::resolve_params("ucx", {{"route_to", "no-such-host.invalid"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("no-such-host.invalid"), std::string::npos) << bad.status().to_string();
  auto empty = Transport::resolve_params("ucx", {{"route_to", ""}});
  EXPECT_FALSE(empty.ok());
}

// What memory a transport can move is detected, never assumed: the ucx backend says it
// moves CUDA memory exactly when UCX here has transports for it (the oracle: `ucx_info
// -d`, run beside it, lists a cuda_copy / cuda_ipc / gdr_copy transport), and otherwise
// refuses to register CUDA memory saying why; inproc moves host memory only.
TEST(TransportMemory, CudaSupportIsWhatUcxInfoLists) {
  FILE* f = ::popen("ucx_info -d 2>/dev/null", "r");
  ASSERT_NE(f, nullptr);
  std::string listed;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) listed.append(buf, n);
  const int rc = ::pclose(f);
  if (rc != 0 || listed.find("Transport:") == std::string::npos) GTEST_SKIP() << "ucx_info -d did not run here";
  bool cuda_listed = false;
  for (const char* tl : {"Transport: cuda_copy", "Transport: cuda_ipc", "Transport: gdr_copy"}) {
    cuda_listed |= listed.find(tl) != std::string::npos;
  }
  TransportOptions o;
  o.backend = "ucx";
  o.params = {{"tls", "all"}};
  auto t = Transport::create(o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_TRUE((*t)->supports_memory(MemoryKind::kHost));
  EXPECT_EQ((*t)->supports_memory(MemoryKind::kCuda), cuda_listed) << (*t)->memory_support();
  if (!cuda_listed) {
    EXPECT_NE((*t)->memory_support().find("host only"), std::string::npos) << (*t)->memory_support();
    static std::byte some[4096];
    auto r = (*t)->register_memory(some, sizeof(some), MemoryKind::kCuda);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(r.status().message().find("lists no CUDA memory type"), std::string::npos) << r.status().to_string();
  } else {
    EXPECT_NE((*t)->memory_support().find("cuda"), std::string::npos) << (*t)->memory_support();
  }
  TransportOptions in;
  in.backend = "inproc";
  auto ti = Transport::create(in);
  ASSERT_TRUE(ti.ok()) << ti.status().to_string();
  EXPECT_TRUE((*ti)->supports_memory(MemoryKind::kHost));
  EXPECT_FALSE((*ti)->supports_memory(MemoryKind::kCuda));
}

}  // namespace
}  // namespace ferry
