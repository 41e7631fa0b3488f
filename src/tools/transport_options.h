// The one place where the tools (the rank workers of `ferry demo`, of the multi-process
// tests and of `ferry bench`) build a Transport's options, so that a change to how a
// backend is configured is made here alone. The tools know no backend's knobs beyond two
// a backend may declare: `one_host` (every rank on this host) and `route_to` (the host
// whose route picks the network interface); ucx: docs/transport.md "Backend options".
#pragma once

#include <string>

#include "ferry/transport.h"

namespace ferry::tools {

// The options of a worker's transport, with `tls` (the ucx backend's transport list) when
// not empty. `store_url` empty or naming a loopback host: every rank is on this host, and
// the worker gets the backend's one-host settings. Another host: the store's host is the
// machine every rank reaches, so the worker's network interface is the one routing to
// it (ucx param route_to; docs/multihost.md). An unparsable URL counts as one host (the
// store's open reports it).
TransportOptions worker_transport_options(const std::string& backend, const std::string& tls = "",
                                          const std::string& store_url = "");

// Whether `host` (an IP address or a name) is this host's loopback: 127.0.0.0/8, ::1,
// "localhost", or empty.
bool is_loopback_host(const std::string& host);

// The transport list a worker gets when the tools pass none (ucx: $FERRY_UCX_TLS, else
// sm,tcp,self); empty for a backend without one. For reports and for choosing MPI's fabric.
std::string default_worker_tls(const std::string& backend = "ucx");

}  // namespace ferry::tools
