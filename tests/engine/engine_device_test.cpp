// Ranks-as-threads tests of the engine with weights in GPU memory (issue #19): refused
// without a usable device, synced device to device with one (under the emulated CUDA
// plugin too: CTest entry EmulatedCuda.engine_test, filter EngineDevice.*).
#include <gtest/gtest.h>

#include <cstdint>

#include "engine/engine_test_util.h"
#include "ferry/device.h"

namespace ferry::engine_tests {
namespace {

// --- weights in GPU memory (issue #19) ---------------------------------------------------

// Params that say they live on cuda:0, on a machine with no usable CUDA device: the
// consumer is refused at create, before its rendezvous, naming the param, the device and
// why (cuda_status); nothing touches the (fake) device pointer.
TEST(EngineDevice, GpuParamsWithoutAUsableDeviceAreRefusedAtCreate) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here: EngineDevice.SyncsFromGpuMemoryIntoGpuMemory covers it";
  Cluster k;
  k.eo.rendezvous_timeout = 3000ms;
  k.caller_params = true;
  k.param_factory = [](const TensorDecl& d) -> Result<Tensor> {
    return Tensor::borrow_device(reinterpret_cast<void*>(uintptr_t{0x10000}), d.shape, d.dtype, Device::cuda(0), nullptr,
                                 d.name);
  };
  Status st = k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1", R"({"num_hidden_layers": 1})");
  ASSERT_FALSE(st.ok());
  bool named = false;
  for (const Status& s : k.started) {
    if (s.ok()) continue;
    named |= s.code() == StatusCode::kUnavailable && s.message().find("cuda:0") != std::string::npos &&
             s.message().find(cuda_status().detail) != std::string::npos;
  }
  EXPECT_TRUE(named) << st.to_string();
}

// A consumer param in cuda:0 memory (Cluster::param_factory; called from the consumers'
// threads at once: the tensor itself keeps its memory).
Result<Tensor> gpu_param(const TensorDecl& d) {
  const size_t bytes = static_cast<size_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
  FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(Device::cuda(0), bytes));
  return Tensor::borrow_device(mem.get(), d.shape, d.dtype, Device::cuda(0), mem, d.name);
}

// Trainer weights and inference params both in GPU memory (one device, threads as
// ranks): packed by a kernel into host staging, moved by the transport, unpacked by a
// kernel into the params; verified bit for bit after each of two syncs, pull and push.
TEST(EngineDevice, SyncsFromGpuMemoryIntoGpuMemory) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  for (Mode mode : {Mode::kPull, Mode::kPush}) {
    SCOPED_TRACE(mode == Mode::kPull ? "pull" : "push");
    Cluster k(EngineCase{Backend::kInproc, mode});
    k.gpu_sources = true;
    k.caller_params = true;
    k.param_factory = gpu_param;
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
    k.expect_all_ok(k.sync(1), 1);
    k.expect_all_ok(k.sync(2), 2);
  }
}

// Issue 29 on the GPU: fp32 master weights in GPU memory, bf16 params in GPU memory. The
// producers' pack kernel converts (the host's bits: element_convert.h), so each consumer
// receives the bf16 it keeps; with host staging and with GPU staging, pull and push, two
// syncs, every param bit for bit a direct load of the fp32 checkpoint.
TEST(EngineDevice, Fp32GpuMastersIntoBf16GpuParamsConvertOnTheProducersGpu) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  for (Mode mode : {Mode::kPull, Mode::kPush}) {
    for (bool gpu_staging : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {} staging", mode == Mode::kPull ? "pull" : "push", gpu_staging ? "gpu" : "host"));
      Cluster k(EngineCase{Backend::kInproc, mode});
      k.gpu_sources = true;
      k.caller_params = true;
      k.param_factory = gpu_param;
      if (gpu_staging) k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
      ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2,dtype=fp32", "tp=2,replicas=2").ok());
      for (uint64_t v : {1u, 2u}) {
        auto o = k.sync(v);
        k.expect_all_ok(o, v);
        for (int c = 0; c < k.C(); ++c) {
          auto rl = k.model.loader->rank(c);
          ASSERT_TRUE(rl.ok());
          uint64_t kept = 0;
          for (const ParamInfo& p : (*rl)->params()) kept += static_cast<uint64_t>(shape_numel(p.decl.shape)) * 2;
          EXPECT_EQ((**o.c[static_cast<size_t>(c)]).bytes_received, kept) << "consumer " << c;
        }
      }
    }
  }
}

// FP8 quantised on the producers (EngineOptions::quantize_on) from trainer weights in GPU
// memory: each region filled on the device by the copy kernel and quantised there by the
// FP8 kernel (the host's arithmetic), then copied into staging; with host staging and
// with GPU staging (the packs on the device, the quant ops written after the copy to
// host staging); pull and push, two syncs, every consumer's FP8 params bit for bit as a
// direct load quantises them on the host.
TEST(EngineDevice, Fp8QuantisedByProducersFromGpuWeights) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  for (Mode mode : {Mode::kPull, Mode::kPush}) {
    for (bool gpu_staging : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {} staging", mode == Mode::kPull ? "pull" : "push", gpu_staging ? "gpu" : "host"));
      Cluster k(EngineCase{Backend::kInproc, mode});
      k.gpu_sources = true;
      k.loader_options.quantize = Quantize::kFp8;
      if (gpu_staging) k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
      ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
      for (uint64_t v : {1u, 2u}) {
        auto o = k.sync(v);
        k.expect_all_ok(o, v);
        uint64_t quantized = 0;
        for (auto& p : o.p) quantized += (**p).quantized_bytes;
        EXPECT_GT(quantized, 0u);
      }
    }
  }
}

