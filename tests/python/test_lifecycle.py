"""Lifecycle edges of ferry.Consumer / ferry.Producer from Python (issue 30, "Python edges"):

* a closed Consumer or Producer raises FailedPreconditionError naming the method for
  every use (it crashed the process with SIGSEGV for Consumer.state() and .params());
  views of ferry's own param buffers taken before close() stay readable (pull);
* the hooks that pair always pair: after_sync runs for every sync whose before_sync ran,
  also when the sync raises, and is given the error (after_sync(version, error)); a
  one-argument after_sync(version) keeps working and is called on failure too.

The closed-object checks run in a child process (`test_lifecycle.py --closed-child`), so
that a crash there is reported as this test's failure rather than ending the run.
Every check is deterministic: failures are made (a raising hook), never timed.
"""
import os
import signal
import subprocess
import sys
import threading
import time
import unittest

import numpy as np

import ferry

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def checkpoint(version):
    loader = ferry.ModelLoader(CONFIG)
    rng = np.random.default_rng(version)
    return {n: rng.standard_normal(d.shape, dtype=np.float32) for n, d in sorted(loader.checkpoint.items())}


class Trainer(ferry.WeightSource):
    """One trainer rank holding the whole checkpoint of `self.version`."""

    def __init__(self):
        super().__init__(rank=0, world_size=1)
        self.version = 1
        self.full = checkpoint(1)

    def metadata(self):
        return {n: (a.shape, a.dtype) for n, a in self.full.items()}

    def materialize(self, group):
        if getattr(self, "on_materialize", None) is not None:
            self.on_materialize(group)
        if getattr(self, "_at", None) != self.version:
            self.full, self._at = checkpoint(self.version), self.version
        return {name: self.full[name] for name, _, _ in self.boxes(group)}


