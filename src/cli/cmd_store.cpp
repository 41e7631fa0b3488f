// `ferry store`: runs the embedded TCP store server in the foreground until SIGINT or
// SIGTERM, printing the URL clients pass to Store::open.
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "cli/command.h"
#include <prometheus/registry.h>

#include "ferry/metrics.h"
#include "ferry/store.h"

namespace {

struct StoreArgs {
  std::string host = "127.0.0.1";
  int port = 0;
  std::string token;
  std::string token_file;
  double idle_timeout_s = 300;
  std::string metrics;  // --metrics-port: "PORT" or "HOST:PORT"; empty: none
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

  if (!(args.idle_timeout_s >= 0) || args.idle_timeout_s > 86400) {
    std::fprintf(stderr, "ferry store: --idle-timeout %g is outside 0..86400 seconds\n", args.idle_timeout_s);
    return 2;
  }
  if (!args.token.empty() && !args.token_file.empty()) {
    std::fprintf(stderr, "ferry store: pass --token-file or --token, not both\n");
    return 2;
  }
  ferry::StoreServerOptions options;
  options.host = args.host;
  options.port = static_cast<uint16_t>(args.port);
  options.idle_timeout = ferry::Millis{static_cast<int64_t>(args.idle_timeout_s * 1000)};
  if (!args.token_file.empty()) {
    auto token = ferry::read_token_file(args.token_file);
    if (!token.ok()) {
      std::fprintf(stderr, "ferry store: %s\n", token.status().to_string().c_str());
      return 2;
    }
    options.token = *token;
  } else if (!args.token.empty()) {
    // Kept for compatibility, but every user of the machine can read argv (`ps`).
    std::fprintf(stderr,
                 "ferry store: warning: --token puts the secret on the command line, where `ps` shows it to "
                 "every user; use --token-file or FERRY_TOKEN\n");
    options.token = args.token;
  }  // else: FERRY_TOKEN, then FERRY_TOKEN_FILE
  // Each client holds a descriptor; an unauthenticated flood is capped by the server,
  // but max_connections (4096) authenticated clients need more than the usual soft
  // limit of 1024.
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur < fds.rlim_max) {
    fds.rlim_cur = fds.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &fds);
  }
  auto server = ferry::StoreServer::start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "ferry store: %s\n", server.status().to_string().c_str());
    return 1;
  }
  std::printf("ferry store: serving %s (stop with Ctrl-C or SIGTERM)\n", (*server)->url().c_str());
  std::fflush(stdout);
  // --metrics-port: the server's own counters, read at each scrape (stopped before it).
  std::unique_ptr<ferry::MetricsEndpoint> metrics;
  if (!args.metrics.empty()) {
    auto ep = ferry::MetricsEndpoint::start(args.metrics, std::make_shared<prometheus::Registry>());
    ferry::Status added = ep.ok() ? (*ep)->add(ferry::store_server_metrics(**server)) : ep.status();
    if (!added.ok()) {
      std::fprintf(stderr, "ferry store: --metrics-port: %s\n", added.to_string().c_str());
      return 2;
    }
    metrics = std::move(*ep);
    std::fprintf(stderr, "ferry store: metrics at %s\n", metrics->url().c_str());
  }

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  std::fprintf(stderr, "ferry store: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  metrics.reset();
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
                app.add_option("--token-file", args->token_file,
                               "File holding the shared secret clients must prove (default: $FERRY_TOKEN, "
                               "then the file named by $FERRY_TOKEN_FILE); at least 16 bytes");
                app.add_option("--token", args->token,
                               "The shared secret itself (discouraged: argv shows in `ps`; warns)");
                app.add_option("--idle-timeout", args->idle_timeout_s,
                               "Seconds an authenticated client may stay silent before it is dropped "
                               "(clients reconnect transparently; 0: never)")
                    ->default_val(300);
                app.add_option("--metrics-port", args->metrics,
                               "Serve the store's Prometheus metrics (connections, evicted connections, refused "
                               "token proofs) at http://HOST:PORT/metrics: PORT (every interface) or HOST:PORT");
                return [args] { return run_store(*args); };
              });

}  // namespace
