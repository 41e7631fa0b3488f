// An out-of-tree program over an installed ferry (examples/README.md): two trainer ranks
// (Producers) and two inference ranks (Consumers), each a thread of this process with its
// own Transport and its own Store client, meeting through the embedded store server.
// A small Llama model: trainer Megatron tp=2 -> inference tp=2, two synced versions, and
// every inference rank checked bit for bit against a direct load of each version.
//
//   sync_example [inproc|ucx]      (default inproc; ucx runs over sm,tcp,self on lo)
// Exit status 0 when every rank received and verified every version.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/engine.h"
#include "ferry/version.h"

using namespace ferry;

namespace {

// Llama-3.1-8B's config.json with small sizes (a few MB of weights).
constexpr const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false
})";
constexpr uint64_t kSeed = 42;
constexpr const char* kToken = "example-token-0123456789";  // 16+ bytes (the store's minimum); in a real job: FERRY_TOKEN

int fail(const char* what, const Status& st) {
  std::fprintf(stderr, "sync_example: %s: %s\n", what, st.to_string().c_str());
  return 1;
}

// Runs f(i) for i in [0, n) on n threads; the first error.
template <typename F>
Status on_threads(int n, F f) {
  std::vector<Status> st(static_cast<size_t>(n));
  std::vector<std::thread> th;
  for (int i = 0; i < n; ++i) th.emplace_back([&, i] { st[static_cast<size_t>(i)] = f(i); });
  for (auto& t : th) t.join();
  for (auto& s : st) FERRY_RETURN_IF_ERROR(s);
  return Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string backend = argc > 1 ? argv[1] : "inproc";
  std::printf("ferry %s, transport %s\n", kVersion, backend.c_str());

  // What both sides agree on: the model, the trainer layout and the inference layout.
  auto config = ModelConfig::parse(kConfig, "example-llama.json");
  if (!config.ok()) return fail("config", config.status());
  auto inference = InferenceLayout::parse("tp=2");
  auto trainer = TrainerLayout::parse("tp=2");
  if (!inference.ok() || !trainer.ok()) return fail("layouts", inference.ok() ? trainer.status() : inference.status());
  auto loader = make_model_loader(*config, *inference);
  if (!loader.ok()) return fail("loader", loader.status());
  const std::vector<TensorDecl>& metadata = (*loader)->checkpoint();
  auto holdings = make_holdings(metadata, *trainer, model_info_from_config(config->json()));
  if (!holdings.ok()) return fail("holdings", holdings.status());
  auto ranks = std::make_shared<const std::vector<Holdings>>(holdings->ranks);
  const int P = trainer->world_size(), C = inference->world_size();

  // The embedded store (in a real job: on trainer rank 0, or `ferry store`).
  StoreServerOptions sso;
  sso.token = kToken;
  auto server = StoreServer::start(sso);
  if (!server.ok()) return fail("store server", server.status());

  EngineOptions eo;
  eo.job = "example";
  eo.num_producers = P;
  eo.num_consumers = C;
  TransportOptions to;
  to.backend = backend;
  if (backend == "ucx") to.params = {{"tls", "sm,tcp,self"}, {"net_devices", "lo"}};
  StoreOptions so;
  so.token = kToken;

  // One transport, store client and engine object per rank.
  std::vector<std::unique_ptr<Transport>> transports(static_cast<size_t>(P + C));
  std::vector<std::unique_ptr<Store>> stores(static_cast<size_t>(P + C));
  std::vector<std::unique_ptr<SyntheticSource>> sources(static_cast<size_t>(P));
  std::vector<std::unique_ptr<Producer>> producers(static_cast<size_t>(P));
  std::vector<std::unique_ptr<Consumer>> consumers(static_cast<size_t>(C));
  Status st = on_threads(P + C, [&](int i) -> Status {
    const size_t k = static_cast<size_t>(i);
    FERRY_ASSIGN_OR_RETURN(transports[k], Transport::create(to));
    FERRY_ASSIGN_OR_RETURN(stores[k], Store::open((*server)->url(), so));
    if (i < P) {  // trainer rank i: its shards of synthetic weights
      sources[k] = std::make_unique<SyntheticSource>(metadata, ranks, i, kSeed);
      ProducerOptions po;
      static_cast<EngineOptions&>(po) = eo;
      FERRY_ASSIGN_OR_RETURN(producers[k], Producer::create(*sources[k], *transports[k], *stores[k], po));
    } else {  // inference rank i - P
      ConsumerOptions co;
      static_cast<EngineOptions&>(co) = eo;
      FERRY_ASSIGN_OR_RETURN(consumers[k - static_cast<size_t>(P)],
                             Consumer::create(**loader, i - P, *transports[k], *stores[k], co));
    }
    return Status::Ok();
  });
  if (!st.ok()) return fail("rendezvous", st);

  for (uint64_t version = 1; version <= 2; ++version) {
    std::vector<SyncReport> reports(static_cast<size_t>(P + C));
    st = on_threads(P + C, [&](int i) -> Status {
      const size_t k = static_cast<size_t>(i);
      if (i < P) {
        sources[k]->set_version(version);  // the optimizer step
        FERRY_ASSIGN_OR_RETURN(reports[k], producers[k]->sync(version));
      } else {
        FERRY_ASSIGN_OR_RETURN(reports[k], consumers[k - static_cast<size_t>(P)]->sync(version));
      }
      return reports[k].status;
    });
    if (!st.ok()) return fail("sync", st);

    // Each inference rank against a direct load of the same version by its own loader.
    TensorMap checkpoint;
    for (const auto& d : metadata) checkpoint.emplace(d.name, synthetic_tensor(kSeed, version, d));
    for (int c = 0; c < C; ++c) {
      auto direct = load_rank_direct(**loader, c, checkpoint);
      auto rank = (*loader)->rank(c);
      if (!direct.ok() || !rank.ok()) return fail("direct load", direct.ok() ? rank.status() : direct.status());
      auto mismatch = compare_params((*rank)->final_params(), *direct, consumers[static_cast<size_t>(c)]->params());
      if (!mismatch.ok()) return fail("compare", mismatch.status());
      if (mismatch->has_value()) {
        std::fprintf(stderr, "sync_example: version %llu rank %d: param '%s' index %lld: %s\n",
                     static_cast<unsigned long long>(version), c, (*mismatch)->param.c_str(),
                     static_cast<long long>((*mismatch)->index), (*mismatch)->detail.c_str());
        return 1;
      }
      std::printf("version %llu: inference rank %d received %llu bytes, verified\n",
                  static_cast<unsigned long long>(version), c,
                  static_cast<unsigned long long>(reports[static_cast<size_t>(P + c)].bytes_received));
    }
  }
  // Engines before transports and stores (the engine uses both until destroyed).
  consumers.clear();
  producers.clear();
  std::printf("ok\n");
  return 0;
}
