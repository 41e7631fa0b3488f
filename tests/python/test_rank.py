"""ferry.serve / ferry.fetch: a job of separate processes started the way a launcher
starts them (RANK / WORLD_SIZE of one launch: the trainer's ranks first), meeting in an
embedded store served by this process; every inference rank verified bit for bit against
the checkpoint, by ferry (``verified``) and here (its written output against the plan
replayed over the checkpoint). Plus the errors a setup raises, and ``check=True``.

Run as ``test_rank.py --rank-process serve|fetch JSON`` it is one rank: it calls
ferry.serve / ferry.fetch with the JSON's keyword arguments (its rank from the launcher
variables) and prints the reports as one JSON line.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import ferry
from ferry import _rank

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 200, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
TRAINER, INFERENCE = "tp=2", "tp=1,replicas=2"
PROCESS_TIMEOUT_S = 60  # each rank's bound (the job takes a few seconds)


# A minimal safetensors writer/reader (F32 only): python3-safetensors is not a Debian
# package here, and reading the output independently of ferry is the point.
def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name, a in sorted(tensors.items()):
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name], dtype="<f4").tobytes())


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        assert h["dtype"] == "F32", (name, h["dtype"])
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a:8 + n + b], dtype="<f4").reshape(h["shape"])
    return out


def make_checkpoint(dirname, seed):
    """config.json + model.safetensors of CONFIG with weights from `seed`; returns them."""
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    rng = np.random.default_rng(seed)
    decls = ferry.ModelLoader(CONFIG).checkpoint
    weights = {n: rng.standard_normal(d.shape, dtype=np.float32) for n, d in sorted(decls.items())}
    write_safetensors(os.path.join(dirname, "model.safetensors"), weights)
    return weights


def start_rank(role, launcher_rank, world_size, kwargs, token):
    env = dict(os.environ, RANK=str(launcher_rank), WORLD_SIZE=str(world_size), FERRY_TOKEN=token)
    for v in ("FERRY_RANK", "FERRY_WORLD_SIZE"):
        env.pop(v, None)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-process", role, json.dumps(kwargs)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class RankEntryJob(unittest.TestCase):
    def test_two_serve_two_fetch_processes_verify_bit_for_bit(self):
        with tempfile.TemporaryDirectory() as tmp, ferry.StoreServer() as store:
            ckpt, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "out")
            weights = make_checkpoint(ckpt, 7)
            common = {"store": store.url, "trainer": TRAINER, "inference": INFERENCE, "job": "pyrank", "syncs": 2,
                      "timeout": 20, "rendezvous_timeout": 30}
            serve = dict(common, checkpoint=ckpt)
            # (leave=True: each inference rank leaves the job after its last sync, as when
            # scaling in; the serve ranks' last sync is already committed by both.)
            fetch = dict(common, model=os.path.join(ckpt, "config.json"), checkpoint=ckpt, output=out, leave=True)
            # One launch of both roles, as `torchrun --nproc-per-node 4` or mpirun would.
            procs = [start_rank("serve", r, 4, serve, store.token) for r in (0, 1)]
            procs += [start_rank("fetch", r, 4, fetch, store.token) for r in (2, 3)]
            results = []
            try:
                for p in procs:
                    stdout, stderr = p.communicate(timeout=PROCESS_TIMEOUT_S)
                    results.append((p.returncode, stdout, stderr))
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            reports = []
            for (rc, stdout, stderr), (role, rank) in zip(results, [("trainer", 0), ("trainer", 1),
                                                                   ("inference", 0), ("inference", 1)]):
                self.assertEqual(rc, 0, f"{role} rank {rank}: exit {rc}\n{stdout}\n{stderr}")
                got = json.loads(stdout.strip().splitlines()[-1])
                self.assertEqual([(r["role"], r["rank"], r["version"]) for r in got],
                                 [(role, rank, 1), (role, rank, 2)], stdout)
                reports += got
            # The keys of every report (the CLI's, Producer/Consumer.sync's), and the rank's.
            extras = {"role", "rank", "transport", "torn", "verified", "received_version"}
            for r in reports:
                self.assertEqual(set(r) - extras, set(ferry._ferry._report_keys()), r)
            for r in reports:
                self.assertTrue(r["ok"], r)
                self.assertGreater(r["bytes"], 0, r)
                self.assertIsNone(r["error"], r)
                if r["role"] == "inference":
                    self.assertTrue(r["verified"], r)
                    self.assertFalse(r["torn"], r)
            # Both inference ranks received every byte the trainer ranks sent.
            for v in (1, 2):
                sent = sum(r["bytes"] for r in reports if r["role"] == "trainer" and r["version"] == v)
                received = sum(r["bytes"] for r in reports if r["role"] == "inference" and r["version"] == v)
                self.assertEqual(sent, received, f"version {v}")
            # Independently of ferry's own check: the written params equal the loader's
            # plan replayed over the checkpoint, bit for bit.
            loader = ferry.ModelLoader(CONFIG, INFERENCE)
            for rank in (0, 1):
                expected = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(rank).items()}
                loader.record_plan(rank).replay(weights, expected)
                written = read_safetensors(os.path.join(out, f"rank-{rank}.safetensors"))
                self.assertEqual(sorted(written), sorted(expected))
                for name, a in expected.items():
                    self.assertTrue(np.array_equal(written[name].view(np.uint32), a.view(np.uint32)),
                                    f"rank {rank} param {name}")


class RankEntryErrors(unittest.TestCase):
    """Setup errors raise before any store is reached (the URL below has no server)."""

    STORE = "tcp://127.0.0.1:9"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.ckpt = os.path.join(cls.tmp.name, "ckpt")
        make_checkpoint(cls.ckpt, 1)
        cls.config = os.path.join(cls.ckpt, "config.json")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_missing_checkpoint_directory_is_named(self):
        missing = os.path.join(self.tmp.name, "no-such-step")
        with self.assertRaises(ferry.NotFoundError) as e:
            ferry.serve(store=self.STORE, trainer=TRAINER, inference=INFERENCE, checkpoint=missing, rank=0)
        self.assertIn(missing, str(e.exception))
        self.assertEqual(e.exception.code, "NotFound")
        with self.assertRaises(ferry.NotFoundError) as e:
            ferry.fetch(store=self.STORE, trainer=TRAINER, inference=INFERENCE, model=self.config, checkpoint=missing,
                        rank=0)
        self.assertIn(missing, str(e.exception))

    def test_bad_layout_is_named(self):
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.serve(store=self.STORE, trainer="tp=2,qq=3", inference=INFERENCE, checkpoint=self.ckpt, rank=0)
        self.assertIn("tp=2,qq=3", str(e.exception))
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.fetch(store=self.STORE, trainer=TRAINER, inference="tp=x", model=self.config, rank=0)
        self.assertIn("tp=x", str(e.exception))

    def test_rank_outside_the_layout_or_missing(self):
        with self.assertRaises(ferry.OutOfRangeError) as e:
            ferry.serve(store=self.STORE, trainer=TRAINER, inference=INFERENCE, checkpoint=self.ckpt, rank=2)
        self.assertIn("trainer rank 2 is outside the layout's 0..1", str(e.exception))
        env = {k: os.environ.pop(k) for k in ("FERRY_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
               if k in os.environ}
        try:
            with self.assertRaises(ferry.InvalidArgumentError) as e:
                ferry.fetch(store=self.STORE, trainer=TRAINER, inference=INFERENCE, model=self.config)
            self.assertIn("no inference rank", str(e.exception))
        finally:
            os.environ.update(env)

    def test_bad_options_are_named(self):
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.serve(store=self.STORE, trainer=TRAINER, inference=INFERENCE, checkpoint=self.ckpt, rank=0,
                        timeout=0)
        self.assertIn("serve: timeout", str(e.exception))
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            ferry.fetch(store=self.STORE, trainer=TRAINER, inference=INFERENCE, model=self.config, rank=0, mode="pul")
        self.assertIn("pul", str(e.exception))
        for bad in (-1, 1.0, "1", True):
            with self.assertRaises(ferry.InvalidArgumentError) as e:
                ferry.serve(store=self.STORE, trainer=TRAINER, inference=INFERENCE, checkpoint=self.ckpt, rank=bad)
            self.assertIn(f"serve: rank must be a non-negative int or None (the launcher's), got {bad!r}",
                          str(e.exception))


class CheckRaisesTheFailedSync(unittest.TestCase):
    """check=True over reports as the C++ side returns them (a runner standing in for
    the job): the first failed sync raises the class of its code, a mismatch
    CorruptError, each with every report attached; check=False returns them."""

    def run_with(self, reports, check):
        return _rank._run(lambda spec: reports, "fetch", check, "tcp://127.0.0.1:9", None, 0, 1, 1)

    def test_on_report_must_be_callable(self):
        with self.assertRaises(ferry.InvalidArgumentError) as e:
            _rank._run(lambda spec: [], "fetch", False, "tcp://127.0.0.1:9", None, 0, 1, 1, on_report=3)
        self.assertIn("on_report must be callable", str(e.exception))

    def test_classes_and_reports(self):
        ok = {"role": "inference", "rank": 0, "version": 1, "ok": True, "verified": True}
        failed = {"role": "inference", "rank": 0, "version": 2, "ok": False, "code": "PeerFailed",
                  "error": "PeerFailed: producer 1 failed"}
        mismatch = {"role": "inference", "rank": 0, "version": 2, "ok": True, "verified": False,
                    "mismatch": "param 'w' index 3: 1 != 2"}
        self.assertEqual(self.run_with([ok, failed], False), [ok, failed])
        self.assertEqual(self.run_with([ok, ok], True), [ok, ok])
        with self.assertRaises(ferry.PeerFailedError) as e:
            self.run_with([ok, failed, mismatch], True)
        self.assertIn("fetch rank 0: version 2: PeerFailed: producer 1 failed", str(e.exception))
        self.assertEqual(e.exception.reports, [ok, failed, mismatch])
        with self.assertRaises(ferry.CorruptError) as e:
            self.run_with([mismatch], True)
        self.assertIn("param 'w' index 3", str(e.exception))
        with self.assertRaises(ferry.TimeoutError):
            self.run_with([dict(failed, code="Timeout")], True)


def rank_process(role, kwargs):
    run = ferry.serve if role == "serve" else ferry.fetch
    seen = []  # on_report: each sync's dict as it ends, the same as the returned list
    reports = run(**json.loads(kwargs), on_report=seen.append)
    print(json.dumps(reports), flush=True)
    if seen != reports:
        print(f"on_report saw {seen}\nbut {role} returned {reports}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-process":
        sys.exit(rank_process(sys.argv[2], sys.argv[3]))
    unittest.main()
