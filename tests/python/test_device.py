"""Plan.replay and the engine with torch CUDA tensors, as far as a machine without a GPU
can check it: a tensor that says it is on cuda:0 binds as device memory (a replay's
source or param, a WeightSource's materialize result, a Consumer's param) and goes to
the GPU path, which fails naming the device and why no CUDA device can be used; where
one can, the replay and a sync run on the GPU and agree bit for bit with the host."""
import os
import sys
import unittest

import torch

import ferry

# Under the emulated CUDA plugin (label emulated-cuda) "device memory" is host memory:
# the GPU paths run for real on CPU tensors that say they are on cuda:0.
EMULATED = os.environ.get("FERRY_CUDA_PLUGIN", "").endswith("libferry_cuda_emulated.so")
NO_DEVICE = not torch.cuda.is_available() and not EMULATED


class FakeCudaTensor:
    """Quacks like a torch CUDA tensor (device, dtype, shape, data_ptr): what bind
    sees of a real one. Its pointer is never dereferenced on a machine with no GPU."""

    class _Device:
        type = "cuda"
        index = 0

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = FakeCudaTensor._Device()

    def data_ptr(self):
        return 0x10000

    def element_size(self):
        return 2

    def is_contiguous(self):
        return True


class HostBackedCuda(FakeCudaTensor):
    """A CPU tensor's memory presented as cuda:0 (only meaningful under the emulated
    plugin, whose devices are host memory)."""

    def __init__(self, t):
        super().__init__(t.shape, t.dtype)
        self.t = t

    def data_ptr(self):
        return self.t.data_ptr()

    def element_size(self):
        return self.t.element_size()


def plan_of_a_shard():
    w = ferry.source("w", (8, 4), "bfloat16")
    p = ferry.param("p", (4, 4), "bfloat16")
    with ferry.record() as plan:
        p.copy_(w[2:6])
    return plan


class DeviceReplayTest(unittest.TestCase):
    def test_cuda_tensors_take_the_gpu_path(self):
        plan = plan_of_a_shard()
        src, dst = FakeCudaTensor((8, 4)), FakeCudaTensor((4, 4))
        if not NO_DEVICE:
            self.skipTest("a (real or emulated) GPU is here: test_real_cuda_replay / EmulatedCudaTest cover it")
        with self.assertRaises(ferry.UnavailableError) as cm:
            plan.replay({"w": src}, {"p": dst}, stream=0)
        msg = str(cm.exception)
        self.assertIn("cuda:0", msg)
        self.assertTrue("no usable CUDA device" in msg or "CUDA plugin" in msg or "without CUDA" in msg, msg)

    def test_mixed_devices_are_refused(self):
        plan = plan_of_a_shard()
        src = torch.zeros((8, 4), dtype=torch.bfloat16)
        with self.assertRaises(ferry.InvalidArgumentError) as cm:
            plan.replay({"w": src}, {"p": FakeCudaTensor((4, 4))}, stream=0)
        self.assertIn("one device", str(cm.exception))

    def test_other_devices_are_refused_naming_them(self):
        plan = plan_of_a_shard()
        t = FakeCudaTensor((4, 4))
        t.device = type("D", (), {"type": "mps", "index": 0})()
        with self.assertRaises(ferry.InvalidArgumentError) as cm:
            plan.replay({"w": torch.zeros((8, 4), dtype=torch.bfloat16)}, {"p": t})
        self.assertIn("'mps'", str(cm.exception))

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device (torch.cuda.is_available() is False)")
    def test_real_cuda_replay(self):
        plan = plan_of_a_shard()
        w = torch.arange(32, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16)
        want = torch.zeros((4, 4), dtype=torch.bfloat16)
        plan.replay({"w": w}, {"p": want})
        got = torch.zeros((4, 4), dtype=torch.bfloat16, device="cuda")
        plan.replay({"w": w.cuda()}, {"p": got})
        self.assertTrue(torch.equal(got.cpu(), want))


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_engine import CONFIG, run_threads  # noqa: E402

BF16 = dict(CONFIG, torch_dtype="bfloat16")


class TorchTrainer(ferry.WeightSource):
    """A tp=1 trainer whose weights are torch tensors on `device`, served whole."""

    def __init__(self, device="cpu", fake_cuda=False):
        super().__init__(model_config=BF16)
        g = torch.Generator().manual_seed(7)
        self.host = {n: torch.randn(d.shape, generator=g).bfloat16() for n, d in ferry.ModelLoader(BF16).checkpoint.items()}
        self.weights = {n: t.to(device) for n, t in self.host.items()}
        self.fake_cuda = fake_cuda

    def metadata(self):
        return {n: (t.shape, t.dtype) for n, t in self.host.items()}

    def materialize(self, group):
        if self.fake_cuda:
            return {n: FakeCudaTensor(self.host[n].shape) for n, _, _ in self.boxes(group)}
        return {n: self.weights[n] for n, _, _ in self.boxes(group)}


def expected_params(loader, trainer):
    out = {n: torch.zeros(d.shape, dtype=torch.bfloat16) for n, d in loader.params(0).items()}
    loader.record_plan(0).replay(trainer.host, out)
    return out


