#include "tools/transport_options.h"

namespace ferry::tools {

TransportOptions worker_transport_options(const std::string& backend, const std::string& tls) {
  TransportOptions to;
  to.backend = backend;
  if (auto info = Transport::backend_info(backend); info.ok() && info->accepts("one_host")) {
    to.params = {{"one_host", "1"}};
    if (!tls.empty()) to.params["tls"] = tls;
  }
  return to;
}

std::string default_worker_tls(const std::string& backend) {
  auto resolved = Transport::resolve_params(backend, worker_transport_options(backend).params);
  if (resolved.ok() && resolved->contains("tls")) return resolved->at("tls");
  return {};
}

}  // namespace ferry::tools
