// transport/ucx/config.h — the UCX backend's options: what TransportOptions::params
// may say for backend "ucx", the FERRY_UCX_* environment variables, and how both
// become the UCX configuration of ucp_init. The one place in ferry that reads
// FERRY_UCX_* (read_env, config.cpp).
//
// Params (TransportOptions::params; defaults in brackets):
//   tls           [unset]  UCX_TLS of this transport; unset: the UCX_TLS environment
//                          variable, else UCX's own default (every transport).
//   net_devices   [unset]  UCX_NET_DEVICES; unset: the environment's, else UCX's.
//   ucx.<KEY>     [-]      any other UCX setting, e.g. ucx.RNDV_THRESH=8k (KEY without
//                          the UCX_ prefix); ucx.TLS / ucx.NET_DEVICES are tls /
//                          net_devices (giving both forms is refused).
//   route_to      [unset]  an address (IPv4/IPv6 or a host name) of a machine this rank
//                          talks to, e.g. the store's host: when neither net_devices
//                          nor UCX_NET_DEVICES says otherwise, net_devices is the
//                          network interface carrying this host's route to it (lo when
//                          the address is local). kUnavailable when there is no route.
//                          tls defaults to FERRY_UCX_TLS when set, else UCX's own.
//   one_host      [0]      every peer runs on this host (ferry's demo and bench
//                          workers): tls defaults to FERRY_UCX_TLS, else sm,tcp,self
//                          (bytes over shared memory, messages over tcp); when the tls
//                          in force names tcp and neither net_devices, UCX_NET_DEVICES
//                          nor route_to is set, net_devices=lo.
//   tcp_control   [1]      when tls lists shared-memory transports but none with
//                          peer-failure support (sm,self), add tcp (on lo unless
//                          net_devices says otherwise) for messages and failure
//                          reports; 0: use tls exactly (same-host peers watched by pidfd).
//   keepalive_ms  [500]    UCX keepalive interval (ucx.KEEPALIVE_INTERVAL wins).
//   spin_us       [0]      how long the idle progress thread spins after its last
//                          activity before sleeping on the event fd.
//   busy_spin_us  [0]      the same with operations in flight.
//   reads         [auto]   auto | message | rma: force reads/writes by message or by
//                          UCX get/put (tests, diagnostics).
//   ep_info       [0]      print each peer's UCX lanes after its first read/write.
//   unsafe_shm    [0]      1: let UCX use its shared-memory transports whose memory other
//                          users' processes can reach (sysv: segments mode 0660, any
//                          process of the user's group attaches them by id; knem:
//                          regions reached by a cookie). 0: they are left out of the tls
//                          in force (owner_only_tls), and a tls naming one is refused.
// Booleans: 0/1, false/true, off/on, no/yes. Numbers: decimal, >= 0.
//
// Precedence, exactly as before the params existed: default <- param <- FERRY_UCX_*
// environment variable, the variable winning:
//   FERRY_UCX_TCP_CONTROL  tcp_control (0/false/off/no: off; any other value: on)
//   FERRY_UCX_SPIN_US      spin_us
//   FERRY_UCX_BUSY_SPIN_US busy_spin_us
//   FERRY_UCX_READS        reads (message | rma; other values: no override)
//   FERRY_UCX_EP_INFO      ep_info (set, to anything: on)
// except FERRY_UCX_TLS, which is the default of tls under one_host or route_to only (a
// tls param wins: `ferry bench --tls` over the variable), and is ignored otherwise. The UCX_*
// variables are UCX's: params (tls, net_devices, ucx.<KEY>) are applied on top of them.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::detail::ucx {

// The tls of one_host when FERRY_UCX_TLS is not set.
inline constexpr const char* kOneHostTls = "sm,tcp,self";

// With operations in flight, the progress thread spins at most kBusySpin after the last
// event, then sleeps on the event fd as an idle one does (at most kBusySleep, a safety
// net for a transport that raises no event; ucx_backend.h). Spinning for as long as operations were in
// flight made tcp reads 2-3x slower on a loaded 2-core machine: the spinning initiator
// and target took the CPU from the threads that had work (the peer's copy, the caller
// posting the next read), while a tcp arrival wakes the fd at once. Any spin longer
// than the gap between two arrivals (~50 us per 64 KiB at 1.3 GB/s) is a full spin:
// 20 and 100 us measured between that and no spin, 0 best (docs/RESULTS.md).
// The default of busy_spin_us (FERRY_UCX_BUSY_SPIN_US overrides it).
inline constexpr auto kBusySpin = std::chrono::microseconds(0);

