// The weight checker (EngineOptions::weight_digests, Consumer::check_weights): no false
// alarm over a hundred verified syncs with trainer replicas; a drifted trainer replica and
// a param changed after its sync are each named.
#include "engine/engine_test_util.h"
#include "engine/testing.h"

namespace ferry::engine_tests {
namespace {

TEST(WeightChecker, NoFalseAlarmOverAHundredVerifiedSyncs) {
  Cluster k;
  k.eo.weight_digests = true;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2").ok());
  for (uint64_t v = 1; v <= 100; ++v) {
    k.expect_all_ok(k.sync(v), v);
    for (size_t c = 0; c < k.cons.size(); ++c) {
      auto w = k.cons[c]->check_weights();
      ASSERT_TRUE(w.ok()) << w.status().to_string();
      ASSERT_TRUE(w->ok()) << "sync " << v << ", consumer " << c << ": " << w->to_string();
      EXPECT_EQ(w->version, std::optional<uint64_t>(v));
      EXPECT_EQ(w->coverage(), 1.0) << w->to_string();
      EXPECT_GT(w->replicated_boxes, 0u) << w->to_string();
      EXPECT_EQ(w->replicated_checked, w->replicated_boxes) << w->to_string();
    }
  }
}

TEST(WeightChecker, NamesADriftedReplicaAndAParamChangedAfterItsSync) {
  Cluster k;
  k.eo.weight_digests = true;
  k.tweak_consumer = [](ConsumerOptions& co, int) { co.check_weights_each_sync = true; };
  std::string drifted_param;
  k.tweak_producer = [&](ProducerOptions& o, int p) {
    if (p != 2) return;
    engine::TestHooks hooks;
    hooks.after_materialize = [&](uint64_t v, int g, std::vector<LocalBox>& boxes) {
      if (v != 2 || g != 1 || boxes.empty()) return;
      auto held = k.src[2]->holdings(2);
      ASSERT_TRUE(held.ok());
      drifted_param = held->tensors[held->boxes[boxes[0].box].tensor].name;
      boxes[0].data = boxes[0].data.clone();  // (this sync's copy only)
      auto bytes = boxes[0].data.data_ptr();
      ASSERT_TRUE(bytes.ok());
      (*bytes)[0] ^= std::byte{0x10};  // one bit: replica 1 drifted from replica 0
    };
    o.test_hooks = engine::make_test_hooks(std::move(hooks));
  };
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dp=2", "tp=2").ok());
  k.expect_all_ok(k.sync(1), 1);
  auto o = k.sync(2);
  for (auto& c : o.c) ASSERT_TRUE(c->ok()) << c->status().to_string();
  ASSERT_FALSE(drifted_param.empty());
  for (size_t c = 0; c < k.cons.size(); ++c) {
    auto w = k.cons[c]->check_weights();
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    EXPECT_FALSE(w->ok());
    EXPECT_TRUE(w->changed.empty()) << w->to_string();
    ASSERT_EQ(w->drifted.size(), 1u) << w->to_string();
    EXPECT_NE(w->drifted[0].find("producers 0 and 2 disagree on '" + drifted_param + "' ["), std::string::npos)
        << w->to_string();
    EXPECT_NE(w->to_string().find("NOT as delivered"), std::string::npos);
  }
  // The replica agrees again at 3, whose syncs began with the check of 2: each consumer's
  // report says what drifted (check_weights_each_sync).
  auto o3 = k.sync(3);
  k.expect_all_ok(o3, 3);
  for (size_t c = 0; c < o3.c.size(); ++c) {
    const SyncReport& r = **o3.c[c];
    ASSERT_EQ(r.events.size(), 1u) << r.to_string();
    EXPECT_EQ(r.events[0].kind, ControlKind::kWeights);
    EXPECT_NE(r.events[0].message.find("producers 0 and 2 disagree on '" + drifted_param + "'"), std::string::npos)
        << r.to_string();
  }
  // Then a param of consumer 0 changes after its sync.
  TensorMap live = k.cons[0]->params();
  ASSERT_FALSE(live.empty());
  const std::string name = live.begin()->first;
  auto bytes = live.begin()->second.data_ptr();
  ASSERT_TRUE(bytes.ok());
  (*bytes)[1] ^= std::byte{0x01};
  auto w0 = k.cons[0]->check_weights();
  ASSERT_TRUE(w0.ok());
  EXPECT_EQ(w0->changed, std::vector<std::string>{name}) << w0->to_string();
  EXPECT_TRUE(w0->drifted.empty()) << w0->to_string();
  auto w1 = k.cons[1]->check_weights();
  ASSERT_TRUE(w1.ok());
  EXPECT_TRUE(w1->ok()) << w1->to_string();
  // The next sync begins by saying so, and rewrites the param.
  auto o4 = k.sync(4);
  k.expect_all_ok(o4, 4);
  const SyncReport& r0 = **o4.c[0];
  ASSERT_EQ(r0.events.size(), 1u) << r0.to_string();
  EXPECT_EQ(r0.events[0].message, "consumer 0: param '" + name + "' changed since version 3 went live");
  EXPECT_TRUE((**o4.c[1]).events.empty()) << (**o4.c[1]).to_string();
}

TEST(WeightChecker, NeedsTheDigests) {
  Cluster k;
  ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1").ok());
  auto w = k.cons[0]->check_weights();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(w.status().message().find("weight_digests"), std::string::npos);
}

}  // namespace
}  // namespace ferry::engine_tests
