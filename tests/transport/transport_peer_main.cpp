// transport_peer: the remote rank of the UCX transport tests, a separate process.
//   transport_peer --tls TLS --bytes N --parent HEX_ADDRESS [--tcp-control 0|1]
// Prints "READY <address hex> <key hex>" on stdout, then serves messages until it is
// told to exit (kExit), its stdin reaches EOF (the parent died or closed the pipe),
// or 120 s pass.
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "transport/peer_service.h"
#include "transport/protocol.h"

using namespace ferry;
using namespace ferry::transport_test;

int main(int argc, char** argv) {
  std::string tls, parent_hex;
  uint64_t bytes = 0;
  bool tcp_control = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--tls") tls = argv[i + 1];
    else if (k == "--bytes") bytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (k == "--parent") parent_hex = argv[i + 1];
    else if (k == "--tcp-control") tcp_control = std::strcmp(argv[i + 1], "0") != 0;
  }
  std::vector<std::byte> parent;
  if (tls.empty() || bytes == 0 || !from_hex(parent_hex, &parent)) {
    std::fprintf(stderr, "usage: transport_peer --tls TLS --bytes N --parent HEX\n");
    return 2;
  }
  TransportOptions opt;
  opt.backend = "ucx";
  opt.params = {{"tls", tls}, {"net_devices", "lo"}, {"tcp_control", tcp_control ? "1" : "0"}};
  auto t = Transport::create(opt);
  if (!t.ok()) {
    std::fprintf(stderr, "transport_peer: %s\n", t.status().to_string().c_str());
    return 1;
  }
  auto svc = PeerService::start(**t, bytes, parent);
  if (!svc.ok()) {
    std::fprintf(stderr, "transport_peer: %s\n", svc.status().to_string().c_str());
    return 1;
  }
  std::string line = "READY " + to_hex((*t)->address()) + " " + to_hex((*svc)->key()) + "\n";
  if (write(1, line.data(), line.size()) != ssize_t(line.size())) return 1;

  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!(*svc)->exit_requested() && std::chrono::steady_clock::now() < deadline) {
    pollfd p{0, POLLIN, 0};
    int r = poll(&p, 1, 50);
    if (r > 0) {
      char buf[64];
      ssize_t n = read(0, buf, sizeof buf);
      if (n <= 0) break;  // parent gone
    }
  }
  svc->reset();
  t->reset();
  return 0;
}