def in_threads(fns):
    """Runs each callable on its own thread; [(result, exception)] in order."""
    out = [(None, None)] * len(fns)

    def run(i, f):
        try:
            out[i] = (f(), None)
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            out[i] = (None, e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def make_pair(server, job, **consumer_kw):
    """A Producer and a Consumer (rank 0 of tp=1) over the in-process transport."""
    trainer = Trainer()
    common = dict(backend="inproc", job=job, timeout=20.0)
    (producer, e1), (consumer, e2) = in_threads([
        lambda: ferry.Producer(trainer, server, **common),
        lambda: ferry.Consumer(store=server, rank=0, num_consumers=1, **common, **consumer_kw)])
    if e1 or e2:
        raise e1 or e2
    return trainer, producer, consumer


def sync_both(trainer, producer, consumer, version):
    trainer.version = version
    (prep, perr), (crep, cerr) = in_threads([lambda: producer.sync(version), lambda: consumer.sync(version)])
    if perr is not None:
        raise perr
    return crep, cerr


def closed_child():
    """Uses a closed Consumer and Producer every way; prints each step (the last one
    printed names a crash) and exits 0 when each raised FailedPreconditionError."""
    def expect_closed(what, fn):
        print("step:", what, flush=True)
        try:
            fn()
        except ferry.FailedPreconditionError as e:
            assert "closed" in str(e) and what.split("(")[0] in str(e), (what, str(e))
            return
        raise AssertionError(f"{what} after close() did not raise")

    loader = ferry.ModelLoader(CONFIG)
    with ferry.StoreServer() as server:
        # Params allocated by ferry (no params=): Consumer.params() gives views of its buffers.
        trainer, producer, consumer = make_pair(server, "closed", loader=loader)
        crep, cerr = sync_both(trainer, producer, consumer, 1)
        assert cerr is None and crep["ok"], (cerr, crep)
        views = consumer.params()
        expected = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(0).items()}
        loader.record_plan(0).replay(checkpoint(1), expected)
        consumer.close()
        consumer.close()  # idempotent
        expect_closed("Consumer.state()", consumer.state)
        expect_closed("Consumer.params()", consumer.params)
        expect_closed("Consumer.sync(2)", lambda: consumer.sync(2))
        with consumer:  # a context manager around a closed object: enter raises nothing, exit closes again
            pass
        print("step: views taken before close()", flush=True)
        for n, a in expected.items():
            assert np.array_equal(np.asarray(views[n]), a), n  # ferry's buffers outlive close() (pull)
        producer.close()
        producer.close()
        expect_closed("Producer.sync(2)", lambda: producer.sync(2))
        print("step: closed, rank", flush=True)
        assert consumer.closed is True and producer.closed is True
        assert consumer.rank == 0 and producer.rank == 0  # identity stays readable

        # The caller's params (loader= with params=): params() after close raises too,
        # though the answer would need nothing from the engine.
        params = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(0).items()}
        trainer, producer, consumer = make_pair(server, "closed-given", loader=loader, params=params)
        consumer.close()
        producer.close()
        expect_closed("Consumer.params()", consumer.params)
        expect_closed("Consumer.state()", consumer.state)

        # close() from another thread while sync runs (inside it: on the after_group hook):
        # the consumer is closed for every later call at once, and destroyed only once
        # that sync has returned, which completes.
        print("step: close() during sync", flush=True)
        closer = []

        def after_group(version, group):
            if closer:
                return
            closer.append(threading.Thread(target=consumer.close))
            closer[0].start()
            for _ in range(2000):  # until close() took the consumer out of use (bounded: 20 s)
                if consumer.closed:
                    break
                time.sleep(0.01)
            assert consumer.closed, "close() did not run"

        trainer, producer, consumer = make_pair(server, "close-during-sync", loader=loader, after_group=after_group)
        crep, cerr = sync_both(trainer, producer, consumer, 1)
        closer[0].join()
        assert cerr is None and crep["ok"], (cerr, crep)
        expect_closed("Consumer.state()", consumer.state)
        producer.close()

        # The same for a producer: close() from another thread while its sync runs (in
        # materialize, which the engine calls inside sync).
        print("step: Producer.close() during sync", flush=True)
        trainer, producer, consumer = make_pair(server, "producer-close-during-sync", loader=loader)
        closer = []

        def on_materialize(group):
            if closer:
                return
            closer.append(threading.Thread(target=producer.close))
            closer[0].start()
            for _ in range(2000):  # bounded: 20 s
                if producer.closed:
                    break
                time.sleep(0.01)
            assert producer.closed, "close() did not run"

        trainer.on_materialize = on_materialize
        crep, cerr = sync_both(trainer, producer, consumer, 1)
        closer[0].join()
        assert cerr is None and crep["ok"], (cerr, crep)
        expect_closed("Producer.sync(2)", lambda: producer.sync(2))
        consumer.close()
    print("closed child: ok", flush=True)


class ClosedTest(unittest.TestCase):
    def test_closed_consumer_and_producer_raise_instead_of_crashing(self):
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--closed-child"], capture_output=True,
                               text=True, timeout=240)
        how = (f"killed by {signal.Signals(-child.returncode).name}" if child.returncode < 0
               else f"exit {child.returncode}")
        self.assertEqual(child.returncode, 0, f"closed child {how}\nstdout:\n{child.stdout}\nstderr:\n{child.stderr}")
        self.assertIn("closed child: ok", child.stdout)


