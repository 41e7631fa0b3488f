// The engine's feature matrix (feature_matrix.h, issue 43): one sync scenario under a
// covering set of all ten features that combine (transport, mode, in-place serving,
// commit policy, group order, relay, delta, checksums, FP8 side, GPU staging), so that
// every pair of values of any two features runs together at least once. The suites of
// engine_test.cpp, engine_delta_test.cpp and engine_relay_test.cpp go deeper into fewer
// features each; this one is where the features meet.
//
// The scenario: a dense model with GQA over two pipeline stages (so the rotated order
// has stages to rotate) into two replicas of tp=2 (so relay has groups), three
// versions, every consumer's params verified bit for bit against a direct load at each,
// and each feature's own mark in the reports (patches, quantised bytes, bytes served in place, bytes relayed). Cases
// with GPU staging need a CUDA device (the emulated plugin runs them: label
// emulated-cuda) and are skipped without one.
#include <gtest/gtest.h>

#include <cstdint>

#include "engine/engine_test_util.h"

namespace ferry::engine_tests {
namespace {

class EngineMatrixTest : public EngineTest {};

INSTANTIATE_TEST_SUITE_P(Cover, EngineMatrixTest, ::testing::ValuesIn(covering_cases({})), case_name_of);

TEST_P(EngineMatrixTest, ThreeVersionsVerifiedWithEachFeaturesMark) {
  const EngineCase e = GetParam();
  if (e.gpu_staging && !cuda_status().usable()) GTEST_SKIP() << "GPU staging needs a CUDA device; " << cuda_status().detail;
  Cluster k(e);
  Status st = k.start(cfg("llama-3.1-8b.json"), "tp=2,pp=2", "tp=2,replicas=2");
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (uint64_t v = 1; v <= 3; ++v) {
    auto o = k.sync(v);
    k.expect_all_ok(o, v);
    if (HasFatalFailure()) return;
    uint64_t sent = 0, in_place = 0, quantized = 0, patch = 0, received = 0, relayed = 0;
    for (auto& p : o.p) {
      sent += (**p).bytes_sent;
      in_place += (**p).sent_in_place;
      quantized += (**p).quantized_bytes;
      patch += (**p).patch_bytes;
    }
    for (auto& c : o.c) {
      received += (**c).bytes_received;
      relayed += (**c).received_via_relay;
    }
    EXPECT_GT(sent, 0u);
    EXPECT_LE(sent, received) << "no byte is sent that no consumer receives";
    // FP8 on the producers: they quantise (and stage the e4m3 bytes); on the consumers
    // the producers send bf16 and quantise nothing.
    EXPECT_EQ(quantized > 0, e.fp8 == Fp8Side::kProducer) << quantized << " bytes quantised";
    // Delta: from the second version on, patches cross (1% of elements changed); never
    // before a base is held, never without delta.
    if (e.delta && v > 1) {
      EXPECT_GT(patch, 0u);
    } else {
      EXPECT_EQ(patch, 0u);
    }
    // In place: producers serve straight from the trainer's memory, unless delta (every
    // byte packed, so that it can be patched).
    EXPECT_EQ(in_place > 0, is_in_place(e.mode) && !e.delta) << in_place << " bytes served in place";
    // Relay: a rank's second replica copies from the first (under either order: replicas
    // relaying on one host share a cohort); never without.
    if (!e.relay) {
      EXPECT_EQ(relayed, 0u);
    } else {
      EXPECT_GT(relayed, 0u);
    }
  }
}

}  // namespace
}  // namespace ferry::engine_tests
