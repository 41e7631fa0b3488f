// The UCX backend's options (see config.h): declaration, parsing, the environment,
// and the UCX configuration they make.
#include "transport/ucx/config.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include <uct/api/uct.h>

#include "transport/backend.h"

namespace ferry::detail::ucx {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

Result<bool> parse_bool(std::string_view name, const std::string& v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  return bad_param(backend_info(), name, v, "0 or 1 (false/true, off/on, no/yes)");
}

Result<uint64_t> parse_count(std::string_view name, const std::string& v) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
    return bad_param(backend_info(), name, v, "a non-negative decimal integer");
  }
  return n;
}

// Sets `slot` from param `name`; refuses a second form of the same setting.
Status set_once(std::optional<std::string>& slot, std::string_view name, const std::string& value,
                std::string_view other) {
  if (slot) {
    return invalid_argument("transport backend 'ucx': params '{}' and '{}' set the same UCX setting; give one",
                            name, other);
  }
  slot = value;
  return Status::Ok();
}

}  // namespace

UcxEnv read_env() {
  UcxEnv e;
  e.ferry_tls = env("FERRY_UCX_TLS");
  e.tcp_control = env("FERRY_UCX_TCP_CONTROL");
  e.spin_us = env("FERRY_UCX_SPIN_US");
  e.busy_spin_us = env("FERRY_UCX_BUSY_SPIN_US");
  e.reads = env("FERRY_UCX_READS");
  e.ep_info = env("FERRY_UCX_EP_INFO");
  e.ucx_tls = env("UCX_TLS");
  e.ucx_net_devices = env("UCX_NET_DEVICES");
  return e;
}

const BackendInfo& backend_info() {
  static const BackendInfo info{
      "ucx",
      "UCP get/put and active messages over whatever UCX transports the host has (shm/cma, tcp, verbs)",
      {
          {"tls", "", "UCX_TLS of this transport; unset: the UCX_TLS variable, else UCX's default"},
          {"net_devices", "", "UCX_NET_DEVICES; unset: the UCX_NET_DEVICES variable, else UCX's default"},
          {"ucx.", "", "any UCX setting KEY (without UCX_), e.g. ucx.RNDV_THRESH=8k; ucx.TLS is tls"},
          {"route_to", "",
           "an address this rank talks to (e.g. the store's host): net_devices defaults to the interface routing to it"},
          {"one_host", "0",
           "every peer on this host: tls defaults to $FERRY_UCX_TLS, else sm,tcp,self; net_devices=lo if tls has tcp "
           "(unless net_devices, UCX_NET_DEVICES or route_to says otherwise)"},
          {"tcp_control", "1",
           "add tcp for messages and failure reports when tls has shared memory only (FERRY_UCX_TCP_CONTROL wins)"},
          {"keepalive_ms", "500", "UCX keepalive interval: bounds how long a silent dead peer goes unnoticed"},
          {"spin_us", "0", "idle progress thread spins this long before sleeping (FERRY_UCX_SPIN_US wins)"},
          {"busy_spin_us", "0", "the same with operations in flight (FERRY_UCX_BUSY_SPIN_US wins)"},
          {"reads", "auto", "auto | message | rma: force reads/writes by message or UCX get/put (FERRY_UCX_READS wins)"},
          {"ep_info", "0", "print each peer's UCX lanes after its first read/write (FERRY_UCX_EP_INFO wins)"},
          {"unsafe_shm", "0",
           "1: also use UCX's sysv and knem transports, whose memory other users' processes reach (sysv: mode 0660, "
           "the user's group); 0: left out of tls"},
      }};
  return info;
}

