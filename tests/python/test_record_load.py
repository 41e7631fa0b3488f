"""ferry.record_load: recording an unmodified nn.Module's own vLLM-style load_weights.

Run: PYTHONPATH=<build>/python /usr/bin/python3 -m unittest tests/python/test_record_load.py
"""
import os
import sys
import threading
import unittest

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ferry  # noqa: E402
from llama_vllm import TEST_CONFIG, LlamaForCausalLM, hf_shapes, random_hf_state, tp_forward, hf_forward  # noqa: E402


def bits(t):
    return t.detach().contiguous().view(torch.uint8) if t.dim() > 0 else t.detach().reshape(1).view(torch.uint8)


def sentinel(module):
    """The module's params set to 7 (not zeros: a forgotten element, padding included, shows)."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(7.0)
    return module


def loaded_by_itself(tp_rank, tp_size, state):
    m = sentinel(LlamaForCausalLM(TEST_CONFIG, tp_rank, tp_size))
    m.load_weights(state.items())
    return m


class Toy(nn.Module):
    """One param with vLLM-style attributes, and a load_weights the tests swap."""

    def __init__(self, loader=None):
        super().__init__()
        self.proj = nn.Linear(4, 8, bias=False)
        self.proj.weight.output_dim = 0
        self.proj.weight.weight_loader = self._load
        self._loader = loader

    def _load(self, param, w):
        param.data.copy_(w)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            self._loader(params, name, w)


TOY_META = {"w": ((8, 4), torch.float32)}


class RecordLoadTest(unittest.TestCase):
    def assert_same_params(self, expected, actual):
        self.assertEqual(set(expected), set(actual))
        for name in expected:
            e, a = expected[name], actual[name]
            self.assertEqual((e.dtype, e.shape), (a.dtype, a.shape), name)
            self.assertTrue(torch.equal(bits(e), bits(a)), f"{name} differs")

    def check_layout(self, tp):
        state = random_hf_state(TEST_CONFIG, seed=tp)
        for rank in range(tp):
            with self.subTest(tp=tp, rank=rank):
                module = sentinel(LlamaForCausalLM(TEST_CONFIG, rank, tp))
                before = dict(module.named_parameters())
                plan = ferry.record_load(module, hf_shapes(TEST_CONFIG), check_coverage=True)
                # The plan's params are the module's parameter names, shapes and dtypes.
                self.assertEqual({n: (tuple(d.shape), d.dtype) for n, d in plan.params.items()},
                                 {n: (tuple(p.shape), str(p.dtype)[6:]) for n, p in before.items()})
                self.assertEqual(set(plan.sources), set(hf_shapes(TEST_CONFIG)))
                # The real parameters are back, untouched (recording writes nothing).
                after = dict(module.named_parameters())
                self.assertTrue(all(after[n] is before[n] for n in before))
                self.assertTrue(all(bool((p == 7).all()) for p in after.values()))
                # Replaying into the module's own params == its own load_weights.
                plan.replay(state, after)
                self.assert_same_params(dict(loaded_by_itself(rank, tp, state).named_parameters()), after)

    def test_tp1_plan_replays_bit_identical_to_load_weights(self):
        self.check_layout(1)

    def test_tp2_plans_replay_bit_identical_to_load_weights(self):
        self.check_layout(2)

    def test_tp4_replicated_kv_heads(self):
        # 2 kv heads on 4 ranks: each kv head replicated on 2 ranks.
        self.check_layout(4)
        # Ranks 0 and 1 read the same kv head but different q heads: different plans; the
        # same rank recorded twice (another replica) has the same plan.
        plans = [ferry.record_load(LlamaForCausalLM(TEST_CONFIG, r, 4), hf_shapes(TEST_CONFIG)) for r in (0, 1, 0)]
        self.assertNotEqual(plans[0].hash(), plans[1].hash())
        self.assertEqual(plans[0].hash(), plans[2].hash())

    def test_replayed_modules_give_the_trainers_logits(self):
        state = random_hf_state(TEST_CONFIG, seed=5)
        ids = torch.randint(0, TEST_CONFIG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(3))
        ranks = []
        for rank in range(2):
            m = sentinel(LlamaForCausalLM(TEST_CONFIG, rank, 2))
            ferry.record_load(m, hf_shapes(TEST_CONFIG)).replay(state, dict(m.named_parameters()))
            ranks.append(m)
        torch.testing.assert_close(tp_forward(ranks, ids), hf_forward(state, ids), rtol=1e-5, atol=1e-5)

    def test_metadata_forms(self):
        meta = hf_shapes(TEST_CONFIG)
        module = LlamaForCausalLM(TEST_CONFIG, 0, 2)
        plan = ferry.record_load(module, meta)
        decls = [ferry.TensorDecl(n, s, str(d)[6:]) for n, (s, d) in meta.items()]
        self.assertEqual(ferry.record_load(module, decls), plan)
        self.assertEqual(ferry.record_load(module, {d.name: d for d in decls}), plan)
        self.assertEqual(ferry.record_load(module, [(n, s, d) for n, (s, d) in meta.items()]), plan)
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.record_load(module, {"w": 3})

    def test_recording_tensors_are_torch_tensors(self):
        seen = {}

        def load(params, name, w):
            p = params["proj.weight"]
            seen["types"] = (isinstance(p, torch.Tensor), isinstance(w, torch.Tensor), isinstance(p.data, torch.Tensor))
            seen["attrs"] = (p.output_dim, p.weight_loader.__name__)
            seen["meta"] = (p.shape, p.dtype, p.dim(), p.size(0), p.numel(), w.stride(), p.is_contiguous(),
                            p.device.type, len(w), p.is_floating_point())
            # views with torch's names, methods and functions alike
            top, bottom = w.chunk(2)
            torch.narrow(p.data, 0, 0, 4).copy_(top)
            p[4:].data.copy_(torch.narrow(bottom, 1, 0, 4))
            seen["views"] = (tuple(w.t().shape), tuple(w.T.shape), tuple(w[1].shape), tuple(w[:, None, 1:3].shape),
                             tuple(w.view(2, 16).shape), tuple(w.reshape(-1).shape), tuple(torch.transpose(w, 0, 1).shape),
                             len(list(iter(w))), tuple(w.unsqueeze(0).squeeze(0).shape), tuple(w.flatten().shape))

        module = Toy(load)
        plan = ferry.record_load(module, TOY_META, check_coverage=True)
        self.assertEqual(seen["types"], (True, True, True))
        self.assertEqual(seen["attrs"], (0, "_load"))
        self.assertEqual(seen["meta"], (torch.Size([8, 4]), torch.float32, 2, 8, 32, (4, 1), True, "meta", 8, True))
        self.assertEqual(seen["views"], ((4, 8), (4, 8), (4,), (8, 1, 2), (2, 16), (32,), (4, 8), 8, (8, 4), (32,)))
        w = torch.randn(8, 4)
        out = {"proj.weight": torch.zeros(8, 4)}
        plan.replay({"w": w}, out)
        self.assertTrue(torch.equal(out["proj.weight"], w))
        # The real parameter is back, with its attributes.
        self.assertIsInstance(module.proj.weight, nn.Parameter)
        self.assertEqual(module.proj.weight.output_dim, 0)

    def test_zero_fill_and_setitem(self):
        def load(params, name, w):
            p = params["proj.weight"]
            p.data[:2] = w[:2]
            p[2:4].zero_()
            p.data[4:6].fill_(0)
            p[6:].data.copy_(w[6:])

        plan = ferry.record_load(Toy(load), TOY_META, check_coverage=True)
        w = torch.randn(8, 4)
        out = {"proj.weight": torch.full((8, 4), 7.0)}
        plan.replay({"w": w}, out)
        expected = w.clone()
        expected[2:6] = 0
        self.assertTrue(torch.equal(out["proj.weight"], expected))

    def test_value_dependent_ops_name_op_and_tensor(self):
        cases = {
            "mul": lambda p, w: p.data.copy_(w * 2),
            "item": lambda p, w: w[0, 0].item(),
            "sum": lambda p, w: w.sum(),
            "torch.cat": lambda p, w: torch.cat([w, w]),
            "bool": lambda p, w: bool(w[0, 0]),
            "clone": lambda p, w: p.copy_(w.clone()),
            "add_": lambda p, w: p.add_(1),
        }
        for op, fn in cases.items():
            with self.subTest(op=op):
                module = Toy(lambda params, name, w, fn=fn: fn(params["proj.weight"], w))
                with self.assertRaises(ferry.RecordingError) as cm:
                    ferry.record_load(module, TOY_META)
                msg = str(cm.exception)
                self.assertIn(op, msg)
                self.assertTrue("'w'" in msg or "'proj.weight'" in msg, msg)
                self.assertIsInstance(module.proj.weight, nn.Parameter)  # restored after the error
        # A real tensor copied into a param, and a recording source into a real tensor.
        with self.assertRaisesRegex(ferry.RecordingError, "real values"):
            ferry.record_load(Toy(lambda params, name, w: params["proj.weight"].copy_(torch.ones(8, 4))), TOY_META)
        with self.assertRaisesRegex(ferry.RecordingError, "into a real torch tensor"):
            ferry.record_load(Toy(lambda params, name, w: torch.zeros(8, 4).copy_(w)), TOY_META)

    def test_copy_shape_rules_are_torchs(self):
        # torch refuses p(8,4).copy_(w.t()) for w (8,4): so does the recorder.
        with self.assertRaises(RuntimeError):
            torch.zeros(8, 4).copy_(torch.zeros(8, 4).t())
        module = Toy(lambda params, name, w: params["proj.weight"].copy_(w.t()))
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "does not broadcast") as cm:
            ferry.record_load(module, {"w": ((8, 4), torch.float32)})
        self.assertIn("'w'", str(cm.exception))
        # What torch broadcasts, the recorder records: a row into every row.
        plan = ferry.record_load(Toy(lambda params, name, w: params["proj.weight"].copy_(w)),
                                 {"b": ((4,), torch.float32)}, check_coverage=True)
        b = torch.randn(4)
        out = {"proj.weight": torch.zeros(8, 4)}
        plan.replay({"b": b}, out)
        self.assertTrue(torch.equal(out["proj.weight"], torch.zeros(8, 4).copy_(b)))

    def test_params_restored_when_load_weights_raises(self):
        module = LlamaForCausalLM(TEST_CONFIG, 0, 1)
        before = dict(module.named_parameters())

        def broken(weights):
            next(iter(weights))
            raise KeyError("engine bug")

        with self.assertRaises(KeyError):
            ferry.record_load(module, hf_shapes(TEST_CONFIG), load_weights=broken)
        after = dict(module.named_parameters())
        self.assertTrue(all(after[n] is before[n] for n in before))
        self.assertTrue(all(isinstance(p, nn.Parameter) for p in after.values()))
        self.assertEqual(module.model.embed_tokens.weight.output_dim, 0)

    def test_tied_parameters_record_under_their_first_name(self):
        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(4, 8, bias=False)
                self.b = nn.Linear(4, 8, bias=False)
                self.b.weight = self.a.weight

            def load_weights(self, weights):
                for name, w in weights:
                    self.b.weight.data.copy_(w)

        module = Tied()
        plan = ferry.record_load(module, TOY_META)
        self.assertEqual(list(plan.params), ["a.weight"])
        self.assertIs(module.b.weight, module.a.weight)


class HFTrainer(ferry.WeightSource if hasattr(ferry, "WeightSource") else object):
    """A single-rank trainer serving an HF state dict (the plain, existing API)."""

    def __init__(self, state):
        super().__init__(rank=0, world_size=1)
        self.state = state

    def metadata(self):
        return hf_shapes(TEST_CONFIG)

    def materialize(self, group):
        return {name: self.state[name] for name, _, _ in self.boxes(group)}


def run_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i, f):
        try:
            results[i] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@unittest.skipUnless(hasattr(ferry, "Consumer"), "ferry built without its engine")
class ConsumerFromRecordedPlanTest(unittest.TestCase):
    """A WeightSource producer syncs into ferry.Consumer(plan=record_load(module), params=
    the module's own parameters): the module then equals its own load_weights."""

    BACKEND = "inproc" if "inproc" in (ferry.transport_backends() if hasattr(ferry, "transport_backends") else []) \
        else "ucx"

    def make(self, server, trainer, modules, job, **consumer_kw):
        common = dict(token=server.token, backend=self.BACKEND, job=job, timeout=20.0, rendezvous_timeout=20.0)
        if self.BACKEND == "ucx":
            common["transport_params"] = {"tls": "tcp,self", "net_devices": "lo"}
        makers = [lambda: ferry.Producer(trainer, server.url, num_consumers=len(modules), **common)]
        makers += [lambda r=r, m=m: ferry.Consumer(plan=ferry.record_load(m, hf_shapes(TEST_CONFIG)),
                                                   params=dict(m.named_parameters()), rank=r, store=server,
                                                   num_consumers=len(modules), **common, **consumer_kw)
                   for r, m in enumerate(modules)]
        made = run_threads(makers)
        return made[0], made[1:]

    def sync(self, producer, consumers, version):
        return run_threads([lambda: producer.sync(version)] + [lambda c=c: c.sync(version) for c in consumers])

    def test_tp2_module_params_equal_their_own_load_weights(self):
        modules = [sentinel(LlamaForCausalLM(TEST_CONFIG, r, 2)) for r in range(2)]
        trainer = HFTrainer(random_hf_state(TEST_CONFIG, seed=11))
        events = []
        groups = []
        with ferry.StoreServer() as server:
            producer, consumers = self.make(
                server, trainer, modules, "record-load-tp2",
                before_sync=lambda v: events.append(("before", v)),
                after_group=lambda v, g: groups.append((v, g)),
                after_sync=lambda v: events.append(("after", v)),
                post_process=lambda name, params: events.append(("post", name, sorted(params))))
            for version in (1, 2):
                trainer.state = random_hf_state(TEST_CONFIG, seed=10 + version)
                reports = self.sync(producer, consumers, version)
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                self.assertGreater(sum(rep["bytes_received"] for rep in reports[1:]), 0)
                for r, (m, c) in enumerate(zip(modules, consumers)):
                    self.assertEqual(c.state(), {"version": version, "torn": False, "mixed": False, "received": None})
                    expected = dict(loaded_by_itself(r, 2, trainer.state).named_parameters())
                    RecordLoadTest.assert_same_params(self, expected, dict(m.named_parameters()))
            # Hooks: before/after per consumer per sync, after_group per group, post_process per group.
            self.assertEqual(sorted(e for e in events if e[0] != "post"),
                             sorted([("before", v) for v in (1, 2)] * 2 + [("after", v) for v in (1, 2)] * 2))
            post = [e for e in events if e[0] == "post"]
            self.assertEqual(sorted({e[1] for e in post}), ["layer 0", "layer 1", "post", "pre"])
            self.assertIn(("post", "pre", ["model.embed_tokens.weight"]), post)
            self.assertEqual(len(groups), 2 * 2 * 4)
            for x in [producer] + consumers:
                x.close()

    def test_rebound_param_and_raising_hook_fail_the_sync(self):
        module = sentinel(LlamaForCausalLM(TEST_CONFIG, 0, 1))
        trainer = HFTrainer(random_hf_state(TEST_CONFIG, seed=3))
        fail = {"on": False}

        def after_group(version, group):
            if fail["on"]:
                raise ValueError("engine paused badly")

        with ferry.StoreServer() as server:
            producer, (consumer,) = self.make(server, trainer, [module], "record-load-hooks", after_group=after_group)
            self.sync(producer, [consumer], 1)
            RecordLoadTest.assert_same_params(self, dict(loaded_by_itself(0, 1, trainer.state).named_parameters()),
                                              dict(module.named_parameters()))
            fail["on"] = True
            with self.assertRaisesRegex(ferry.Error, "after_group.*ValueError: engine paused badly"):
                run_threads([lambda: producer.sync(2), lambda: consumer.sync(2)])
            fail["on"] = False
            self.sync(producer, [consumer], 3)  # the consumer is still usable
            # p.data re-bound: the engine's buffer is no longer the module's.
            module.model.norm.weight.data = torch.zeros(TEST_CONFIG["hidden_size"])
            with self.assertRaisesRegex(ferry.FailedPreconditionError, "'model.norm.weight' was re-bound"):
                consumer.sync(4)
            for x in (producer, consumer):
                x.close()

    def test_raising_post_process_fails_the_sync_and_tears_the_rank(self):
        module = sentinel(LlamaForCausalLM(TEST_CONFIG, 0, 1))
        trainer = HFTrainer(random_hf_state(TEST_CONFIG, seed=6))

        def post_process(group, params):
            if group == "layer 1":
                raise RuntimeError("quantize failed")

        with ferry.StoreServer() as server:
            producer, (consumer,) = self.make(server, trainer, [module], "record-load-post", post_process=post_process)
            with self.assertRaisesRegex(ferry.Error, r"post_process\('layer 1'\).*RuntimeError: quantize failed"):
                run_threads([lambda: producer.sync(1), lambda: consumer.sync(1)])
            self.assertEqual(consumer.state()["version"], None)
            for x in (producer, consumer):
                x.close()

    def test_durations_and_launcher_environment(self):
        from ferry import _launcher
        module = LlamaForCausalLM(TEST_CONFIG, 0, 1)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "timeout: must be >= 0"):
            ferry.Consumer(plan=ferry.record_load(module, hf_shapes(TEST_CONFIG)), store="tcp://127.0.0.1:1",
                           timeout=-1.0, backend=self.BACKEND)
        # A param of the wrong shape: named as the Consumer's, not as a replay's.
        with self.assertRaises(ferry.ShapeMismatchError) as cm:
            ferry.Consumer(plan=ferry.record_load(module, hf_shapes(TEST_CONFIG)), store="tcp://127.0.0.1:1",
                           params={"model.norm.weight": torch.zeros(3)}, backend=self.BACKEND)
        self.assertTrue(str(cm.exception).startswith("Consumer: param 'model.norm.weight' has shape [3]"),
                        str(cm.exception))
        env = dict(os.environ)
        try:
            os.environ.update({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
            self.assertEqual((_launcher.launcher_rank(None), _launcher.launcher_world_size(None)), (3, 4))
            self.assertEqual(_launcher.launcher_rank(2), 2)  # explicit wins
            os.environ["FERRY_RANK"] = "0"
            self.assertEqual(_launcher.launcher_rank(None), 0)  # FERRY_RANK overrides the launcher's
            del os.environ["FERRY_RANK"], os.environ["RANK"]
            self.assertEqual(_launcher.launcher_rank(None), 1)  # LOCAL_RANK last
            os.environ["RANK"] = "x"
            with self.assertRaisesRegex(ferry.InvalidArgumentError, "RANK='x'"):
                _launcher.launcher_rank(None)
        finally:
            os.environ.clear()
            os.environ.update(env)

    def test_infinite_timeout_means_no_bound(self):
        module = sentinel(LlamaForCausalLM(TEST_CONFIG, 0, 1))
        trainer = HFTrainer(random_hf_state(TEST_CONFIG, seed=4))
        with ferry.StoreServer() as server:
            common = dict(token=server.token, backend=self.BACKEND, job="record-load-inf", timeout=float("inf"),
                          rendezvous_timeout=float("inf"), stall_timeout=float("inf"))
            if self.BACKEND == "ucx":
                common["transport_params"] = {"tls": "tcp,self", "net_devices": "lo"}
            producer, consumer = run_threads([
                lambda: ferry.Producer(trainer, server.url, **common),
                lambda: ferry.Consumer(plan=ferry.record_load(module, hf_shapes(TEST_CONFIG)), params=module,
                                       store=server, rank=0, **common)])
            reports = self.sync(producer, [consumer], 1)
            self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
            RecordLoadTest.assert_same_params(self, dict(loaded_by_itself(0, 1, trainer.state).named_parameters()),
                                              dict(module.named_parameters()))
            for x in (producer, consumer):
                x.close()

    def test_fp8_from_a_recorded_plan_is_the_built_in_quantisers_bit_for_bit(self):
        """Plan.quantized / record_load(quantize=...): consumers 2 and 3 sync into the
        module's own recorded plan marked with the params ferry's built-in Llama loader
        keeps in FP8, beside consumers 0 and 1 on that loader (quantize="fp8"), in one job.
        Quantised on the trainer (the default) and on the consumer: every param of a
        recorded rank is bit for bit the built-in rank's, and on the trainer side the wire
        carries exactly what the consumer keeps (FP8 and scales; padding is never sent)."""
        builtin = ferry.ModelLoader(TEST_CONFIG, "tp=2,replicas=2", quantize="fp8")
        fp8 = sorted(builtin.record_plan(0).quantized_params)
        self.assertIn("model.layers.0.self_attn.qkv_proj.weight", fp8)
        modules = [sentinel(LlamaForCausalLM(TEST_CONFIG, r, 2)) for r in range(2)]
        plans = [ferry.record_load(m, hf_shapes(TEST_CONFIG), quantize="fp8", quantize_params=fp8) for m in modules]
        for r, plan in enumerate(plans):
            self.assertEqual(plan, builtin.record_plan(r))  # the same marks, the same plan class
            self.assertEqual(plan.quantized_params[fp8[0]], ("fp8", 128, fp8[0] + "_scale_inv"))
        kept = {}
        for quantize_on in ("producer", "consumer"):
            trainer = HFTrainer(random_hf_state(TEST_CONFIG, seed=21))
            with ferry.StoreServer() as server:
                common = dict(token=server.token, backend=self.BACKEND, job="record-load-fp8-" + quantize_on,
                              timeout=20.0, rendezvous_timeout=20.0, num_consumers=4, quantize_on=quantize_on)
                if self.BACKEND == "ucx":
                    common["transport_params"] = {"tls": "tcp,self", "net_devices": "lo"}
                made = run_threads(
                    [lambda: ferry.Producer(trainer, server.url, **common)] +
                    [lambda r=r: ferry.Consumer(loader=builtin, rank=r, store=server, **common) for r in range(2)] +
                    [lambda r=r: ferry.Consumer(plan=plans[r], params=modules[r], rank=2 + r, store=server, **common)
                     for r in range(2)])
                producer, consumers = made[0], made[1:]
                reports = self.sync(producer, consumers, 1)
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                for r in range(2):
                    theirs, ours = consumers[r].params(), consumers[2 + r].params()
                    self.assertEqual(sorted(theirs), sorted(ours))
                    for name in fp8:
                        # e4m3 (raw uint8 bits on a torch without float8 dtypes, as 1.13)
                        self.assertEqual(ours[name].dtype, getattr(torch, "float8_e4m3fn", torch.uint8), name)
                        self.assertEqual(ours[name + "_scale_inv"].dtype, torch.float32, name)
                    for name, t in ours.items():
                        self.assertTrue(torch.equal(bits(t), bits(theirs[name])), f"{quantize_on}: {name}")
                    # The module's params that are not quantised are its own, written in place.
                    for name, p in modules[r].named_parameters():
                        if name not in fp8:
                            self.assertEqual(ours[name].data_ptr(), p.data_ptr(), name)
                    kept.setdefault(r, []).append({n: bits(t).clone() for n, t in ours.items()})
                    kept_bytes = sum(t.numel() * t.element_size() for t in ours.values())
                    padding = plans[r].stats()["zero_elements"] * 4  # the padded vocab rows (float32)
                    received = reports[3 + r]["bytes_received"]
                    self.assertEqual(received, reports[1 + r]["bytes_received"])
                    if quantize_on == "producer":
                        self.assertEqual(received, kept_bytes - padding)
                    else:  # the loaded float32 weights moved, quantised after they landed
                        self.assertGreater(received, kept_bytes - padding)
                for x in made:
                    x.close()
        for r in range(2):  # trainer-side and consumer-side quantisation: the same bits
            self.assertEqual(sorted(kept[r][0]), sorted(kept[r][1]))
            for name in kept[r][0]:
                self.assertTrue(torch.equal(kept[r][0][name], kept[r][1][name]), name)

    def test_quantized_marks_are_checked(self):
        module = LlamaForCausalLM(TEST_CONFIG, 0, 1)
        plan = ferry.record_load(module, hf_shapes(TEST_CONFIG))
        self.assertEqual(plan.quantized_params, {})
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "'model.nope.weight' is not a param of the plan"):
            plan.quantized(["model.nope.weight"])
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "'model.norm.weight'.*not a float matrix"):
            plan.quantized(["model.norm.weight"])
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "no param to quantise"):
            plan.quantized(lambda name: False)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "quantize is none"):
            plan.quantized(["model.layers.0.mlp.down_proj.weight"], "none")
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "quantize=.*quantize_params= go together"):
            ferry.record_load(module, hf_shapes(TEST_CONFIG), quantize="fp8")
        marked = plan.quantized(lambda name: name.endswith("proj.weight"), "mxfp8")
        self.assertEqual(marked.quantized_params["model.layers.1.mlp.down_proj.weight"],
                         ("mxfp8", 32, "model.layers.1.mlp.down_proj.weight_scale"))
        self.assertEqual(len(marked.quantized_params), 2 * 4)
        self.assertNotEqual(marked.hash(), plan.hash())
        self.assertEqual(ferry.Plan.from_bytes(marked.to_bytes()), marked)
        self.assertEqual(plan.quantized_params, {})  # the original is unchanged


if __name__ == "__main__":
    unittest.main()