class HookPairingTest(unittest.TestCase):
    def test_after_sync_is_given_the_error_of_a_failed_sync(self):
        events = []
        fail = {"group": False}

        def after_group(version, group):
            if fail["group"]:
                raise ValueError("engine paused badly")

        def after_sync(version, error=None):
            events.append(("after", version, error))

        with ferry.StoreServer() as server:
            trainer, producer, consumer = make_pair(
                server, "pair-group", loader=ferry.ModelLoader(CONFIG), after_group=after_group,
                before_sync=lambda v: events.append(("before", v)), after_sync=after_sync)
            crep, cerr = sync_both(trainer, producer, consumer, 1)
            self.assertIsNone(cerr)
            fail["group"] = True
            crep, failed = sync_both(trainer, producer, consumer, 2)
            self.assertIsInstance(failed, ferry.Error)
            self.assertIn("engine paused badly", str(failed))
            fail["group"] = False
            crep, cerr = sync_both(trainer, producer, consumer, 3)
            self.assertIsNone(cerr)
            producer.close()
            consumer.close()
        self.assertEqual([e[:2] for e in events],
                         [("before", 1), ("after", 1), ("before", 2), ("after", 2), ("before", 3), ("after", 3)])
        self.assertIsNone(events[1][2])
        self.assertIs(events[3][2], failed)  # the very exception sync(2) raised
        self.assertIsNone(events[5][2])

    def test_engine_failure_passes_the_raised_error_and_one_arg_hooks_still_pair(self):
        # A generation lock held from before_sync to after_sync, as an inference engine does;
        # after_sync(version) of the old, one-argument form.
        lock = threading.Lock()
        calls = []

        def before_sync(version):
            assert lock.acquire(blocking=False), "the lock of the previous sync was never released"
            calls.append(("before", version))

        def after_sync(version):
            calls.append(("after", version))
            lock.release()

        def post_process(group, params):
            if fail["on"]:
                raise RuntimeError("quantize failed")

        fail = {"on": True}
        loader = ferry.ModelLoader(CONFIG)
        with ferry.StoreServer() as server:
            trainer, producer, consumer = make_pair(server, "pair-engine", plan=loader.record_plan(0),
                                                    post_process=post_process, before_sync=before_sync,
                                                    after_sync=after_sync)
            crep, cerr = sync_both(trainer, producer, consumer, 1)
            self.assertIsInstance(cerr, ferry.Error)
            self.assertIn("quantize failed", str(cerr))
            self.assertFalse(lock.locked(), "after_sync was not called when sync raised")
            fail["on"] = False
            crep, cerr = sync_both(trainer, producer, consumer, 2)
            self.assertIsNone(cerr)
            self.assertTrue(crep["ok"])
            self.assertFalse(lock.locked())
            producer.close()
            consumer.close()
        self.assertEqual(calls, [("before", 1), ("after", 1), ("before", 2), ("after", 2)])

    def test_the_error_given_is_the_one_sync_raises_and_a_raising_after_sync_does_not_hide_it(self):
        seen = []

        def post_process(group, params):
            raise RuntimeError("quantize failed")

        def after_sync(version, error):
            seen.append(error)
            raise KeyError("resume failed")

        loader = ferry.ModelLoader(CONFIG)
        with ferry.StoreServer() as server:
            trainer, producer, consumer = make_pair(server, "pair-raise", plan=loader.record_plan(0),
                                                    post_process=post_process, after_sync=after_sync)
            crep, cerr = sync_both(trainer, producer, consumer, 1)
            producer.close()
            consumer.close()
        self.assertEqual(len(seen), 1)
        self.assertIs(seen[0], cerr)  # the very exception sync raised
        self.assertIn("quantize failed", str(cerr))  # the sync's error, not the hook's
        self.assertTrue(any("resume failed" in n for n in getattr(cerr, "__notes__", [])), cerr)

    def test_a_raising_before_sync_runs_no_after_sync(self):
        calls = []

        def before_sync(version):
            raise RuntimeError("cannot pause")

        with ferry.StoreServer() as server:
            trainer, producer, consumer = make_pair(server, "pair-before", loader=ferry.ModelLoader(CONFIG),
                                                    before_sync=before_sync,
                                                    after_sync=lambda v, e=None: calls.append((v, e)))
            with self.assertRaisesRegex(RuntimeError, "cannot pause"):
                consumer.sync(1)  # nothing moved: the producer need not take part
            self.assertEqual(consumer.state(), {"version": None, "torn": False, "mixed": False, "received": None})
            producer.close()
            consumer.close()
        self.assertEqual(calls, [])


if __name__ == "__main__":
    if sys.argv[1:] == ["--closed-child"]:
        closed_child()
        sys.exit(0)
    unittest.main()
