// Consumer::check_params: the caller's params still where the consumer writes them (one
// producer and one consumer as threads over the in-process transport, a hand-written plan).
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "ferry/engine.h"
#include "ferry/plan.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

const char* kToken = "consumer-params-test-token-0123";

std::vector<TensorDecl> metadata() {
  return {{"model.norm.weight", DType::kF32, {256}}, {"model.layers.0.mlp.up_proj.weight", DType::kF32, {64, 64}}};
}

// x <- model.norm.weight, y <- the layer-0 weight; `params`: the caller's buffers.
Result<ConsumerModel> model(TensorMap params) {
  ConsumerModel m;
  Recorder rec;
  for (const auto& [param, source] : {std::pair{"x", 0}, std::pair{"y", 1}}) {
    const TensorDecl d = metadata()[static_cast<size_t>(source)];
    FERRY_RETURN_IF_ERROR(Tensor::param(param, d.shape, d.dtype).copy_(Tensor::source(d.name, d.shape, d.dtype)));
  }
  FERRY_ASSIGN_OR_RETURN(m.plan, rec.finish());
  m.params = std::move(params);
  return m;
}

struct OneToOne {
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Transport> producer_transport, consumer_transport;
  std::unique_ptr<Store> producer_store, consumer_store;
  std::unique_ptr<SyntheticSource> source;
  std::unique_ptr<Producer> producer;
  std::unique_ptr<Consumer> consumer;

  Status start(TensorMap params) {
    StoreServerOptions sso;
    sso.token = kToken;
    FERRY_ASSIGN_OR_RETURN(server, StoreServer::start(sso));
    StoreOptions so;
    so.token = kToken;
    TransportOptions to;
    to.backend = "inproc";
    FERRY_ASSIGN_OR_RETURN(producer_transport, Transport::create(to));
    FERRY_ASSIGN_OR_RETURN(consumer_transport, Transport::create(to));
    FERRY_ASSIGN_OR_RETURN(producer_store, Store::open(server->url(), so));
    FERRY_ASSIGN_OR_RETURN(consumer_store, Store::open(server->url(), so));
    Holdings all;
    for (const TensorDecl& d : metadata()) FERRY_RETURN_IF_ERROR(all.add(d, full_box(d.shape)));
    source = std::make_unique<SyntheticSource>(metadata(), std::make_shared<const std::vector<Holdings>>(1, all), 0, 7);
    EngineOptions eo;
    eo.job = "consumer-params";
    eo.rendezvous_timeout = 20s;
    eo.timeout = 20s;
    ProducerOptions po;
    static_cast<EngineOptions&>(po) = eo;
    ConsumerOptions co;
    static_cast<EngineOptions&>(co) = eo;
    Status produced;
    std::thread p([&] {
      auto made = Producer::create(*source, *producer_transport, *producer_store, po);
      if (made.ok()) producer = std::move(*made);
      produced = made.status();
    });
    auto m = model(std::move(params));
    Status consumed = m.status();
    if (m.ok()) {
      auto made = Consumer::create(std::move(*m), 0, *consumer_transport, *consumer_store, co);
      if (made.ok()) consumer = std::move(*made);
      consumed = made.status();
    }
    p.join();
    FERRY_RETURN_IF_ERROR(produced);
    return consumed;
  }
};

bool names(const Status& s, const std::string& what) { return s.message().find(what) != std::string::npos; }

TEST(ConsumerCheckParams, MovedOrMissingParamIsNamed) {
  // x is the caller's; y is not given, so the engine allocates it (and never checks it).
  Tensor x = Tensor::empty({256}, DType::kF32, "x");
  OneToOne k;
  const Status started = k.start({{"x", x}});
  ASSERT_TRUE(started.ok()) << started.to_string();

  EXPECT_TRUE(k.consumer->check_params({{"x", x}}).ok());
  // Names beyond the caller's params (here the engine's y, and one the plan lacks) are
  // not checked.
  EXPECT_TRUE(k.consumer->check_params({{"x", x}, {"y", Tensor::empty({64, 64}, DType::kF32)},
                                         {"unrelated", Tensor::empty({1}, DType::kF32)}})
                  .ok());

  // x re-bound: other memory under its name.
  Status moved = k.consumer->check_params({{"x", Tensor::empty({256}, DType::kF32, "x")}});
  EXPECT_EQ(moved.code(), StatusCode::kFailedPrecondition) << moved.to_string();
  EXPECT_TRUE(names(moved, "consumer 0: param 'x' was re-bound")) << moved.to_string();

  // The same address on another device is other memory too.
  auto* at = x.data_ptr().value();
  Status device = k.consumer->check_params({{"x", Tensor::borrow_device(at, {256}, DType::kF32, Device::cuda(0))}});
  EXPECT_EQ(device.code(), StatusCode::kFailedPrecondition) << device.to_string();
  EXPECT_TRUE(names(device, "param 'x' was re-bound") && names(device, "cuda:0")) << device.to_string();

  // x gone from the caller's params.
  Status missing = k.consumer->check_params({});
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition) << missing.to_string();
  EXPECT_TRUE(names(missing, "param 'x' passed to create is no longer among the params")) << missing.to_string();
}

}  // namespace
}  // namespace ferry
