"""Recording a plain-torch vLLM-style loader and replaying it: bit-identical params.

Run: PYTHONPATH=<build>/python /usr/bin/python3 -m unittest tests/python/test_record.py
"""
import os
import sys
import threading
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
from vllm_style_loader import Config, Loader, checkpoint_shapes, param_shapes  # noqa: E402


def random_checkpoint(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in checkpoint_shapes(cfg).items():
        out[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return out


def bits(t):
    """A tensor's bytes, for bit-for-bit comparison (NaN and -0 included)."""
    return t.contiguous().view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)


def sentinel_params(cfg, rank, tp):
    # Not zeros: a replay that forgot an element (padding included) must show.
    return {n: torch.full(shape, 7.0, dtype=dt) for n, (shape, dt) in param_shapes(cfg, rank, tp).items()}


def load_real(cfg, rank, tp, ckpt):
    params = sentinel_params(cfg, rank, tp)
    Loader(cfg, rank, tp).load_weights(params, ckpt.items())
    return params


def record(cfg, rank, tp):
    params = {n: ferry.param(n, shape, dt) for n, (shape, dt) in param_shapes(cfg, rank, tp).items()}
    weights = [(n, ferry.source(n, shape, dt)) for n, (shape, dt) in checkpoint_shapes(cfg).items()]
    with ferry.record() as plan:
        loaded = Loader(cfg, rank, tp).load_weights(params, weights)
    assert loaded == set(params), set(params) ^ loaded
    return plan


class RecordReplayTest(unittest.TestCase):
    def assert_bit_identical(self, expected, actual):
        self.assertEqual(set(expected), set(actual))
        for name in expected:
            e, a = expected[name], actual[name]
            self.assertEqual(e.dtype, a.dtype, name)
            self.assertEqual(e.shape, a.shape, name)
            self.assertTrue(torch.equal(bits(e), bits(a)), f"{name} differs")

    def check_config(self, cfg, tp, seed=1):
        ckpt = random_checkpoint(cfg, seed)
        for rank in range(tp):
            with self.subTest(tp=tp, rank=rank):
                expected = load_real(cfg, rank, tp, ckpt)
                plan = record(cfg, rank, tp)
                plan.check_coverage()  # every param element written exactly once
                actual = sentinel_params(cfg, rank, tp)
                plan.replay(ckpt, actual)
                self.assert_bit_identical(expected, actual)

    def test_bf16_tp1(self):
        self.check_config(Config(), tp=1)

    def test_bf16_tp2(self):
        self.check_config(Config(), tp=2)

    def test_bf16_tp4_replicated_kv_heads(self):
        # 2 kv heads on 4 ranks: each kv head replicated on 2 ranks.
        self.check_config(Config(), tp=4)

    def test_fp16_and_fp32_models(self):
        self.check_config(Config(dtype=torch.float16), tp=2)
        self.check_config(Config(dtype=torch.float32, unpermute_k=False), tp=2)

    def test_numpy_replay_bit_identical(self):
        cfg = Config(dtype=torch.float32)
        ckpt = random_checkpoint(cfg, 3)
        expected = load_real(cfg, 1, 2, ckpt)
        plan = record(cfg, 1, 2)
        np_src = {n: t.numpy() for n, t in ckpt.items()}
        # Read-only sources (e.g. a memory-mapped checkpoint) are fine.
        for a in np_src.values():
            a.flags.writeable = False
        np_dst = {n: np.full(tuple(t.shape), 7, dtype=np.float32) for n, t in expected.items()}
        plan.replay(np_src, np_dst)
        for n, t in expected.items():
            self.assertTrue(np.array_equal(t.numpy().view(np.uint32), np_dst[n].view(np.uint32)), n)

    def test_replay_is_zero_copy_and_in_place(self):
        cfg = Config()
        ckpt = random_checkpoint(cfg, 4)
        plan = record(cfg, 0, 2)
        params = sentinel_params(cfg, 0, 2)
        ptrs = {n: t.data_ptr() for n, t in params.items()}
        plan.replay(ckpt, params)
        self.assertEqual(ptrs, {n: t.data_ptr() for n, t in params.items()})
        # Params may be views into a bigger buffer (e.g. one flat allocation).
        flat = {dt: torch.zeros(sum(t.numel() for t in params.values() if t.dtype == dt), dtype=dt)
                for dt in {t.dtype for t in params.values()}}
        views, off = {}, {dt: 0 for dt in flat}
        for n, t in params.items():
            o = off[t.dtype]
            views[n] = flat[t.dtype][o:o + t.numel()].view(t.shape)
            off[t.dtype] = o + t.numel()
        plan.replay(ckpt, views)
        self.assert_bit_identical(params, views)

    def test_dlpack_objects(self):
        # Any CPU array with __dlpack__ (here: torch tensors behind a wrapper that hides
        # everything else), bf16 included.
        class DLPackOnly:
            def __init__(self, t):
                self._t = t

            def __dlpack__(self, stream=None):
                return self._t.__dlpack__()

            def __dlpack_device__(self):
                return self._t.__dlpack_device__()

        cfg = Config()
        ckpt = random_checkpoint(cfg, 7)
        expected = load_real(cfg, 1, 2, ckpt)
        actual = sentinel_params(cfg, 1, 2)
        record(cfg, 1, 2).replay({n: DLPackOnly(t) for n, t in ckpt.items()},
                                 {n: DLPackOnly(t) for n, t in actual.items()})
        self.assert_bit_identical(expected, actual)
        with self.assertRaises(ferry.ShapeMismatchError):
            record(cfg, 1, 2).replay({n: DLPackOnly(t[:1]) for n, t in ckpt.items()}, actual)

    def test_same_rank_same_plan(self):
        cfg = Config()
        a, b = record(cfg, 1, 4), record(cfg, 1, 4)
        self.assertEqual(a.hash(), b.hash())
        self.assertEqual(a.to_bytes(), b.to_bytes())
        self.assertEqual(a, b)
        self.assertNotEqual(a.hash(), record(cfg, 2, 4).hash())

    def test_serialization_round_trip(self):
        cfg = Config()
        plan = record(cfg, 1, 2)
        again = ferry.Plan.from_bytes(plan.to_bytes())
        self.assertEqual(plan, again)
        self.assertEqual(plan.hash(), again.hash())
        self.assertEqual(plan.stats(), again.stats())
        ckpt = random_checkpoint(cfg, 5)
        expected = load_real(cfg, 1, 2, ckpt)
        actual = sentinel_params(cfg, 1, 2)
        again.replay(ckpt, actual)
        self.assert_bit_identical(expected, actual)

    def test_stats_and_declarations(self):
        cfg = Config()
        plan = record(cfg, 1, 2)  # rank 1 holds the padded tail of the vocab
        s = plan.stats()
        shapes = param_shapes(cfg, 1, 2)
        self.assertEqual(set(plan.params), set(shapes))
        self.assertEqual(set(plan.sources), set(checkpoint_shapes(cfg)))
        decl = plan.params["model.norm.weight"]
        self.assertEqual(decl.shape, (cfg.hidden,))
        self.assertEqual(decl.dtype, "float32")
        total = sum(int(np.prod(shape)) for shape, _ in shapes.values())
        self.assertEqual(s["elements"] + s["zero_elements"], total)
        self.assertGreater(s["zeros"], 0)  # vocab padding
        self.assertEqual(s["params"], len(shapes))
        self.assertIn("copies", repr(plan))

    def test_extra_entries_are_ignored(self):
        cfg = Config()
        ckpt = random_checkpoint(cfg, 6)
        ckpt["unrelated"] = torch.zeros(3)
        params = sentinel_params(cfg, 0, 1)
        params["other"] = torch.zeros(2)
        record(cfg, 0, 1).replay(ckpt, params)

    def test_recording_is_per_thread(self):
        cfg = Config()
        results = {}

        def work(rank):
            results[rank] = record(cfg, rank, 4).hash()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results, {r: record(cfg, r, 4).hash() for r in range(4)})

    def test_concurrent_replays_release_the_gil(self):
        # Big enough to take a while; replays in threads must all finish correctly.
        n = 1 << 20
        src = ferry.source("w", (4, n), "float32")
        dst = ferry.param("p", (n, 4), "float32")
        with ferry.record() as plan:
            dst.copy_(src.t())
        w = torch.randn(4, n)
        outs = [torch.zeros(n, 4) for _ in range(4)]
        threads = [threading.Thread(target=plan.replay, args=({"w": w}, {"p": o}), kwargs={"threads": 1}) for o in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for o in outs:
            self.assertTrue(torch.equal(o, w.t()))

    def test_view_ops_match_torch(self):
        # Every supported view op, checked against torch on the same index space.
        shape = (4, 6, 8)
        real = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape)
        src = ferry.source("x", shape, torch.float32)
        cases = {
            "narrow": lambda t: t.narrow(1, 2, 3),
            "select": lambda t: t.select(2, -1),
            "int_slice": lambda t: t[1, 1:5:2],
            "neg_slice": lambda t: t[-3:, :, -4:-1],
            "ellipsis_none": lambda t: t[..., None, 1::3],
            "view": lambda t: t.view(4, 48),
            "view_tuple": lambda t: t.view((2, 2, 6, 8)),
            "reshape_copy": lambda t: t.transpose(0, 2).reshape(8, 24),
            "flatten": lambda t: t.permute(2, 0, 1).flatten(1),
            "unflatten": lambda t: t.unflatten(2, (2, 4)),
            "unsqueeze_squeeze": lambda t: t.unsqueeze(0).squeeze(0).unsqueeze(-1).squeeze(),
            "chunk": lambda t: t.chunk(3, dim=1)[2],
            "split": lambda t: t.split([1, 3], dim=0)[1],
            "split_int": lambda t: t.split(5, dim=2)[1],
            "unbind": lambda t: t.unbind(1)[4],
            "t_T": lambda t: t[0].t()[1:].T,
            "contiguous": lambda t: t.transpose(1, 2).contiguous()[1],
            "torch_fn": lambda t: torch.narrow(torch.transpose(t, 0, 1), 0, 1, 2),
        }
        for name, f in cases.items():
            with self.subTest(op=name):
                expect = f(real)
                view = f(src)
                self.assertEqual(tuple(view.shape), tuple(expect.shape))
                if view.is_contiguous() is True and expect.is_contiguous():
                    self.assertEqual(view.stride(), expect.stride())
                p = ferry.param("out", tuple(expect.shape), torch.float32)
                with ferry.record() as plan:
                    p.copy_(view)
                out = torch.zeros(expect.shape)
                plan.replay({"x": real}, {"out": out})
                self.assertTrue(torch.equal(out, expect), name)

    def test_setitem_and_torch_metadata(self):
        src = ferry.source("w", (6, 4), "bfloat16")
        p = ferry.param("p", (8, 4), torch.bfloat16)
        self.assertIs(p.data, p)
        self.assertEqual(p.shape, torch.Size([8, 4]))
        self.assertEqual(p.dtype, torch.bfloat16)
        self.assertEqual((p.ndim, p.dim(), p.size(0), p.size(-1), p.numel()), (2, 2, 8, 4, 32))
        self.assertEqual(p.stride(), (4, 1))
        self.assertEqual(len(p), 8)
        self.assertEqual(len(list(p)), 8)
        self.assertIs(p.to(torch.bfloat16), p)
        self.assertEqual(p.element_size(), 2)
        with ferry.record() as plan:
            p[:6] = src
            p[6:] = 0
        w = torch.randn(6, 4).bfloat16()
        out = torch.full((8, 4), 3.0, dtype=torch.bfloat16)
        plan.replay({"w": w}, {"p": out})
        self.assertTrue(torch.equal(out[:6], w))
        self.assertTrue(torch.equal(out[6:], torch.zeros(2, 4, dtype=torch.bfloat16)))

    def test_vllm_weight_attrs(self):
        # vLLM hangs weight_loader / output_dim on params; loaders read them with getattr.
        p = ferry.param("p", (4, 2), "float32")
        src = ferry.source("w", (8, 2), "float32")

        def sharded_loader(param, w):
            d = param.output_dim
            param.data.copy_(w.narrow(d, 4, param.shape[d]))

        p.weight_loader = sharded_loader
        p.output_dim = 0
        self.assertIsNone(getattr(p, "input_dim", None))
        with ferry.record() as plan:
            getattr(p, "weight_loader", None)(p, src)
        w = torch.randn(8, 2)
        out = torch.zeros(4, 2)
        plan.replay({"w": w}, {"p": out})
        self.assertTrue(torch.equal(out, w[4:]))

    def test_nested_records(self):
        a, b = ferry.source("a", (2,), "float32"), ferry.source("b", (2,), "float32")
        pa, pb = ferry.param("pa", (2,), "float32"), ferry.param("pb", (2,), "float32")
        with ferry.record() as outer:
            pa.copy_(a)
            with ferry.record() as inner:
                pb.copy_(b)
        self.assertEqual(set(outer.params), {"pa"})
        self.assertEqual(set(inner.params), {"pb"})


if __name__ == "__main__":
    unittest.main()