// The environment variables the backend reads, read once per create (read_env).
struct UcxEnv {
  std::optional<std::string> ferry_tls, tcp_control, spin_us, busy_spin_us, reads, ep_info;  // FERRY_UCX_*
  std::optional<std::string> ucx_tls, ucx_net_devices;  // UCX_TLS, UCX_NET_DEVICES (what UCX sees)
};
UcxEnv read_env();

// The parsed, validated options of one transport.
struct UcxConfig {
  std::optional<std::string> tls;          // the TLS ferry sets (nullopt: UCX's own)
  std::optional<std::string> net_devices;  // the NET_DEVICES ferry sets
  std::optional<std::string> route_to;     // the address whose route chose net_devices
  std::vector<std::pair<std::string, std::string>> ucx;  // every other ucx.<KEY>, KEY -> value
  bool one_host = false;
  bool tcp_control = true;
  std::chrono::milliseconds keepalive{500};
  std::chrono::microseconds spin{0};
  std::chrono::microseconds busy_spin = kBusySpin;
  std::optional<bool> forced_reads;  // true: by message; false: by UCX get/put; nullopt: auto
  bool ep_info = false;
  bool unsafe_shm = false;
  // What UCX reads from its environment (for the tcp_control decision).
  std::optional<std::string> env_tls, env_net_devices;
};

const BackendInfo& backend_info();
// kInvalidArgument for an unknown or malformed param (naming it, listing the options).
Result<UcxConfig> parse_config(const TransportParams& params, const UcxEnv& env);
// Every option's value in force (resolve_params): tls "" when UCX's own.
TransportParams describe(const UcxConfig& cfg);

// The name of the network interface that carries this host's route to `host` (an IP
// address or a name that resolves to one): the interface holding the source address the
// kernel picks for it ("lo" for a local address). No packet is sent. kInvalidArgument
// when `host` does not resolve, kUnavailable when there is no route or no interface
// holds the source address; both name the host.
Result<std::string> route_device(const std::string& host);

// Whether UCX_TLS `tls` lets UCX move bytes between processes of one host over shared
// memory: empty (UCX's default, every transport) or "all"; a list naming one of
// sm, shm, mm, posix, sysv, cma, xpmem, knem; an exclusion list ("^a,b") naming none of
// them (one naming any counts as none: conservative).
bool tls_has_shared_memory(const std::string& tls);

// Whether UCX_TLS `tls` lists shared-memory transports and none with peer-failure
// support: then tcp_control adds tcp. A "^..." list (everything but) or "all" already
// has tcp unless the user excluded it.
bool needs_tcp_control(const std::string& tls);

// Shared memory that only this user's processes reach (issue 30). UCX 1.13 creates the
// segments of its transports as follows (src/uct/sm/...):
//   posix  a /dev/shm file of mode 0600, unlinked at once and shared as
//          /proc/<pid>/fd/<fd> (UCX_POSIX_USE_PROC_LINK=y): only a process of the same
//          uid that may ptrace-read the owner opens it;
//   cma    process_vm_readv/writev: the kernel's ptrace-attach check (same uid);
//   xpmem  xpmem_make(..., XPMEM_PERMIT_MODE, 0600);
//   sysv   shmget(IPC_PRIVATE, S_IRUSR|S_IWUSR|S_IRGRP|S_IWGRP): mode 0660, hard-coded,
//          no UCX option changes it; `ipcs` lists the ids, so any process of the user's
//          group attaches and writes every segment (the receive FIFOs, allocate_memory's
//          regions) without a key or the token;
//   knem   a region is reached by its cookie alone.
// So sysv and knem are left out: `tls` (UCX_TLS syntax; empty or "all": every transport)
// without them. An allow list has the aliases sm/shm (posix, sysv, xpmem, knem, cma) and
// mm (posix, sysv, xpmem) spelled out without sysv and knem, keeping only transports in
// `available` (UCX warns about a named transport it does not have; empty: all of them);
// an exclusion list ("^...") and "all" get ",sysv,knem" / "^sysv,knem". A list naming sysv
// or knem itself is refused (kInvalidArgument, naming it and the unsafe_shm param).
inline constexpr const char* kUnsafeShmTls[] = {"sysv", "knem"};
Result<std::string> owner_only_tls(const std::string& tls, const std::vector<std::string>& available);

// The UCX components (transports) this host's UCX has: uct_query_components. Empty when
// the query fails.
std::vector<std::string> available_components();

// Applies `cfg` to a configuration from ucp_config_read: tls, net_devices, ucx.<KEY>,
// keepalive, then tcp for control messages (tcp_control), then the tls in force made
// owner-only (owner_only_tls, unless unsafe_shm). kInvalidArgument when UCX refuses a
// setting or the tls names a transport that is not owner-only.
Status apply(const UcxConfig& cfg, ucp_config_t* config);

}  // namespace ferry::detail::ucx
