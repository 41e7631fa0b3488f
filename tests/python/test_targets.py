"""Targets from Python (docs/targets.md), ranks as threads over the in-process transport:
a LoRA adapter in ferry.AdapterSlots on two engine ranks, fed by two FSDP-sharded trainer
ranks, with a reader thread per rank taking leases throughout (every lease one whole
version); an unchanged version kept under its old name; the adapter's job beside the
main model's (``target=``), with its own versions in the store."""
import threading
import unittest

import numpy as np

import ferry

RANK, HIDDEN, LAYERS = 8, 64, 2


def lora_tensors(version):
    """The PEFT checkpoint of the adapter at `version`: lora_A [r, hidden], lora_B [out, r]."""
    rng = np.random.default_rng(version)
    out = {}
    for layer in range(LAYERS):
        for proj, rows in (("q_proj", HIDDEN), ("v_proj", HIDDEN // 4)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}."
            out[base + "lora_A.weight"] = rng.standard_normal((RANK, HIDDEN), dtype=np.float32)
            out[base + "lora_B.weight"] = rng.standard_normal((rows, RANK), dtype=np.float32)
    return out


def kept(name, full, rank):
    """What engine rank `rank` (tp=2) keeps of a LoRA tensor: lora_A whole, lora_B by rows."""
    if "lora_B" in name:
        half = full.shape[0] // 2
        return full[rank * half:(rank + 1) * half]
    return full


def param_name(name):  # "layers.0.q_proj.lora_b"
    layer = name.split("layers.")[1].split(".")[0]
    proj = "q_proj" if "q_proj" in name else "v_proj"
    return f"layers.{layer}.{proj}.lora_{'b' if 'lora_B' in name else 'a'}"


def adapter_plan(rank):
    """The engine's LoRA loader at tp rank `rank`, recorded."""
    with ferry.record() as plan:
        for name, full in lora_tensors(0).items():
            src = ferry.source(name, full.shape, "float32")
            shape = kept(name, full, rank).shape
            dst = ferry.param(param_name(name), shape, "float32")
            dst.copy_(src[rank * shape[0]:(rank + 1) * shape[0]] if "lora_B" in name else src)
    return plan


class LoraTrainer(ferry.WeightSource):
    """A trainer rank holding half the rows of every LoRA tensor (FSDP dim-0 shards)."""

    def __init__(self, rank):
        super().__init__(rank=rank, world_size=2)
        self.weights = 1

    def metadata(self):
        return {n: (a.shape, a.dtype) for n, a in lora_tensors(0).items()}

    def holdings(self, rank):
        out = []
        for name, a in lora_tensors(0).items():
            half = a.shape[0] // 2
            out.append((name, (rank * half, 0), (half, a.shape[1])))
        return out

    def materialize(self, group):
        full = lora_tensors(self.weights)
        return {name: np.ascontiguousarray(full[name][start[0]:start[0] + size[0]])
                for name, start, size in self.boxes(group)}


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


@unittest.skipUnless(hasattr(ferry, "AdapterSlots"), "ferry built without its engine")
class AdapterSlotsTest(unittest.TestCase):
    def test_versions_switch_on_both_ranks_under_readers(self):
        with ferry.StoreServer() as server:
            common = dict(token=server.token, backend="inproc", job="rl", timeout=20.0, checksums=True)
            trainers = [LoraTrainer(p) for p in range(2)]
            made = run_threads(
                [lambda p=p: ferry.Producer(trainers[p], server.url, num_consumers=2, target="lora-math", **common)
                 for p in range(2)] +
                [lambda r=r: ferry.AdapterSlots(adapter_plan(r), rank=r, store=server, adapter="math",
                                                num_producers=2, num_consumers=2, switch_timeout=10.0, **common)
                 for r in range(2)])
            producers, slots = made[:2], made[2:]
            self.assertEqual(slots[0].job, "rl#lora-math")
            self.assertIsNone(slots[0].acquire())
            expect = {v: [{param_name(n): kept(n, a, r) for n, a in lora_tensors(v).items()} for r in range(2)]
                      for v in (1, 2)}
            stop, wrong, reads = threading.Event(), [0, 0], [0, 0]

            def reader(r):
                for _ in range(100000):  # (bounded: leases taken, or naps before the first switch)
                    if stop.is_set():
                        return
                    lease = slots[r].acquire()
                    if lease is None:
                        stop.wait(0.001)
                        continue
                    with lease:
                        want = expect.get(lease.version)
                        got = lease.params()
                        same = want is not None and lease.name == f"math@{lease.version}" and all(
                            np.array_equal(got[n], want[r][n]) for n in want[r])
                        wrong[r] += not same
                        reads[r] += 1

            readers = [threading.Thread(target=reader, args=(r,)) for r in range(2)]
            for t in readers:
                t.start()

            def sync(version, weights):
                for t in trainers:
                    t.weights = weights
                return run_threads([lambda p=p: p.sync(version) for p in producers] +
                                   [lambda s=s: s.sync(version) for s in slots])

            try:
                for v in (1, 2):
                    out = sync(v, v)
                    for r in out[2:]:
                        self.assertEqual(r["decision"], "switch", r)
                        self.assertEqual(r["serving"], f"math@{v}")
                        self.assertFalse(r["unchanged"])
                        self.assertTrue(r["report"]["ok"])
                # Version 3 with version 2's weights: kept under its old name; the trainer
                # is told it served nothing new.
                out = sync(3, 2)
                for r in out[:2]:
                    self.assertIs(r["unchanged"], True, r)
                for r in out[2:]:
                    self.assertEqual(r["decision"], "keep", r)
                    self.assertEqual(r["serving"], "math@2")
                    self.assertTrue(r["unchanged"])
                    self.assertIs(r["report"]["unchanged"], True)
            finally:
                stop.set()
                for t in readers:
                    t.join(60)
            self.assertEqual(wrong, [0, 0])
            self.assertGreater(min(reads), 0)
            # A lease holds its slot, and so does each view of it, past release(): close()
            # refuses while either lives.
            lease = slots[0].acquire()
            self.assertEqual(lease.name, "math@2")
            view = lease.params()[param_name(next(iter(lora_tensors(0))))]
            self.assertFalse(view.flags.writeable)
            with self.assertRaises(ferry.FailedPreconditionError):
                slots[0].close()
            lease.release()
            self.assertEqual(sum(s["readers"] for s in slots[0].slots()), 1)  # the view's
            with self.assertRaises(ferry.FailedPreconditionError):
                slots[0].close()
            del view
            self.assertEqual(sum(s["readers"] for s in slots[0].slots()), 0)
            self.assertEqual(ferry.committed_versions(server, 2, job="rl", target="lora-math"), [3, 3])
            self.assertEqual(ferry.adapter_serving(server, 2, job="rl", target="lora-math"), ["math@2", "math@2"])
            self.assertEqual(ferry.committed_versions(server, 2, job="rl"), [None, None])
            for s in slots:
                s.close()
            for p in producers:  # (before the store stops: a rank closed after it waits on the store)
                p.close()

    def test_bad_arguments_name_themselves(self):
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.AdapterSlots(adapter_plan(0), rank=0, store="tcp://127.0.0.1:1", adapter="math", slot_wait=-1)
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.Producer(LoraTrainer(0), "tcp://127.0.0.1:1", target="a/b")


if __name__ == "__main__":
    unittest.main()
