"""Every error path of the Python bindings: classes, and messages that name op and tensor."""
import threading
import unittest

import numpy as np
import torch

import ferry


def make_plan():
    w = ferry.source("model.w", (8, 4), "bfloat16")
    p = ferry.param("layer.p", (4, 4), torch.bfloat16)
    with ferry.record() as plan:
        p.copy_(w[2:6])
    return plan


class ErrorTest(unittest.TestCase):
    def setUp(self):
        self.w = ferry.source("model.w", (8, 4), "bfloat16")
        self.p = ferry.param("layer.p", (4, 4), "bfloat16")

    def assert_raises_naming(self, cls, f, *needles):
        with self.assertRaises(cls) as cm:
            f()
        msg = str(cm.exception)
        for n in needles:
            self.assertIn(n, msg)
        self.assertIsInstance(cm.exception, ferry.Error)
        return cm.exception

    # --- value-dependent use of a recording tensor ----------------------------------
    def test_value_ops_raise_recording_error_naming_op_and_tensor(self):
        w = self.w
        cases = {
            "add": lambda: w + 1, "sub": lambda: 1 - w, "mul": lambda: w * 2, "div": lambda: w / 2,
            "matmul": lambda: w @ w.t(), "neg": lambda: -w, "eq": lambda: w == w, "lt": lambda: w < 0,
            "bool": lambda: bool(w), "item": lambda: w[0, 0].item(), "tolist": lambda: w.tolist(),
            "numpy": lambda: w.numpy(), "float": lambda: float(w[0, 0]), "int": lambda: int(w[0, 0]),
            "sum": lambda: w.sum(), "add_": lambda: w.add_(1), "clone": lambda: w.clone(),
            "index": lambda: [1, 2][w[0, 0]],
        }
        for op, f in cases.items():
            with self.subTest(op=op):
                e = self.assert_raises_naming(ferry.RecordingError, f, op, "model.w", "recording")
                self.assertIsInstance(e, RuntimeError)

    def test_numpy_and_torch_conversions(self):
        self.assert_raises_naming(ferry.RecordingError, lambda: np.asarray(self.w), "numpy", "model.w")
        self.assert_raises_naming(ferry.RecordingError, lambda: torch.cat([self.w, self.w]), "torch.cat", "model.w")
        self.assert_raises_naming(ferry.RecordingError, lambda: torch.add(self.w, 1), "torch.add", "model.w")
        self.assert_raises_naming(ferry.RecordingError, lambda: self.w.to(torch.float32), "to(", "model.w")
        self.assert_raises_naming(ferry.RecordingError, lambda: self.w.view(torch.int16), "view(dtype)", "model.w")
        real = torch.zeros(8, 4, dtype=torch.bfloat16)
        with ferry.record():
            self.assert_raises_naming(ferry.RecordingError, lambda: real.copy_(self.w), "copy_", "model.w")

    def test_copying_real_values_is_refused(self):
        with ferry.record():
            self.assert_raises_naming(ferry.RecordingError, lambda: self.p.copy_(torch.zeros(4, 4)), "copy_", "layer.p")
            self.assert_raises_naming(ferry.RecordingError, lambda: self.p.fill_(1.5), "fill_", "layer.p")
            self.assert_raises_naming(ferry.RecordingError, lambda: self.p.__setitem__(0, np.ones(4)), "setitem",
                                      "layer.p")

    def test_copy_without_record_names_tensor(self):
        e = self.assert_raises_naming(ferry.RecordingError, lambda: self.p.copy_(self.w[:4]), "copy_", "model.w",
                                      "no Recorder is active")
        self.assertEqual(e.code, "FailedPrecondition")
        self.assert_raises_naming(ferry.RecordingError, lambda: self.p.zero_(), "zero_", "layer.p")

    def test_recording_in_another_thread_is_not_collected(self):
        errors = []

        def other():
            try:
                self.p.copy_(self.w[:4])
            except ferry.RecordingError as e:
                errors.append(e)

        with ferry.record() as plan:
            t = threading.Thread(target=other)
            t.start()
            t.join()
        self.assertEqual(len(errors), 1)
        self.assertEqual(plan.stats()["copies"], 0)

    def test_bad_copies(self):
        with ferry.record() as plan:
            self.assert_raises_naming(ValueError, lambda: self.p.copy_(self.w), "numel", "model.w", "layer.p")
            self.assert_raises_naming(ferry.InvalidArgumentError, lambda: self.w[4:].zero_(), "zero_", "model.w")
            self.p.copy_(self.w[:4])
        self.assertEqual(plan.stats()["copies"], 1)
        # A failed record poisons the recording: the block's exit raises it again, so a
        # loader that swallowed the error can't produce an incomplete plan.
        with self.assertRaises(ferry.InvalidArgumentError) as cm:
            with ferry.record():
                self.assert_raises_naming(ferry.InvalidArgumentError, lambda: self.w[:4].copy_(self.w[4:]),
                                          "checkpoint source", "model.w")
        self.assertIn("checkpoint source", str(cm.exception))

    def test_plan_unusable_inside_record(self):
        with ferry.record() as plan:
            self.assert_raises_naming(ferry.FailedPreconditionError, plan.stats, "not finished")

    def test_exception_in_record_block_propagates_and_ends_recording(self):
        with self.assertRaises(KeyError):
            with ferry.record():
                raise KeyError("boom")
        # No recorder left behind on this thread.
        self.assert_raises_naming(ferry.RecordingError, lambda: self.p.copy_(self.w[:4]), "no Recorder is active")

    # --- bad indices and view arguments ----------------------------------------------
    def test_bad_indices(self):
        w = self.w
        idx_cases = {
            "select": (lambda: w[8], ["index 8", "model.w"]),
            "select_neg": (lambda: w[-9], ["index -9", "model.w"]),
            "select_dim": (lambda: w.select(2, 0), ["dim 2", "model.w"]),
            "too_many": (lambda: w[0, 0, 0], ["too many indices", "model.w"]),
            "ellipses": (lambda: w[..., ...], ["single ellipsis"]),
            "narrow": (lambda: w.narrow(0, 9, 0), ["narrow", "start 9", "model.w"]),
            "narrow_dim": (lambda: w.narrow(3, 0, 1), ["narrow", "dim 3"]),
            "transpose": (lambda: w.transpose(0, 5), ["transpose", "model.w"]),
            "size": (lambda: w.size(2), ["size", "model.w"]),
            "unsqueeze": (lambda: w.unsqueeze(4), ["unsqueeze", "model.w"]),
        }
        for name, (f, needles) in idx_cases.items():
            with self.subTest(case=name):
                self.assert_raises_naming(IndexError, f, *needles)
                self.assert_raises_naming(ferry.OutOfRangeError, f, *needles)

    def test_bad_view_arguments(self):
        w = self.w
        value_cases = {
            "step": (lambda: w[::-1], ["step", "model.w"]),
            "view": (lambda: w.view(3, -1), ["view", "model.w"]),
            "narrow_length": (lambda: w.narrow(0, 6, 4), ["narrow", "exceeds", "model.w"]),
            "view_strides": (lambda: w.t().view(32), ["view", "reshape"]),
            "split": (lambda: w.split([3, 3]), ["split", "sum"]),
            "chunk": (lambda: w.chunk(0), ["chunk", "positive"]),
            "permute": (lambda: w.permute(0, 0), ["permute", "model.w"]),
            "t": (lambda: w.unsqueeze(0).t(), ["t", "model.w"]),
            "unflatten": (lambda: w.unflatten(1, (3, 2)), ["unflatten"]),
        }
        for name, (f, needles) in value_cases.items():
            with self.subTest(case=name):
                self.assert_raises_naming(ValueError, f, *needles)
        self.assert_raises_naming(ferry.RecordingError, lambda: w[[0, 1]], "advanced indexing", "model.w")
        self.assert_raises_naming(ferry.RecordingError, lambda: w[torch.tensor([0])], "advanced indexing")
        with self.assertRaises(TypeError):
            len(w[0, 0])

    def test_bad_construction(self):
        self.assert_raises_naming(ValueError, lambda: ferry.source("x", (2, 2), "float128"), "float128")
        self.assert_raises_naming(ValueError, lambda: ferry.source("", (2, 2), "float32"), "name")
        self.assert_raises_naming(ValueError, lambda: ferry.param("x", (2, -1), "float32"), "negative")
        self.assertEqual(ferry.source("x", 3, np.float16).shape, (3,))
        self.assertEqual(ferry.source("x", [3], np.dtype("int64")).dtype, torch.int64)

    # --- replay ----------------------------------------------------------------------
    def test_replay_shape_mismatch_names_tensor(self):
        plan = make_plan()
        src = torch.zeros(8, 4, dtype=torch.bfloat16)
        e = self.assert_raises_naming(ferry.ShapeMismatchError, lambda: plan.replay({"model.w": src}, {
            "layer.p": torch.zeros(4, 5, dtype=torch.bfloat16)}), "param 'layer.p'", "[4, 5]", "[4, 4]")
        self.assertIsInstance(e, ValueError)
        self.assert_raises_naming(ferry.ShapeMismatchError, lambda: plan.replay({"model.w": src[:7]}, {
            "layer.p": torch.zeros(4, 4, dtype=torch.bfloat16)}), "source 'model.w'", "[7, 4]")

    def test_replay_dtype_mismatch_names_tensor(self):
        plan = make_plan()
        dst = torch.zeros(4, 4, dtype=torch.bfloat16)
        self.assert_raises_naming(ferry.DTypeMismatchError, lambda: plan.replay({"model.w": torch.zeros(8, 4)}, {
            "layer.p": dst}), "source 'model.w'", "F32", "BF16")
        self.assert_raises_naming(ferry.DTypeMismatchError, lambda: plan.replay(
            {"model.w": np.zeros((8, 4), np.float16)}, {"layer.p": dst}), "source 'model.w'", "F16")
        self.assert_raises_naming(ferry.DTypeMismatchError, lambda: plan.replay(
            {"model.w": np.zeros((8, 4), np.float64)}, {"layer.p": dst}), "source 'model.w'", "format 'd'")
        self.assert_raises_naming(ferry.DTypeMismatchError, lambda: plan.replay(
            {"model.w": torch.zeros(8, 4, dtype=torch.float64)}, {"layer.p": dst}), "source 'model.w'", "float64")

    def test_replay_missing_and_bad_objects(self):
        plan = make_plan()
        src = torch.zeros(8, 4, dtype=torch.bfloat16)
        dst = torch.zeros(4, 4, dtype=torch.bfloat16)
        e = self.assert_raises_naming(KeyError, lambda: plan.replay({}, {"layer.p": dst}), "source 'model.w'",
                                      "missing")
        self.assertIsInstance(e, ferry.NotFoundError)
        self.assert_raises_naming(KeyError, lambda: plan.replay({"model.w": src}, {}), "param 'layer.p'", "missing")
        self.assert_raises_naming(ValueError, lambda: plan.replay({"model.w": [1, 2]}, {"layer.p": dst}),
                                  "source 'model.w'", "list")
        self.assert_raises_naming(ValueError, lambda: plan.replay([("model.w", src)], {"layer.p": dst}), "mapping")
        self.assert_raises_naming(ValueError, lambda: plan.replay({"model.w": src}, {
            "layer.p": torch.zeros(4, 4, dtype=torch.bfloat16).t()}), "param 'layer.p'", "contiguous")
        self.assert_raises_naming(ValueError, lambda: plan.replay({"model.w": src}, {
            "layer.p": torch.zeros(4, 8, dtype=torch.bfloat16)[:, ::2]}), "param 'layer.p'", "contiguous")
        ro = np.zeros((4, 4), np.float32)
        ro.flags.writeable = False
        plan32 = ferry.Plan()  # an unfinished plan
        self.assert_raises_naming(ferry.FailedPreconditionError, lambda: plan32.replay({}, {}), "not finished")
        w = ferry.source("w", (4, 4), "float32")
        p = ferry.param("p", (4, 4), "float32")
        with ferry.record() as plan32:
            p.copy_(w)
        self.assert_raises_naming(ValueError, lambda: plan32.replay({"w": np.zeros((4, 4), np.float32)}, {"p": ro}),
                                  "param 'p'", "writ")
        self.assert_raises_naming(ValueError, lambda: plan32.replay({"w": np.zeros((8, 4), np.float32)[::2]},
                                                                    {"p": np.zeros((4, 4), np.float32)}),
                                  "source 'w'", "contiguous")
        if torch.cuda.is_available():
            self.assert_raises_naming(ValueError, lambda: plan32.replay({"w": torch.zeros(4, 4, device="cuda")},
                                                                        {"p": np.zeros((4, 4), np.float32)}), "cuda")

    def test_from_bytes_rejects_garbage(self):
        good = make_plan().to_bytes()
        for bad in [b"", b"\x00" * 7, b"garbage!" * 10, good[:-1], good[: len(good) // 2]]:
            with self.subTest(n=len(bad)):
                with self.assertRaises(ferry.CorruptError) as cm:
                    ferry.Plan.from_bytes(bad)
                self.assertIsInstance(cm.exception, ValueError)
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.Plan.from_bytes("a string")
        self.assertEqual(ferry.Plan.from_bytes(bytearray(good)), make_plan())

    def test_coverage_errors_name_the_param(self):
        w = ferry.source("w", (4,), "float32")
        p = ferry.param("p", (6,), "float32")
        with ferry.record() as plan:
            p[:4].copy_(w)
        self.assert_raises_naming(ferry.Error, plan.check_coverage, "'p'")
        plan.check_coverage(allow_unwritten=True)
        with self.assertRaises(ferry.Error):
            with ferry.record(check_coverage=True):
                p[:4].copy_(w)
                p[3:5].copy_(w[:2])

    def test_error_classes(self):
        self.assertTrue(issubclass(ferry.RecordingError, ferry.Error))
        self.assertTrue(issubclass(ferry.OutOfRangeError, IndexError))
        self.assertTrue(issubclass(ferry.NotFoundError, KeyError))
        self.assertTrue(issubclass(ferry.ShapeMismatchError, ValueError))
        self.assertTrue(issubclass(ferry.DTypeMismatchError, TypeError))
        self.assertEqual(str(ferry.NotFoundError("x 'y'")), "x 'y'")
        self.assertEqual(ferry.RecordingError.__module__, "ferry")


if __name__ == "__main__":
    unittest.main()
