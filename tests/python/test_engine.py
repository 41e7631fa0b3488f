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
        with ferry.StoreServer() as server:
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
                reports = run_threads([lambda p=p: p.sync(v) for p in producers] +
                                      [lambda c=c: c.sync(v) for c in consumers])
                for rep in reports:
                    self.assertTrue(rep["ok"], rep["text"])
                    self.assertEqual(rep["version"], v)
                for r, c in enumerate(consumers):
                    self.assertEqual(c.state(), {"version": v, "torn": False})
                    self.assert_params_equal(expected_params(loader, r, v), c.params())
                    self.assertIs(c.params(), params[r])  # written in place
                self.assertGreater(sum(rep["bytes"] for rep in reports[2:]), 0)
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
            ferry.Producer(trainer, "tcp://127.0.0.1:1", token="t", backend="inproc",
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