// GPU staging without a usable device: every producer is refused at create, before its
// rendezvous, naming the option, the device and why.
TEST(EngineDevice, GpuStagingWithoutAUsableDeviceIsRefusedAtCreate) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here: EngineDevice.SyncsThroughGpuStagingDeviceToDevice covers it";
  Cluster k;
  k.eo.rendezvous_timeout = 3000ms;
  k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
  Status st = k.start(cfg("llama-3.1-8b.json"), "tp=1", "tp=1", R"({"num_hidden_layers": 1})");
  ASSERT_FALSE(st.ok());
  bool named = false;
  for (const Status& s : k.started) {
    named |= s.code() == StatusCode::kUnavailable && s.message().find("staging_device cuda:0") != std::string::npos &&
             s.message().find(cuda_status().detail) != std::string::npos;
  }
  EXPECT_TRUE(named) << st.to_string();
}

// Staging in GPU memory, read device to device (ConsumerOptions::cuda_ipc; ranks as
// threads, so the consumer maps the producer's staging pointer itself): two syncs, pull,
// verified bit for bit; every byte such a consumer receives was copied device to
// device. A consumer with cuda_ipc off reads the same producers' host staging through
// the transport and verifies too. Also under the rotated order with two pipeline stages
// (issue 26: cohorts read the stages' GPU slots in turn, producers pace them), and with
// relay on (a relay that reads over CUDA IPC has nothing in its host ring: consumer 3,
// its member, is answered "gone" and reads from the producers).
TEST(EngineDevice, SyncsThroughGpuStagingDeviceToDevice) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  struct Variant {
    bool rotated, relay;
    const char* trainer;
  };
  for (const Variant& x : {Variant{false, false, "tp=2"}, Variant{true, false, "tp=2,pp=2"}, Variant{false, true, "tp=2"}}) {
    SCOPED_TRACE(fmt::format("trainer {}{}{}", x.trainer, x.rotated ? ", rotated" : "", x.relay ? ", relay" : ""));
    Cluster k(EngineCase{Backend::kInproc, Mode::kPull, false, x.rotated, false, x.relay});
    k.gpu_sources = true;
    k.caller_params = true;
    k.param_factory = gpu_param;
    k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
    k.tweak_consumer = [](ConsumerOptions& o, int c) { o.cuda_ipc = c != 3; };
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), x.trainer, "tp=2,replicas=2").ok());
    for (uint64_t v = 1; v <= (x.rotated || x.relay ? 1u : 2u); ++v) {  // (emulated CUDA is slow: one sync each)
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      for (size_t c = 0; c < o.c.size(); ++c) {
        ASSERT_TRUE(o.c[c]->ok());
        const SyncReport& r = **o.c[c];
        EXPECT_GT(r.bytes_received, 0u);
        EXPECT_EQ(r.received_via_relay, 0u) << "consumer " << c << ": " << r.to_string();
        EXPECT_EQ(r.received_via_cuda_ipc, c == 3 ? 0u : r.bytes_received) << "consumer " << c << ": " << r.to_string();
      }
    }
  }
}

// Delta syncs with GPU weights (docs/delta.md): producers pack on the GPU and stage
// there, the kept copy (or, without one, the patch area) stays on the host. Host params
// take patches; GPU params read the
// dense bytes (consumers with CUDA IPC from the GPU slot, never patched; consumer 3
// through the transport from the kept copy). Every version verified bit for bit.
TEST(EngineDevice, DeltaWithGpuWeightsPatchesHostParamsAndDensesGpuParams) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  for (const uint64_t block_bytes : {uint64_t{0}, uint64_t{4096}})
  for (const bool gpu_params : {false, true}) {
    SCOPED_TRACE(fmt::format("{}, {}", gpu_params ? "GPU params" : "host params",
                             block_bytes ? "block hashes" : "kept copy"));
    Cluster k(EngineCase{Backend::kInproc, Mode::kPull});
    k.gpu_sources = true;
    k.eo.delta = true;
    k.eo.delta_same_host = true;
    k.eo.delta_block_bytes = block_bytes;
    k.changes = {block_bytes ? 0.1 : 0.01, block_bytes != 0};  // (blocks win on whole tensors changed)
    if (gpu_params) {
      k.caller_params = true;
      k.param_factory = gpu_param;
    }
    k.tweak_producer = [](ProducerOptions& o, int) { o.staging_device = Device::cuda(0); };
    k.tweak_consumer = [](ConsumerOptions& o, int c) { o.cuda_ipc = c != 3; };
    ASSERT_TRUE(k.start(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2").ok());
    for (uint64_t v : {1u, 2u, 3u}) {
      auto o = k.sync(v);
      k.expect_all_ok(o, v);
      if (v == 1) continue;
      for (size_t c = 0; c < o.c.size(); ++c) {
        ASSERT_TRUE(o.c[c]->ok());
        const SyncReport& r = **o.c[c];
        if (gpu_params) {
          EXPECT_EQ(r.patch_bytes, 0u) << "consumer " << c << ": " << r.to_string();
          EXPECT_EQ(r.received_via_cuda_ipc, c == 3 ? 0u : r.bytes_received) << "consumer " << c;
        } else {
          EXPECT_GT(r.patch_bytes, 0u) << "consumer " << c << ": " << r.to_string();
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferry::engine_tests
