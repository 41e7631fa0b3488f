#include "tools/transport_options.h"

namespace ferry::tools {

TransportOptions worker_transport_options(const std::string& backend, const std::string& tls) {
  TransportOptions to;
  to.backend = backend;
  if (backend == "ucx") {
    to.ucx_config = {{"TLS", tls}};
    if (tls.find("tcp") != std::string::npos) to.ucx_config.push_back({"NET_DEVICES", "lo"});
  }
  return to;
}

}  // namespace ferry::tools
