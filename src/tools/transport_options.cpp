#include "tools/transport_options.h"

#include <arpa/inet.h>

#include <cstdlib>

#include "ferry/store.h"

namespace ferry::tools {

bool is_loopback_host(const std::string& host) {
  if (host.empty() || host == "localhost" || host == "::1" || host == "[::1]") return true;
  in_addr a{};
  return ::inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

TransportOptions worker_transport_options(const std::string& backend, const std::string& tls,
                                          const std::string& store_url) {
  TransportOptions to;
  to.backend = backend;
  // The job's token (the store's, which demo and bench hand their workers): the data
  // plane then serves only peers that prove it (docs/transport.md, "Authentication").
  if (const char* token = std::getenv("FERRY_TOKEN")) to.token = token;
  auto info = Transport::backend_info(backend);
  if (!info.ok()) return to;
  std::string store_host;
  if (auto url = parse_store_url(store_url); !store_url.empty() && url.ok()) store_host = url->host;
  if (!is_loopback_host(store_host) && info->accepts("route_to")) {
    to.params = {{"route_to", store_host}};
  } else if (info->accepts("one_host")) {
    to.params = {{"one_host", "1"}};
  } else {
    return to;
  }
  if (!tls.empty()) to.params["tls"] = tls;
  return to;
}

std::string default_worker_tls(const std::string& backend) {
  auto resolved = Transport::resolve_params(backend, worker_transport_options(backend).params);
  if (resolved.ok() && resolved->contains("tls")) return resolved->at("tls");
  return {};
}

}  // namespace ferry::tools
