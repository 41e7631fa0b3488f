// The one place where the tools (the rank workers of `ferry demo`, of the multi-process
// tests and of `ferry bench`) build a Transport's options, so that a change to how a
// backend is configured is made here alone. The tools know no backend's knobs: every
// rank runs on this host, so they ask for the backend's one-host settings (param
// `one_host`, where the backend declares it; ucx: docs/transport.md "Backend options").
#pragma once

#include <string>

#include "ferry/transport.h"

namespace ferry::tools {

// The options of a worker's transport on this host: the backend's one-host settings,
// with `tls` (the ucx backend's transport list) when not empty.
TransportOptions worker_transport_options(const std::string& backend, const std::string& tls = "");

// The transport list a worker gets when the tools pass none (ucx: $FERRY_UCX_TLS, else
// sm,tcp,self); empty for a backend without one. For reports and for choosing MPI's fabric.
std::string default_worker_tls(const std::string& backend = "ucx");

}  // namespace ferry::tools
