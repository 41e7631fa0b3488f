"""Plan.replay with torch CUDA tensors, as far as a machine without a GPU can check it:
a tensor that says it is on cuda:0 binds as device memory and the replay goes to the
GPU path, which fails naming the device and why no CUDA device can be used (or, where
one can, replays on the GPU and agrees with the host)."""
import unittest

import torch

import ferry


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
        if torch.cuda.is_available():
            self.skipTest("a real GPU is here: test_real_cuda_replay covers it")
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


if __name__ == "__main__":
    unittest.main()
