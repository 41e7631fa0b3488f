// `ferry store`: runs the embedded TCP store server in the foreground until SIGINT or
// SIGTERM, printing the URL clients pass to Store::open.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli/command.h"
#include "ferry/store.h"

namespace {

struct StoreArgs {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
};

int run_store(const StoreArgs& args) {
  if (args.port < 0 || args.port > 65535) {
    std::fprintf(stderr, "ferry store: --port %d is outside 0..65535\n", args.port);
    return 2;
  }
  // Block the stop signals before the server thread starts, so that it inherits the
  // mask and sigwait() below is the only place they are delivered.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  ferry::StoreServerOptions options;
  options.host = args.host;
  options.port = static_cast<uint16_t>(args.port);
  options.token = args.token;  // empty: FERRY_TOKEN
  auto server = ferry::StoreServer::start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "ferry store: %s\n", server.status().to_string().c_str());
    return 1;
  }
  std::printf("ferry store: serving %s (stop with Ctrl-C or SIGTERM)\n", (*server)->url().c_str());
  std::fflush(stdout);

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  std::fprintf(stderr, "ferry store: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  (*server)->stop();
  return 0;
}

FERRY_COMMAND(store_command, "store",
              "Run the embedded TCP store (rendezvous for trainer and inference ranks)",
              [](CLI::App& app) -> std::function<int()> {
                auto args = std::make_shared<StoreArgs>();
                app.add_option("--port,-p", args->port, "TCP port to listen on (0: pick a free one)")
                    ->default_val(0);
                app.add_option("--host", args->host, "Address to listen on (an IP address)")
                    ->default_val("127.0.0.1");
                app.add_option("--token", args->token,
                               "Shared secret clients must prove (default: $FERRY_TOKEN)");
                return [args] { return run_store(*args); };
              });

}  // namespace