class EngineDeviceTest(unittest.TestCase):
    """The engine's Python bindings take torch CUDA tensors as sources and params."""

    def setUp(self):
        if not NO_DEVICE:
            self.skipTest("a (real or emulated) GPU is here: test_real_cuda_sync / EmulatedCudaTest cover it")

    def test_cuda_params_take_the_gpu_path(self):
        loader = ferry.ModelLoader(BF16, "tp=1")
        params = {n: FakeCudaTensor(d.shape) for n, d in loader.params(0).items()}
        with ferry.StoreServer() as server:
            with self.assertRaises(ferry.UnavailableError) as cm:
                ferry.Consumer(loader=loader, rank=0, store=server, params=params, backend="inproc", job="gpu-params",
                               timeout=5.0)
        msg = str(cm.exception)
        self.assertIn("cuda:0", msg)
        self.assertTrue("no usable CUDA device" in msg or "CUDA plugin" in msg or "without CUDA" in msg, msg)

    def test_cuda_materialize_takes_the_gpu_path(self):
        loader = ferry.ModelLoader(BF16, "tp=1")
        with ferry.StoreServer() as server:
            common = dict(store=server, backend="inproc", job="gpu-source", timeout=5.0, stall_timeout=3.0)
            producer, consumer = run_threads([lambda: ferry.Producer(TorchTrainer(fake_cuda=True), **common),
                                              lambda: ferry.Consumer(loader=loader, rank=0, **common)])
            errors = []

            def sync(x):
                try:
                    return x.sync(1)
                except ferry.Error as e:
                    errors.append(e)
                    return None

            reports = run_threads([lambda: sync(producer), lambda: sync(consumer)])
            texts = [str(e) for e in errors] + [r["text"] for r in reports if r is not None]
            self.assertTrue(errors or not all(r["ok"] for r in reports), texts)
            self.assertTrue(any("cuda:0" in t and ("no usable CUDA device" in t or "CUDA plugin" in t or "without CUDA" in t)
                                for t in texts), texts)
            self.assertNotEqual(consumer.state(), {"version": 1, "torn": False, "mixed": False, "received": None})
            producer.close()
            consumer.close()


class TorchTrainerOnFakeCuda(TorchTrainer):
    """Materializes its CPU weights as tensors that say they are on cuda:0."""

    def materialize(self, group):
        return {n: HostBackedCuda(self.weights[n]) for n, _, _ in self.boxes(group)}


@unittest.skipUnless(EMULATED, "runs under the emulated CUDA plugin (ctest -L emulated-cuda)")
class EmulatedCudaTest(unittest.TestCase):
    """The bindings' GPU paths end to end, on the emulated plugin: what materialize
    returns and the Consumer's params are bound as device memory and moved by the
    (emulated) kernels."""

    def test_replay_of_cuda_tensors(self):
        plan = plan_of_a_shard()
        w = torch.arange(32, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16)
        want = torch.zeros((4, 4), dtype=torch.bfloat16)
        plan.replay({"w": w}, {"p": want})
        got = torch.zeros((4, 4), dtype=torch.bfloat16)
        plan.replay({"w": HostBackedCuda(w)}, {"p": HostBackedCuda(got)}, stream=0)
        self.assertTrue(torch.equal(got, want))

    def test_sync_of_cuda_sources_into_cuda_params(self):
        loader = ferry.ModelLoader(BF16, "tp=1")
        trainer = TorchTrainerOnFakeCuda()
        host_params = {n: torch.zeros(d.shape, dtype=torch.bfloat16) for n, d in loader.params(0).items()}
        params = {n: HostBackedCuda(t) for n, t in host_params.items()}
        with ferry.StoreServer() as server:
            common = dict(store=server, backend="inproc", job="emulated-gpu", timeout=20.0)
            producer, consumer = run_threads([lambda: ferry.Producer(trainer, **common),
                                              lambda: ferry.Consumer(loader=loader, rank=0, params=params, **common)])
            want = expected_params(loader, trainer)
            for v in (1, 2):
                reports = run_threads([lambda: producer.sync(v), lambda: consumer.sync(v)])
                self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
                self.assertGreater(reports[1]["bytes"], 0)
                for n, t in want.items():
                    self.assertTrue(torch.equal(host_params[n].view(torch.int16), t.view(torch.int16)), n)
            producer.close()
            consumer.close()


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device (torch.cuda.is_available() is False)")
class RealCudaSyncTest(unittest.TestCase):
    def test_real_cuda_sync(self):
        """Trainer weights and inference params in GPU memory: two syncs, bit for bit."""
        loader = ferry.ModelLoader(BF16, "tp=1")
        trainer = TorchTrainer("cuda")
        params = {n: torch.zeros(d.shape, dtype=torch.bfloat16, device="cuda") for n, d in loader.params(0).items()}
        with ferry.StoreServer() as server:
            common = dict(store=server, backend="inproc", job="gpu-sync", timeout=20.0)
            producer, consumer = run_threads([lambda: ferry.Producer(trainer, **common),
                                              lambda: ferry.Consumer(loader=loader, rank=0, params=params, **common)])
            want = expected_params(loader, trainer)
            for v in (1, 2):
                reports = run_threads([lambda: producer.sync(v), lambda: consumer.sync(v)])
                self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
                for n, t in want.items():
                    self.assertTrue(torch.equal(params[n].cpu().view(torch.int16), t.view(torch.int16)), n)
            producer.close()
            consumer.close()


if __name__ == "__main__":
    unittest.main()