Result<UcxConfig> parse_config(const TransportParams& params, const UcxEnv& e) {
  FERRY_RETURN_IF_ERROR(check_params(backend_info(), params));
  UcxConfig c;
  c.env_tls = e.ucx_tls;
  c.env_net_devices = e.ucx_net_devices;
  for (const auto& [name, value] : params) {
    if (name == "tls") {
      FERRY_RETURN_IF_ERROR(set_once(c.tls, name, value, "ucx.TLS"));
    } else if (name == "ucx.TLS") {
      FERRY_RETURN_IF_ERROR(set_once(c.tls, name, value, "tls"));
    } else if (name == "net_devices") {
      FERRY_RETURN_IF_ERROR(set_once(c.net_devices, name, value, "ucx.NET_DEVICES"));
    } else if (name == "ucx.NET_DEVICES") {
      FERRY_RETURN_IF_ERROR(set_once(c.net_devices, name, value, "net_devices"));
    } else if (name.starts_with("ucx.")) {
      c.ucx.emplace_back(name.substr(4), value);
    } else if (name == "route_to") {
      if (value.empty()) return bad_param(backend_info(), name, value, "an IP address or a host name");
      c.route_to = value;
    } else if (name == "one_host") {
      FERRY_ASSIGN_OR_RETURN(c.one_host, parse_bool(name, value));
    } else if (name == "tcp_control") {
      FERRY_ASSIGN_OR_RETURN(c.tcp_control, parse_bool(name, value));
    } else if (name == "ep_info") {
      FERRY_ASSIGN_OR_RETURN(c.ep_info, parse_bool(name, value));
    } else if (name == "unsafe_shm") {
      FERRY_ASSIGN_OR_RETURN(c.unsafe_shm, parse_bool(name, value));
    } else if (name == "keepalive_ms") {
      FERRY_ASSIGN_OR_RETURN(uint64_t n, parse_count(name, value));
      c.keepalive = std::chrono::milliseconds(n);
    } else if (name == "spin_us") {
      FERRY_ASSIGN_OR_RETURN(uint64_t n, parse_count(name, value));
      c.spin = std::chrono::microseconds(n);
    } else if (name == "busy_spin_us") {
      FERRY_ASSIGN_OR_RETURN(uint64_t n, parse_count(name, value));
      c.busy_spin = std::chrono::microseconds(n);
    } else if (name == "reads") {
      if (value == "message") {
        c.forced_reads = true;
      } else if (value == "rma") {
        c.forced_reads = false;
      } else if (value != "auto") {
        return bad_param(backend_info(), name, value, "auto, message or rma");
      }
    }
  }
  // The environment overrides, parsed as they always were (diagnostics, benchmarks).
  if (e.tcp_control) {
    const std::string_view v(*e.tcp_control);
    c.tcp_control = !(v == "0" || v == "false" || v == "off" || v == "no");
  }
  if (e.spin_us) c.spin = std::chrono::microseconds(std::atoll(e.spin_us->c_str()));
  if (e.busy_spin_us) c.busy_spin = std::chrono::microseconds(std::atoll(e.busy_spin_us->c_str()));
  if (e.reads && *e.reads == "message") c.forced_reads = true;
  if (e.reads && *e.reads == "rma") c.forced_reads = false;
  if (e.ep_info) c.ep_info = true;
  // FERRY_UCX_TLS selects the transports of the tools' workers (one_host or route_to).
  if ((c.one_host || c.route_to) && !c.tls && e.ferry_tls && !e.ferry_tls->empty()) c.tls = *e.ferry_tls;
  // Every peer on this host: bytes over shared memory, messages over tcp.
  if (c.one_host && !c.tls) c.tls = std::string(kOneHostTls);
  // The device: what the user named (the param, then UCX_NET_DEVICES), else the interface
  // this host reaches route_to through, else loopback when every peer is on this host.
  // UCX's own default (every device) is wrong on a host with several interfaces: it
  // offers peers addresses (lo, a docker bridge) they cannot reach, or reach elsewhere.
  if (!c.net_devices && !e.ucx_net_devices) {
    if (c.route_to) {
      FERRY_ASSIGN_OR_RETURN(c.net_devices, route_device(*c.route_to));
    } else if (c.one_host && c.tls && c.tls->find("tcp") != std::string::npos) {
      c.net_devices = "lo";
    }
  }
  return c;
}

TransportParams describe(const UcxConfig& c) {
  TransportParams p;
  p["tls"] = c.tls.value_or("");
  p["net_devices"] = c.net_devices.value_or("");
  for (const auto& [k, v] : c.ucx) p["ucx." + k] = v;
  p["route_to"] = c.route_to.value_or("");
  p["one_host"] = c.one_host ? "1" : "0";
  p["tcp_control"] = c.tcp_control ? "1" : "0";
  p["keepalive_ms"] = std::to_string(c.keepalive.count());
  p["spin_us"] = std::to_string(c.spin.count());
  p["busy_spin_us"] = std::to_string(c.busy_spin.count());
  p["reads"] = !c.forced_reads ? "auto" : *c.forced_reads ? "message" : "rma";
  p["ep_info"] = c.ep_info ? "1" : "0";
  p["unsafe_shm"] = c.unsafe_shm ? "1" : "0";
  return p;
}

