// The one place where the tools (the rank workers of `ferry demo`, of the multi-process
// tests and of `ferry bench`) build a Transport's options, so that a change to how a
// backend is configured is made here alone.
#pragma once

#include <string>

#include "ferry/transport.h"

namespace ferry::tools {

// The workers' UCX_TLS unless told otherwise: bytes over shared memory, messages over
// loopback tcp (see DemoSpec::ucx_tls).
inline constexpr const char* kDefaultUcxTls = "sm,tcp,self";

// The options of a worker's transport on this host. Backend "ucx": UCX_TLS `tls`, and
// UCX_NET_DEVICES lo when `tls` names tcp (every rank on one host). Other backends take
// no configuration here.
TransportOptions worker_transport_options(const std::string& backend, const std::string& tls);

}  // namespace ferry::tools
