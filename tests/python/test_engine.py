"""The sync engine from Python: a trainer WeightSource over numpy arrays, Producers and
Consumers (ranks as threads over the in-process transport; two processes over UCX on
loopback), verified bit for bit against replaying the rank's plan on the same weights.

Run as `test_engine.py --producer URL TOKEN JOB` it is the producer process of the
two-process test (reads versions on stdin, prints one JSON report per sync).
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

import ferry

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 200, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
# The UCX backend's params (src/transport/ucx/config.h): tcp on loopback.
UCX = {"tls": "tcp,self", "net_devices": "lo"}


def checkpoint(version):
    """The full HF checkpoint of `version` (deterministic), as numpy arrays."""
    loader = ferry.ModelLoader(CONFIG)
    rng = np.random.default_rng(version)
    return {n: rng.standard_normal(d.shape, dtype=np.float32) for n, d in sorted(loader.checkpoint.items())}


class NumpyTrainer(ferry.WeightSource):
    """A trainer rank holding its Megatron shards of the checkpoint as numpy arrays."""

    def __init__(self, rank=0, world_size=1, layout=None):
        super().__init__(rank=rank, world_size=world_size, layout=layout, model_config=CONFIG)
        self.version = 1
        self._cache = {}

    def full(self, version):
        if version not in self._cache:
            self._cache = {version: checkpoint(version)}
        return self._cache[version]

    def metadata(self):
        return {n: (a.shape, a.dtype) for n, a in self.full(1).items()}

    def materialize(self, group):
        full = self.full(self.version)
        out = {}
        for name, start, size in self.boxes(group):
            box = tuple(slice(s, s + n) for s, n in zip(start, size))
            out[name] = np.ascontiguousarray(full[name][box])
        return out


def expected_params(loader, rank, version):
    params = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(rank).items()}
    loader.record_plan(rank).replay(checkpoint(version), params)
    return params


def run_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i, f):
        try:
            results[i] = f()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class EngineTest(unittest.TestCase):
    def assert_params_equal(self, expected, actual):
        self.assertEqual(set(expected), set(actual))
        for n in expected:
            self.assertTrue(np.array_equal(expected[n].view(np.uint32), np.asarray(actual[n]).view(np.uint32)), n)

    def test_threads_inproc_tp2_to_tp2(self):
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        with ferry.StoreServer() as server, tempfile.TemporaryDirectory() as tmp:
            trainers = [NumpyTrainer(r, 2, "tp=2") for r in range(2)]
            params = [{n: np.zeros(d.shape, np.float32) for n, d in loader.params(r).items()} for r in range(2)]
            common = dict(token=server.token, backend="inproc", job="threads", timeout=20.0)
            makers = [lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers]
            makers += [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, params=params[r],
                                                  num_producers=2, **common) for r in range(2)]
            made = run_threads(makers)
            producers, consumers = made[:2], made[2:]
            for v in (1, 2):
                for t in trainers:
                    t.version = v
                trace = os.path.join(tmp, f"consumer0-v{v}.json")
                reports = run_threads([lambda p=p: p.sync(v) for p in producers] +
                                      [lambda c=c, i=i: c.sync(v, trace=trace if i == 0 else None)
                                       for i, c in enumerate(consumers)])
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                    self.assertEqual(rep["version"], v)
                    # The keys of every report (the CLI's too), and "text".
                    self.assertEqual(set(rep) - {"text"}, set(ferry._ferry._report_keys()), rep)
                # trace=: the sync's Chrome trace, its transfers summing to the report's bytes.
                with open(trace) as f:
                    events = json.load(f)["traceEvents"]
                got = sum(e["args"]["bytes"] for e in events if e.get("cat") == "transfer" and e["args"]["counted"])
                self.assertEqual(got, reports[2]["bytes_received"])
                for r, c in enumerate(consumers):
                    self.assertEqual(c.state(), {"version": v, "torn": False, "mixed": False, "received": None})
                    self.assert_params_equal(expected_params(loader, r, v), c.params())
                    self.assertIs(c.params(), params[r])  # written in place
                self.assertGreater(sum(rep["bytes"] for rep in reports[2:]), 0)
                # Each side's extra memory by kind: its own ring, metadata, the allowance.
                for i, rep in enumerate(reports):
                    mem, ring = rep["memory"], "staging_ring" if i < 2 else "receive_ring"
                    other = "receive_ring" if i < 2 else "staging_ring"
                    self.assertGreater(mem[ring], 0, mem)
                    self.assertEqual(mem[other], 0, mem)
                    self.assertGreater(mem["metadata"], 0, mem)
                    self.assertEqual(mem["extra"], mem[ring] + mem["metadata"] + mem["transport_allowance"], mem)
            # Scaling in: consumer 1 leaves on purpose; it syncs no more, and the producers'
            # next reports are ok, naming it in "left", not "missed".
            consumers[1].leave()
            with self.assertRaises(ferry.FailedPreconditionError):
                consumers[1].sync(3)
            for t in trainers:
                t.version = 3
            reports = run_threads([lambda p=p: p.sync(3) for p in producers] + [lambda: consumers[0].sync(3)])
            for rep in reports[:2]:
                self.assertTrue(rep["ok"], rep["text"])
                self.assertEqual((rep["left"], rep["missed"]), ([1], []), rep["text"])
            self.assert_params_equal(expected_params(loader, 0, 3), consumers[0].params())
            for x in producers + consumers:
                x.close()

    def test_a_new_instance_catches_up_from_a_replica(self):
        # Issue 45: consumer 1 (a replica of consumer 0) replaced by a new instance reads the
        # live version from consumer 0's params, not from the trainer, verified before the
        # next sync; the producers' next reports name it joined.
        loader = ferry.ModelLoader(CONFIG, "tp=1,replicas=2")
        with ferry.StoreServer() as server:
            trainers = [NumpyTrainer(r, 2, "tp=2") for r in range(2)]
            common = dict(token=server.token, backend="inproc", job="catch-up", timeout=20.0)
            made = run_threads([lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                           **common) for r in range(2)])
            producers, consumers = made[:2], made[2:]

            def sync(v):
                for t in trainers:
                    t.version = v
                return run_threads([lambda p=p: p.sync(v) for p in producers] + [lambda c=c: c.sync(v) for c in consumers])
            for rep in sync(1):
                self.assertTrue(rep["ok"], rep["text"])
            consumers[1].close()
            consumers[1] = ferry.Consumer(loader=loader, rank=1, store=server, num_producers=2, **common)
            rep = consumers[1].catch_up()
            self.assertEqual((rep["version"], rep["catch_up_source"], rep["committed"]), (1, 0, True), rep)
            self.assertGreater(rep["received_from_replicas"], 0)
            self.assertEqual(rep["received_from_replicas"], rep["bytes_received"])
            self.assertEqual(rep["bytes_per_peer"], {})
            self.assertEqual(consumers[1].committed_version, 1)
            self.assert_params_equal(expected_params(loader, 1, 1), consumers[1].params())
            reports = sync(2)
            for rep in reports:
                self.assertTrue(rep["ok"], rep["text"])
            self.assertEqual(reports[0]["joined"], [1])
            for r, c in enumerate(consumers):
                self.assert_params_equal(expected_params(loader, r, 2), c.params())
            for x in producers + consumers:
                x.close()

    def _commit_job(self, server, loader, job, **consumer_kw):
        trainers = [NumpyTrainer(r, 2, "tp=2") for r in range(2)]
        common = dict(token=server.token, backend="inproc", job=job, timeout=20.0)
        made = run_threads([lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers] +
                           [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                       **common, **consumer_kw) for r in range(2)])
        producers, consumers = made[:2], made[2:]

        def sync(v, **kw):
            for t in trainers:
                t.version = v
            return run_threads([lambda p=p: p.sync(v) for p in producers] +
                               [lambda c=c: c.sync(v, **kw) for c in consumers])
        return producers, consumers, sync

    def test_commit_shadow_keeps_the_live_version_until_commit(self):
        # commit="shadow" (issue 27): sync(v, commit=False) leaves the live params the
        # committed version; commit() makes v live between the hooks; discard() drops it.
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        calls = []
        with ferry.StoreServer() as server:
            producers, consumers, sync = self._commit_job(
                server, loader, "shadow", commit="shadow",
                before_commit=lambda v: calls.append(("before", v)), after_commit=lambda v: calls.append(("after", v)))
            for rep in sync(1):
                self.assertTrue(rep["ok"], rep["text"])
            for r, c in enumerate(consumers):
                self.assertEqual(c.committed_version, 1)
                self.assert_params_equal(expected_params(loader, r, 1), c.params())
            self.assertEqual(sorted(calls), [("after", 1)] * 2 + [("before", 1)] * 2)
            reports = sync(2, commit=False)
            for rep in reports[2:]:
                self.assertFalse(rep["committed"])
                self.assertEqual(rep["live_version"], 1)
                self.assertGreater(rep["memory"]["shadow"], 0)
            for r, c in enumerate(consumers):
                self.assertEqual((c.committed_version, c.received_version), (1, 2))
                self.assert_params_equal(expected_params(loader, r, 1), c.params())
                self.assertGreaterEqual(c.commit(), 0.0)
                self.assertEqual((c.committed_version, c.received_version), (2, None))
                self.assert_params_equal(expected_params(loader, r, 2), c.params())
            sync(3, commit=False)
            for r, c in enumerate(consumers):
                c.discard()
                self.assertEqual((c.committed_version, c.received_version), (2, None))
                self.assert_params_equal(expected_params(loader, r, 2), c.params())
                with self.assertRaises(ferry.FailedPreconditionError):
                    c.commit()  # nothing received
            for x in producers + consumers:
                x.close()

    def test_commit_groups_makes_each_layer_group_live_on_the_engines_thread(self):
        # commit="groups" (the bounded shadow): the engine runs the commit hooks around each
        # layer group's commit on its own thread; the report names the groups made live;
        # the shadow holds less than the params.
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        calls, lock = [], threading.Lock()

        def hook(kind):
            def run(v):
                with lock:
                    calls.append((kind, v, threading.get_ident()))
            return run
        with ferry.StoreServer() as server:
            producers, consumers, sync = self._commit_job(server, loader, "groups", commit="groups",
                                                          before_commit=hook("before"), after_commit=hook("after"))
            caller = threading.get_ident()
            for v in (1, 2):
                calls.clear()
                reports = sync(v)
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                params_bytes = sum(int(np.prod(d.shape)) * 4 for d in loader.params(0).values())
                for rep in reports[2:]:
                    self.assertTrue(rep["committed"])
                    self.assertEqual(rep["live_version"], v)
                    self.assertEqual(len(rep["groups_live"]), len(set(rep["groups_live"])))
                    self.assertGreaterEqual(len(rep["groups_live"]), 4)  # embedding, 2 layers, the end
                    self.assertGreater(rep["memory"]["shadow"], 0)
                    self.assertLess(rep["memory"]["shadow"], params_bytes)
                    self.assertEqual(rep["received_into_params"], 0)
                commits = sum(len(rep["groups_live"]) for rep in reports[2:])
                self.assertEqual(len([c for c in calls if c[0] == "before"]), commits)
                self.assertEqual(len([c for c in calls if c[0] == "after"]), commits)
                self.assertTrue(all(c[1] == v and c[2] != caller for c in calls), calls)
                for r, c in enumerate(consumers):
                    self.assertEqual(c.state(), {"version": v, "torn": False, "mixed": False, "received": None})
                    self.assert_params_equal(expected_params(loader, r, v), c.params())
            with self.assertRaises(ferry.InvalidArgumentError):
                consumers[0].sync(3, commit=False)  # only under "shadow"
            for x in producers + consumers:
                x.close()

    def test_a_failed_sync_raises_with_its_report_and_mixed_is_said(self):
        # commit="groups": trainer rank 1 fails at version 2's last layer group once both
        # consumers made a group of 2 live, and leaves. Every error carries its sync's
        # report; the surviving producer names the producer that failed; state() and
        # committed_versions() say mixed, not 1.
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        went_live = [threading.Event(), threading.Event()]

        class Failing(NumpyTrainer):
            def materialize(self, group):
                if self.version == 2 and group == len(self.groups()) - 1:
                    for e in went_live:
                        e.wait(20)  # (bounded: the asserts below then say what was missing)
                    raise RuntimeError("trainer rank 1 lost its GPU")
                return super().materialize(group)

        with ferry.StoreServer() as server:
            trainers = [NumpyTrainer(0, 2, "tp=2"), Failing(1, 2, "tp=2")]
            common = dict(token=server.token, backend="inproc", job="mixed", timeout=20.0)

            def live_hook(r):
                return lambda v: went_live[r].set() if v == 2 else None
            made = run_threads([lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                           commit="groups", after_commit=live_hook(r), **common)
                                for r in range(2)])
            producers, consumers = made[:2], made[2:]

            def outcome(x, v):
                try:
                    return x.sync(v)
                except ferry.Error as e:
                    if x is producers[1]:
                        x.close()  # it leaves: the consumers learn at once (its lease, its connection)
                    return e
            for v in (1, 2):
                for t in trainers:
                    t.version = v
                out = run_threads([lambda x=x: outcome(x, v) for x in producers + consumers])
                if v == 1:
                    self.assertTrue(all(isinstance(o, dict) and o["ok"] for o in out), out)
            survivor, dead, errors = out[0], out[1], out[2:]
            self.assertIsInstance(dead, ferry.Error)
            self.assertFalse(dead.report["ok"])
            self.assertEqual(dead.report["version"], 2)
            self.assertIn("lost its GPU", dead.report["error"])
            self.assertEqual(dead.report["failure"]["peer"], -1, dead.report["failure"])  # its own
            self.assertIsInstance(survivor, dict)
            self.assertFalse(survivor["ok"], survivor["text"])
            self.assertEqual(sorted(survivor["missed"]), [0, 1])
            self.assertIsNone(survivor["failure"])  # (it finished: `missed` says the rest)
            self.assertTrue(any("aborted the sync (" in f and "producer 1" in f for f in survivor["failures"]),
                            survivor["failures"])
            for r, e in enumerate(errors):
                self.assertIsInstance(e, ferry.PeerFailedError, e)
                self.assertIsNotNone(e.report, e)
                self.assertFalse(e.report["ok"])
                self.assertEqual(e.report["code"], "PeerFailed")
                self.assertIn("producer 1", e.report["error"])
                self.assertEqual(e.report["live_version"], 1)
                self.assertFalse(e.report["committed"])
                self.assertGreaterEqual(len(e.report["groups_live"]), 1, e.report)
                self.assertEqual(set(e.report) - {"text"}, set(ferry._ferry._report_keys()))
                f = e.report["failure"]  # the failure as a value: ended by producer 1, inside the groups
                self.assertEqual((f["peer"], f["reason"]), (1, "PeerFailed"), f)
                self.assertGreaterEqual(f["group"], 0, f)
                self.assertEqual("PeerFailed: " + f["message"], e.report["error"])
                self.assertEqual(consumers[r].state(), {"version": 1, "torn": False, "mixed": True, "received": None})
            versions = ferry.committed_versions(server, 2, job="mixed", token=server.token)
            self.assertEqual(versions, [1, 1])  # still ints: min() and comparisons work
            for v in versions:
                self.assertIsInstance(v, ferry.CommittedVersion)
                self.assertTrue(v.mixed)
                self.assertFalse(v.whole)
                self.assertEqual(v.newer, 2)
                self.assertEqual(repr(v), "1 (mixed with 2)")
            self.assertEqual(ferry.committed_states(server, 2, job="mixed", token=server.token),
                             [{"version": 1, "mixed": True, "torn": False, "newer": 2}] * 2)
            for x in producers + consumers:
                x.close()

    def test_delta_syncs_send_patches_of_what_changed(self):
        # delta=True (docs/delta.md): version 2 changes 1% of version 1's elements; the
        # consumers take patches against version 1, bit for bit, and the report says so.
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        rng = np.random.default_rng(5)
        v1 = checkpoint(1)
        v2 = {n: a.copy() for n, a in v1.items()}
        for a in v2.values():
            flat = a.reshape(-1)
            flat[rng.random(flat.size) < 0.01] += 1.0
        with ferry.StoreServer() as server:
            trainers = [NumpyTrainer(r, 2, "tp=2") for r in range(2)]
            for t in trainers:
                t._cache = {1: v1, 2: v2}
                t.full = lambda version, t=t: t._cache[version]
            common = dict(token=server.token, backend="inproc", job="delta", timeout=20.0, delta=True,
                          delta_same_host=True)  # (one host: patches over shared memory too)
            made = run_threads([lambda t=t: ferry.Producer(t, server.url, num_consumers=2, **common) for t in trainers] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                           **common) for r in range(2)])
            producers, consumers = made[:2], made[2:]
            for v in (1, 2):
                for t in trainers:
                    t.version = v
                reports = run_threads([lambda p=p: p.sync(v) for p in producers] +
                                      [lambda c=c: c.sync(v) for c in consumers])
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                for r, c in enumerate(consumers):
                    expected = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(r).items()}
                    loader.record_plan(r).replay(v1 if v == 1 else v2, expected)
                    self.assert_params_equal(expected, c.params())
                sent = sum(rep["bytes_sent"] for rep in reports[:2])
                patches = sum(rep["patch_bytes"] for rep in reports[:2])
                if v == 1:
                    dense = sent
                    self.assertEqual(patches, 0)
                else:
                    self.assertEqual(patches, sent)
                    self.assertLess(sent, dense * 0.05)
                    seen = sum(rep["delta_changed"] for rep in reports[:2]) / sum(rep["delta_elements"] for rep in reports[:2])
                    self.assertAlmostEqual(seen, 0.01, delta=0.004)
                    self.assertEqual(sum(rep["patch_bytes"] for rep in reports[2:]), patches)
                    self.assertEqual(sum(rep["patches_repaired"] for rep in reports[2:]), 0)
                self.assertGreater(reports[0]["memory"]["kept_copy"], 0)
            for x in producers + consumers:
                x.close()

    def test_torch_bf16_source_and_ferry_allocated_params(self):
        import torch

        cfg = dict(CONFIG, torch_dtype="bfloat16")

        class TorchTrainer(ferry.WeightSource):
            def __init__(self):
                super().__init__()
                g = torch.Generator().manual_seed(3)
                self.weights = {n: torch.randn(d.shape, generator=g).bfloat16()
                                for n, d in ferry.ModelLoader(cfg).checkpoint.items()}

            def metadata(self):
                return {n: (t.shape, t.dtype) for n, t in self.weights.items()}

            def materialize(self, group):
                return {n: self.weights[n] for n, _, _ in self.boxes(group)}  # whole tensors, zero-copy

        loader = ferry.ModelLoader(cfg, "tp=2")
        trainer = TorchTrainer()
        with ferry.StoreServer() as server:
            common = dict(store=server, backend="inproc", job="bf16", timeout=20.0)
            made = run_threads([lambda: ferry.Producer(trainer, num_consumers=2, **common)] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, **common) for r in range(2)])
            reports = run_threads([lambda x=x: x.sync(5) for x in made])
            self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
            for r, c in enumerate(made[1:]):
                got = c.params()  # ferry's own buffers, as torch bf16 tensors
                expected = {n: torch.zeros(d.shape, dtype=torch.bfloat16) for n, d in loader.params(r).items()}
                loader.record_plan(r).replay(trainer.weights, expected)
                self.assertEqual(set(got), set(expected))
                for n in expected:
                    self.assertEqual(got[n].dtype, torch.bfloat16)
                    self.assertTrue(torch.equal(got[n].view(torch.int16), expected[n].view(torch.int16)), n)
            for x in made:
                x.close()

    def test_source_errors_are_reported(self):
        class Broken(NumpyTrainer):
            def materialize(self, group):
                raise RuntimeError("disk on fire")

        loader = ferry.ModelLoader(CONFIG, "tp=1")
        with ferry.StoreServer() as server:
            common = dict(token=server.token, backend="inproc", job="broken", timeout=5.0, stall_timeout=2.0)
            producer, consumer = run_threads([
                lambda: ferry.Producer(Broken(), server, **common),
                lambda: ferry.Consumer(loader=loader, rank=0, store=server, **common)])
            errors = []

            def consume():
                try:
                    consumer.sync(1)
                except ferry.Error as e:
                    errors.append(e)

            t = threading.Thread(target=consume)
            t.start()
            with self.assertRaises(ferry.Error) as cm:
                producer.sync(1)
            self.assertIn("disk on fire", str(cm.exception))
            self.assertIn("materialize", str(cm.exception))
            producer.close()  # the consumer's sync fails instead of waiting forever
            t.join(30)
            self.assertFalse(t.is_alive())
            consumer.close()

    def test_weight_source_helpers(self):
        t = NumpyTrainer(1, 2, "tp=2")
        self.assertEqual(t.groups()[0], "pre")
        self.assertEqual(t.groups()[-1], "post")
        g = t.group_of("model.layers.1.self_attn.q_proj.weight")
        self.assertEqual(t.groups()[g], "layer 1")
        boxes = dict((n, (s, z)) for n, s, z in t.boxes(g))
        start, size = boxes["model.layers.1.self_attn.q_proj.weight"]
        self.assertEqual(size[0], 64)  # q rows split over tp=2
        self.assertEqual(start[0], 64)
        single = NumpyTrainer()
        self.assertEqual(len(single.boxes(g)), len([n for n in single.metadata() if ".layers.1." in n]))
        with self.assertRaises(ferry.UnimplementedError):
            NumpyTrainer(0, 2).holdings(1)

    def test_weight_source_metadata_as_tensor_decls_and_launcher_env(self):
        decls = {n: ferry.TensorDecl(n, tuple(a.shape), "float32") for n, a in checkpoint(1).items()}

        class Decls(NumpyTrainer):
            def metadata(self):
                return decls  # the docstring allows TensorDecls; this used to fail "invalid literal for int()"

        t = Decls(1, 2, "tp=2")
        self.assertEqual(len(t._metadata()), len(decls))
        self.assertEqual(t.boxes(0), NumpyTrainer(1, 2, "tp=2").boxes(0))
        listed = type("Listed", (NumpyTrainer,), {"metadata": lambda self: list(decls.values())})()
        self.assertEqual(len(listed._metadata()), len(decls))
        old = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        os.environ.update(RANK="3", WORLD_SIZE="4")
        try:
            src = ferry.WeightSource()
            self.assertEqual((src.rank, src.world_size), (3, 4))
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def test_bookkeeping_asks_holdings_once_and_caches_groups(self):
        calls = []

        class Counting(NumpyTrainer):
            def holdings(self, rank):
                calls.append(rank)
                return super().holdings(rank)

        t = Counting(0, 2, "tp=2")
        for _ in range(3):
            for g in range(len(t.groups())):
                for name, _, _ in t.boxes(g):
                    self.assertEqual(t.group_of(name), g)
        self.assertEqual(calls, [0])
        with self.assertRaises(ferry.InvalidArgumentError):
            t.group_of("model.nope.weight")

    def test_megatron_tied_embeddings_sync_into_the_built_in_loader(self):
        """tie_word_embeddings: the checkpoint has no lm_head, Megatron-Core no output layer
        (the embedding serves both); the engine's loader ties lm_head to embed_tokens."""
        import torch
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from llama_megatron import native_shard
        from llama_vllm import TEST_CONFIG

        cfg = dict(TEST_CONFIG, tie_word_embeddings=True)
        loader = ferry.ModelLoader(cfg, "tp=2")
        self.assertNotIn("lm_head.weight", loader.checkpoint)
        gen = torch.Generator().manual_seed(5)
        hf = {n: torch.randn(tuple(d.shape), generator=gen) for n, d in loader.checkpoint.items()}
        layout = ferry.megatron.GPTLayout(cfg, tp=2)
        self.assertNotIn("lm_head.weight", layout.metadata(torch.float32))
        natives = []
        for r in range(2):
            native = native_shard(dict(hf, **{"lm_head.weight": hf["model.embed_tokens.weight"]}), cfg, 2, r)
            del native["output_layer.weight"]  # (tied: the embedding is the output layer)
            natives.append(native)
        with ferry.StoreServer() as server:
            common = dict(backend="inproc", job="tied", timeout=20.0)
            made = run_threads([lambda r=r: ferry.Producer(ferry.megatron.MegatronSource(layout, natives[r], rank=r),
                                                           server, num_consumers=2, **common) for r in range(2)] +
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=2,
                                                           **common) for r in range(2)])
            reports = run_threads([lambda x=x: x.sync(1) for x in made])
            self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
            for r, c in enumerate(made[2:]):
                expect = {n: torch.zeros(tuple(d.shape)) for n, d in loader.params(r).items()}
                loader.record_plan(r).replay(hf, expect)
                got = c.params()
                for n, t in expect.items():
                    self.assertTrue(torch.equal(torch.as_tensor(got[n]), t), (r, n))
                if "lm_head.weight" in expect:  # the head is the embedding's rows
                    self.assertTrue(torch.equal(expect["lm_head.weight"], expect["model.embed_tokens.weight"]))
            for x in made:
                x.close()

    def test_megatron_layout_views_are_the_native_tensors(self):
        import torch
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from llama_megatron import native_shard
        from llama_vllm import TEST_CONFIG, random_hf_state

        # TEST_CONFIG (one kv group a rank) and 4 kv heads over tp=2 (two kv groups a rank:
        # q, k and v are two boxes each, listed in holdings order).
        for cfg in (TEST_CONFIG, dict(TEST_CONFIG, num_attention_heads=8, num_key_value_heads=4, head_dim=8)):
            hf = random_hf_state(cfg, seed=1)
            layout = ferry.megatron.GPTLayout(cfg, tp=2, make_vocab_size_divisible_by=128)
            self.assertEqual(layout.padded_vocab, 1024)
            meta = layout.metadata(torch.float32)
            self.assertEqual({n: tuple(s) for n, (s, _) in meta.items()}, {n: tuple(t.shape) for n, t in hf.items()})
            covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in hf.items()}
            for r in range(2):
                native = native_shard(hf, cfg, 2, r)
                storages = {t.storage().data_ptr() for t in native.values()}
                views = layout.views(r, native)
                boxes = {}
                for name, start, size in layout.holdings(r):
                    boxes.setdefault(name, []).append((start, size))
                self.assertEqual(set(views), set(boxes))
                for name, vs in views.items():
                    vs = vs if isinstance(vs, list) else [vs]
                    self.assertEqual(len(vs), len(boxes[name]), name)
                    for v, (start, size) in zip(vs, boxes[name]):
                        self.assertIn(v.storage().data_ptr(), storages, name)  # a view, not a copy
                        box = tuple(slice(a, a + n) for a, n in zip(start, size))
                        self.assertTrue(torch.equal(v, hf[name][box]), (name, r, start))
                        if not name.endswith("norm.weight"):  # norms: replicated on both ranks
                            covered[name][box] += 1
            for name, c in covered.items():
                if not name.endswith("norm.weight"):
                    self.assertTrue(bool((c == 1).all()), name)  # every element held exactly once
            # Rank 1's vocab shard is rows 512..1023 of the padded vocab: 488 real rows.
            self.assertIn(("model.embed_tokens.weight", (512, 0), (488, 64)), layout.holdings(1))
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.megatron.GPTLayout(dict(TEST_CONFIG, num_key_value_heads=1, num_attention_heads=4), tp=2)
        # tp=2, pp=2, dp=2 (8 ranks, Megatron's order: tp fastest, then dp, then pp): each
        # dp replica of each stage holds the stage's layers once over its TP ranks.
        import numpy as np
        cfg = dict(TEST_CONFIG, num_hidden_layers=3)
        layout = ferry.megatron.GPTLayout(cfg, tp=2, pp=2, dp=2)
        self.assertEqual([list(layout.stage_layers(s)) for s in range(2)], [[0, 1], [2]])
        self.assertEqual(layout.coords(5), (1, 0, 1))
        meta = layout.metadata("float32")
        for dp in range(2):
            count = {n: np.zeros(shape, np.int32) for n, (shape, _) in meta.items()}
            for rank in range(8):
                stage, d, r = layout.coords(rank)
                if d != dp:
                    continue
                for name, start, size in layout.holdings(rank):
                    if name.endswith("norm.weight") and r == 1:
                        continue  # replicated over TP
                    count[name][tuple(slice(a, a + n) for a, n in zip(start, size))] += 1
            for name, c in count.items():
                self.assertTrue(bool((c == 1).all()), (dp, name))

    def test_strided_views_served_and_in_place(self):
        import torch
        # The trainer holds each 2-D weight inside a wider buffer (its own layout): the
        # HF tensor is a column range of it (strided); 1-D tensors are whole storages
        # (contiguous, served in place).
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        full = {n: torch.from_numpy(a) for n, a in checkpoint(4).items()}
        wide = {n: torch.zeros(t.shape[0], t.shape[1] + 3) if t.dim() == 2 else t.clone() for n, t in full.items()}
        for n, t in full.items():
            if t.dim() == 2:
                wide[n][:, 1:1 + t.shape[1]] = t

        class Views(ferry.WeightSource):
            def metadata(self):
                return {n: (t.shape, t.dtype) for n, t in full.items()}

            def materialize(self, group):
                out = {}
                for n, _, _ in self.boxes(group):
                    w = wide[n]
                    out[n] = w[:, 1:1 + full[n].shape[1]] if w.dim() == 2 else w
                return out

        with ferry.StoreServer() as server:
            common = dict(store=server, backend="inproc", job="views", timeout=20.0)
            made = run_threads([lambda: ferry.Producer(Views(), num_consumers=2, in_place=True, direct_min_bytes=0,
                                                       **dict(common, timeout=float("inf")))] +  # no bound
                               [lambda r=r: ferry.Consumer(loader=loader, rank=r, **common) for r in range(2)])
            reports = run_threads([lambda x=x: x.sync(1) for x in made])
            self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
            for r, c in enumerate(made[1:]):
                self.assert_params_equal(expected_params(loader, r, 4), {n: t.numpy() for n, t in c.params().items()})
            sent, in_place = reports[0]["bytes_sent"], reports[0]["sent_in_place"]
            norm_bytes = sum(t.numel() * 4 for t in full.values() if t.dim() == 1)
            self.assertGreater(in_place, 0)     # the contiguous norms, read from the trainer's storage
            self.assertLess(in_place, sent)     # the strided column ranges, packed
            self.assertLessEqual(in_place, 2 * norm_bytes)
            for x in made:
                x.close()

    def test_transport_params_and_deprecated_ucx_config(self):
        from ferry import _engine
        self.assertEqual(_engine._transport_params({"tls": "tcp,self", "spin_us": 5}, None),
                         {"tls": "tcp,self", "spin_us": "5"})
        with self.assertWarns(DeprecationWarning):
            p = _engine._transport_params({"tls": "sm,self"}, {"NET_DEVICES": "lo", "RNDV_THRESH": "8k"})
        self.assertEqual(p, {"tls": "sm,self", "ucx.NET_DEVICES": "lo", "ucx.RNDV_THRESH": "8k"})

    def test_unknown_transport_param_is_refused(self):
        trainer = NumpyTrainer()
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.Producer(trainer, "tcp://127.0.0.1:1", token="test-token-0123456789", backend="inproc",
                           transport_params={"tls": "tcp"}, rendezvous_timeout=1.0)
        self.assertIn("unknown param 'tls'", str(e.exception))

    def test_two_processes_ucx(self):
        self.assertIn("ucx", ferry.transport_backends())  # UCX is required by the build
        loader = ferry.ModelLoader(CONFIG, "tp=2")
        with ferry.StoreServer() as server:
            child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--producer", server.url,
                                      server.token, "ucx2p"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=dict(os.environ))
            try:
                params = [{n: np.zeros(d.shape, np.float32) for n, d in loader.params(r).items()} for r in range(2)]
                consumers = run_threads([
                    lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server.url, token=server.token,
                                               params=params[r], job="ucx2p", backend="ucx", transport_params=UCX,
                                               timeout=20.0) for r in range(2)])
                for v in (1, 2):
                    child.stdin.write(f"{v}\n")
                    child.stdin.flush()
                    reports = run_threads([lambda c=c: c.sync(v) for c in consumers])
                    produced = json.loads(child.stdout.readline())
                    self.assertTrue(produced["ok"], produced)
                    for r in range(2):
                        self.assertTrue(reports[r]["ok"], reports[r]["text"])
                        self.assert_params_equal(expected_params(loader, r, v), params[r])
                for c in consumers:
                    c.close()
            finally:
                child.stdin.close()
                self.assertEqual(child.wait(60), 0)
                child.stdout.close()


def producer_main(url, token, job):
    trainer = NumpyTrainer()
    with ferry.Producer(trainer, url, token=token, num_consumers=2, job=job, backend="ucx", ucx_config={"TLS": "tcp,self", "NET_DEVICES": "lo"},
                        timeout=20.0) as producer:
        for line in sys.stdin:
            trainer.version = int(line)
            rep = producer.sync(trainer.version)
            print(json.dumps({"ok": rep["ok"], "bytes": rep["bytes"], "text": rep["text"]}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--producer":
        producer_main(*sys.argv[2:])
    else:
        unittest.main()