Result<std::string> route_device(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found); rc != 0 || found == nullptr) {
    return invalid_argument("ucx: route_to '{}': not an address or a host name that resolves ({})", host,
                            ::gai_strerror(rc));
  }
  // connect() on a datagram socket only asks the kernel for the route: no packet leaves.
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  int err = fd < 0 ? errno : 0;
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) != 0) err = errno;
  if (fd >= 0 && err == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) err = errno;
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  if (err != 0) return unavailable("ucx: route_to '{}': no route to it from this host ({})", host, std::strerror(err));
  char text[INET6_ADDRSTRLEN] = "?";
  const void* raw = local.ss_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                                               : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
  ::inet_ntop(local.ss_family, raw, text, sizeof(text));
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return unavailable("ucx: route_to '{}': getifaddrs: {}", host, std::strerror(errno));
  std::optional<std::string> device;
  for (ifaddrs* i = ifs; i != nullptr && !device; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != local.ss_family) continue;
    const bool same = local.ss_family == AF_INET
                          ? std::memcmp(&reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr,
                                        &reinterpret_cast<sockaddr_in*>(&local)->sin_addr, sizeof(in_addr)) == 0
                          : std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                                        &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, sizeof(in6_addr)) == 0;
    if (same) device = i->ifa_name;
  }
  ::freeifaddrs(ifs);
  if (!device) {
    return unavailable("ucx: route_to '{}': no interface holds the source address {} of the route to it", host, text);
  }
  return *device;
}

namespace {

// UCX_TLS names of the shared-memory transports, with UCX's aliases for them (sm and shm:
// all of them; mm: posix, sysv and xpmem).
constexpr const char* kSharedMemoryTls[] = {"sm", "shm", "mm", "posix", "sysv", "cma", "xpmem", "knem"};

bool is_shared_memory_tl(std::string_view tl) {
  for (const char* shm : kSharedMemoryTls) {
    if (tl == shm) return true;
  }
  return false;
}

}  // namespace

bool tls_has_shared_memory(const std::string& tls) {
  if (tls.empty()) return true;
  const bool excluding = tls.starts_with('^');
  const std::string_view rest = std::string_view(tls).substr(excluding ? 1 : 0);
  bool listed = false;
  for (size_t at = 0; at <= rest.size();) {
    const size_t comma = std::min(rest.find(',', at), rest.size());
    const std::string_view tl = rest.substr(at, comma - at);
    at = comma + 1;
    listed |= is_shared_memory_tl(tl) || (!excluding && tl == "all");
  }
  return excluding != listed;
}

bool needs_tcp_control(const std::string& tls) {
  if (tls.empty() || tls.starts_with('^')) return false;
  bool shm = false;
  for (size_t at = 0; at <= tls.size();) {
    const size_t comma = std::min(tls.find(',', at), tls.size());
    const std::string tl = tls.substr(at, comma - at);
    at = comma + 1;
    for (const char* net : {"all", "tcp", "ib", "rc", "ud", "dc", "rc_v", "rc_x", "ud_v", "ud_x", "dc_x", "rc_mlx5",
                            "ud_mlx5", "dc_mlx5", "rc_verbs", "ud_verbs"}) {
      if (tl == net) return false;
    }
    shm |= is_shared_memory_tl(tl);
  }
  return shm;
}

namespace {

std::vector<std::string_view> split_tls(std::string_view list) {
  std::vector<std::string_view> out;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (comma > at) out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

bool is_unsafe_shm_tl(std::string_view tl) {
  return std::find(std::begin(kUnsafeShmTls), std::end(kUnsafeShmTls), tl) != std::end(kUnsafeShmTls);
}

}  // namespace

Result<std::string> owner_only_tls(const std::string& tls, const std::vector<std::string>& available) {
  auto has = [&](std::string_view tl) {
    return available.empty() || std::find(available.begin(), available.end(), tl) != available.end();
  };
  auto join = [](const std::vector<std::string_view>& tls) {
    std::string s;
    for (std::string_view tl : tls) s.append(s.empty() ? "" : ",").append(tl);
    return s;
  };
  std::vector<std::string_view> list = split_tls(tls.starts_with('^') ? std::string_view(tls).substr(1) : tls);
  const bool excluding = tls.starts_with('^');
  if (list.empty() || (!excluding && std::find(list.begin(), list.end(), "all") != list.end())) {
    list.clear();  // every transport
  } else if (!excluding) {
    std::vector<std::string_view> out;
    auto add = [&](std::string_view tl) {
      if (has(tl) && std::find(out.begin(), out.end(), tl) == out.end()) out.push_back(tl);
    };
    for (std::string_view tl : list) {
      if (is_unsafe_shm_tl(tl)) {
        return invalid_argument(
            "ucx: UCX_TLS={} names {}, whose shared memory other users' processes can reach (sysv segments are "
            "mode 0660: any process of the user's group attaches them; knem regions are reached by a cookie): "
            "leave it out (sm or posix,cma share owner-only memory), or set the ucx param unsafe_shm=1",
            tls, tl);
      }
      if (tl == "sm" || tl == "shm") {
        for (const char* safe : {"posix", "cma", "xpmem"}) add(safe);
      } else if (tl == "mm") {
        for (const char* safe : {"posix", "xpmem"}) add(safe);
      } else if (std::find(out.begin(), out.end(), tl) == out.end()) {
        out.push_back(tl);  // as given (UCX warns about one it does not have)
      }
    }
    return join(out);
  }
  for (const char* unsafe : kUnsafeShmTls) {
    if (std::find(list.begin(), list.end(), unsafe) == list.end()) list.push_back(unsafe);
  }
  return "^" + join(list);
}

std::vector<std::string> available_components() {
  std::vector<std::string> names;
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (uct_query_components(&components, &count) != UCS_OK) return names;
  for (unsigned i = 0; i < count; ++i) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    if (uct_component_query(components[i], &attr) == UCS_OK) names.emplace_back(attr.name);
  }
  uct_release_component_list(components);
  return names;
}

Status apply(const UcxConfig& c, ucp_config_t* config) {
  std::vector<std::pair<std::string, std::string>> settings;
  if (c.tls) settings.emplace_back("TLS", *c.tls);
  if (c.net_devices) settings.emplace_back("NET_DEVICES", *c.net_devices);
  settings.insert(settings.end(), c.ucx.begin(), c.ucx.end());
  bool keepalive_set = false;
  std::optional<std::string> tls = c.env_tls, net_devices = c.env_net_devices;  // as UCX will see them
  for (const auto& [k, v] : settings) {
    if (k == "KEEPALIVE_INTERVAL") keepalive_set = true;
    if (k == "TLS") tls = v;
    if (k == "NET_DEVICES") net_devices = v;
    ucs_status_t st = ucp_config_modify(config, k.c_str(), v.c_str());
    if (st != UCS_OK) return invalid_argument("ucx: setting {}={}: {}", k, v, ucs_status_string(st));
  }
  if (!keepalive_set) {
    std::string ka = std::to_string(c.keepalive.count()) + "ms";
    ucp_config_modify(config, "KEEPALIVE_INTERVAL", ka.c_str());  // best effort
  }
  if (c.tcp_control && tls && needs_tcp_control(*tls)) {
    // Messages must not go over shared memory (see ucx_backend.h): tcp carries them.
    // The list had no network transport, so loopback is all tcp needs.
    const std::string with_tcp = *tls + ",tcp";
    ucs_status_t st = ucp_config_modify(config, "TLS", with_tcp.c_str());
    if (st == UCS_OK && !net_devices) st = ucp_config_modify(config, "NET_DEVICES", "lo");
    if (st != UCS_OK) {
      return invalid_argument("ucx: adding tcp to UCX_TLS={} for control messages: {}", *tls, ucs_status_string(st));
    }
    tls = with_tcp;
  }
  if (!c.unsafe_shm) {
    // Shared memory only this user's processes reach (issue 30; config.h).
    const std::string in_force = tls.value_or("");
    FERRY_ASSIGN_OR_RETURN(std::string owner_only, owner_only_tls(in_force, available_components()));
    if (owner_only.empty()) {
      return invalid_argument("ucx: UCX_TLS={} leaves no transport once sysv and knem are left out", in_force);
    }
    if (owner_only != in_force) {
      ucs_status_t st = ucp_config_modify(config, "TLS", owner_only.c_str());
      if (st != UCS_OK) {
        return invalid_argument("ucx: setting UCX_TLS={} (owner-only shared memory): {}", owner_only,
                                ucs_status_string(st));
      }
    }
  }
  return Status::Ok();
}

}  // namespace ferry::detail::ucx
