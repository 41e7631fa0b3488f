"""ferry.Producer / ferry.Consumer keywords against the engine's options
(include/ferry/engine.h: EngineOptions, ProducerOptions, ConsumerOptions): every field is
reached by a keyword (a field added to the header without one fails here), each keyword
reaches its field with its value, bad values raise InvalidArgumentError naming the
keyword, docs/python.md lists every keyword; in-place serving materialises each group once
at creation and once per sync."""
import inspect
import os
import re
import threading
import unittest

import numpy as np

import ferry
from ferry import _ferry

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "include", "ferry", "engine.h")
DOC = os.path.join(HERE, "..", "..", "docs", "python.md")

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
NOWHERE = "tcp://127.0.0.1:9"  # options are checked before the store is dialled


def split_top(text, sep):
    """`text` split at each `sep` outside (), {} and <>."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "({<"
        depth -= ch in ")}>"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def header_fields(struct):
    """The data members `struct` declares itself (not its base's), in order."""
    with open(HEADER) as f:
        text = f.read()
    body = re.search(r"\nstruct %s\b[^{;]*\{(.*?)\n\};" % struct, text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in split_top(body, ";"):
        decl = decl.strip()
        if not decl or decl.startswith(("static ", "using ", "friend ")):
            continue
        for part in split_top(decl, ","):                    # `uint64_t a = 0, b = 0`
            part = part.split("=", 1)[0].strip()             # `= default`
            part = re.sub(r"\{[^{}]*\}$", "", part).strip()  # `{default}`
            if not re.search(r"\)\s*(const)?$", part):       # a method ends in `)`
                fields.append(re.findall(r"\w+", part)[-1])
    return fields


def rows():
    return _ferry._option_fields()


# A non-default value for every keyword the binding sets, and what the engine then holds.
PRODUCER_SAMPLES = {
    "job": ("opts", "opts"), "num_producers": (3, 3), "num_consumers": (np.int64(4), 4), "mode": ("push", "push"),
    "rendezvous_timeout": (1.5, 1.5), "timeout": (2, 2.0), "stall_timeout": (float("inf"), 86400.0),
    "straggler_floor": (0.25, 0.25), "straggler_factor": (3.5, 3.5), "join_window": (7, 7.0), "lease_ttl": (0.5, 0.5),
    "checksums": (True, True), "weight_digests": (True, True), "failover": (False, False), "group_order": ("layer", "layer"), "convert_on": ("consumer", "consumer"),
    "quantize_on": ("consumer", "consumer"),
    "delta": (True, True), "delta_full_every": (np.int32(10), 10), "delta_block_bytes": (65536, 65536),
    "delta_same_host": (True, True), "direct_min_bytes": (0, 0),
    "staging_budget": (1 << 30, 1 << 30), "staging_device": ("cuda:1", "cuda:1"),
}
CONSUMER_SAMPLES = dict(
    {k: v for k, v in PRODUCER_SAMPLES.items()
     if k not in ("straggler_floor", "straggler_factor", "join_window", "staging_budget", "staging_device",
                  "delta_full_every", "delta_block_bytes")},
    cuda_ipc=(False, False), relay=(True, True), check_weights_each_sync=(True, True), direct_min_bytes=(2 ** 64 - 1, 2 ** 64 - 1), commit=("shadow", "shadow"))


def keywords(cls_name):
    return {r["keyword"]: r for r in rows() if r["how"] == "keyword" and cls_name in r["classes"]}


class Counting(ferry.WeightSource):
    """One trainer rank holding the whole checkpoint in numpy arrays that stay put;
    counts materialize calls per group."""

    def __init__(self):
        super().__init__()
        loader = ferry.ModelLoader(CONFIG)
        rng = np.random.default_rng(3)
        self.arrays = {n: rng.standard_normal(d.shape, dtype=np.float32) for n, d in loader.checkpoint.items()}
        self.calls = {}

    def metadata(self):
        return {n: (a.shape, a.dtype) for n, a in self.arrays.items()}

    def materialize(self, group):
        self.calls[group] = self.calls.get(group, 0) + 1
        return {n: self.arrays[n] for n, _, _ in self.boxes(group)}


def run_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i, f):
        try:
            results[i] = f()
        except Exception as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class OptionsTest(unittest.TestCase):
    def test_every_field_of_the_header_has_a_row(self):
        for struct in ("EngineOptions", "ProducerOptions", "ConsumerOptions"):
            fields = header_fields(struct)
            self.assertGreaterEqual(len(fields), 4, (struct, fields))  # the parser found the struct
            self.assertEqual(sorted(fields), sorted(r["field"] for r in rows() if r["options"] == struct),
                             f"{struct}: a field of include/ferry/engine.h without its row in "
                             f"src/python/options.cpp's kOptionFields (and a keyword), or a stale row")
        self.assertIn("straggler_floor", header_fields("EngineOptions"))

    def test_every_keyword_is_taken_by_its_classes(self):
        for r in rows():
            if r["how"] in ("internal", "native"):
                self.assertEqual((r["keyword"], r["classes"]), ("", []), r)
                continue
            self.assertTrue(r["classes"], r)
            for cls in r["classes"]:
                self.assertIn(r["keyword"], inspect.signature(getattr(ferry, cls)).parameters, (cls, r))
        self.assertEqual([r["field"] for r in rows() if r["how"] == "internal"], ["test_hooks"])
        self.assertEqual([r["field"] for r in rows() if r["how"] == "native"], ["own_params_in_transport_memory"])
        self.assertEqual([r["field"] for r in rows() if r["how"] == "metrics"], ["sink"])

    def test_each_keyword_reaches_its_field(self):
        for cls, samples, accessor in (("Producer", PRODUCER_SAMPLES, _ferry._producer_options),
                                       ("Consumer", CONSUMER_SAMPLES, _ferry._consumer_options)):
            self.assertEqual(set(samples), set(keywords(cls)), cls)
            defaults = accessor({})
            for kw, (value, expected) in samples.items():
                got = accessor({kw: value})
                field = keywords(cls)[kw]["field"]
                self.assertNotEqual(defaults[field], expected, (cls, kw))  # the sample is not the default
                self.assertEqual(got[field], expected, (cls, kw))
                self.assertEqual({k: v for k, v in got.items() if k != field},
                                 {k: v for k, v in defaults.items() if k != field}, (cls, kw))
            everything = accessor({kw: v for kw, (v, _) in samples.items()})
            for kw, (_, expected) in samples.items():
                self.assertEqual(everything[keywords(cls)[kw]["field"]], expected, (cls, kw))

    def test_python_defaults_are_the_engines(self):
        # Where ferry's Python defaults differ from the engine's, on purpose:
        differ = {
            "stall_timeout": 10.0,    # a Python job drops a silent consumer sooner than the CLI's 30 s
            "num_producers": None,    # Producer: source.world_size; Consumer: 1
            "num_consumers": None,    # Producer: 1; Consumer: the layout's world size or the launcher's
        }
        for cls, accessor in (("Producer", _ferry._producer_options), ("Consumer", _ferry._consumer_options)):
            params = inspect.signature(getattr(ferry, cls)).parameters
            engine = accessor({})
            for kw, r in keywords(cls).items():
                if kw in differ:
                    continue
                default = params[kw].default
                self.assertEqual(accessor({kw: default})[r["field"]], engine[r["field"]], (cls, kw, default))
            self.assertEqual(params["stall_timeout"].default, differ["stall_timeout"])

    def test_bad_values_are_refused_naming_the_keyword(self):
        source = Counting()
        bad = [("timeout", -1), ("timeout", "3"), ("rendezvous_timeout", float("nan")), ("lease_ttl", None),
               ("straggler_floor", -0.5), ("straggler_factor", float("inf")), ("straggler_factor", -1),
               ("join_window", -2), ("join_window", float("nan")),
               ("num_consumers", 0), ("num_consumers", 1.5), ("num_producers", 2 ** 40), ("checksums", "yes"),
               ("failover", 2), ("staging_budget", -1), ("direct_min_bytes", 2 ** 64), ("direct_min_bytes", 1.0),
               ("staging_device", "tpu:0"), ("staging_device", 0), ("mode", "pushy"), ("job", 3),
               ("group_order", "random"), ("group_order", 1), ("convert_on", "trainer"), ("convert_on", 0),
               ("quantize_on", "trainer"), ("quantize_on", 0),
               ("delta", "yes"), ("delta_full_every", -1), ("delta_full_every", 2 ** 32), ("delta_full_every", 1.5),
               ("delta_block_bytes", -1), ("delta_same_host", "yes")]
        for kw, value in bad:
            with self.assertRaises(ferry.InvalidArgumentError, msg=(kw, value)) as cm:
                ferry.Producer(source, NOWHERE, backend="inproc", **{kw: value})
            self.assertIn(kw, str(cm.exception))
        for kw, value in (("cuda_ipc", "no"), ("direct_min_bytes", -1), ("failover", None), ("timeout", []),
                          ("commit", "atomic"), ("commit", 1)):
            with self.assertRaises(ferry.InvalidArgumentError, msg=(kw, value)) as cm:
                ferry.Consumer(CONFIG, store=NOWHERE, backend="inproc", **{kw: value})
            self.assertIn(kw, str(cm.exception))
        # Integers and numpy scalars of the right kind are fine (checked before the store
        # is dialled: this fails only at the store).
        with self.assertRaises(ferry.Error) as cm:
            ferry.Producer(source, NOWHERE, token="options-test-token-0123456789", backend="inproc",
                           checksums=np.bool_(True), failover=0, num_consumers=np.int32(1), timeout=np.float32(0.5),
                           rendezvous_timeout=0.5)
        self.assertNotIsInstance(cm.exception, ferry.InvalidArgumentError)

    def test_created_engines_hold_the_keywords(self):
        # Through ferry.Producer / ferry.Consumer, so the wrappers pass every keyword on.
        producer_kw = dict(job="held", mode="push", timeout=20.0, rendezvous_timeout=25.0, stall_timeout=15.0,
                           straggler_floor=1.5, straggler_factor=4.0, join_window=12.0, lease_ttl=2.5, checksums=True,
                           failover=False,
                           direct_min_bytes=4096, staging_budget=1 << 24)
        consumer_kw = dict(job="held", mode="push", timeout=20.0, rendezvous_timeout=25.0, stall_timeout=15.0,
                           lease_ttl=2.5, checksums=True, failover=False, direct_min_bytes=8192, cuda_ipc=False)
        with ferry.StoreServer() as server:
            source = Counting()
            p, c = run_threads([lambda: ferry.Producer(source, server, backend="inproc", **producer_kw),
                                lambda: ferry.Consumer(CONFIG, store=server, backend="inproc",
                                                       after_group=lambda v, g: None, **consumer_kw)])
            held = p._p.options()
            for kw, value in producer_kw.items():
                self.assertEqual(held[keywords("Producer")[kw]["field"]], value, kw)
            self.assertEqual((held["num_producers"], held["num_consumers"], held["staging_device"]), (1, 1, "cpu"))
            held = c._c.options()
            for kw, value in consumer_kw.items():
                self.assertEqual(held[keywords("Consumer")[kw]["field"]], value, kw)
            self.assertTrue(held["after_group"])
            reports = run_threads([lambda: p.sync(1), lambda: c.sync(1)])
            self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
            p.close()
            c.close()

    def test_staging_device_reaches_create(self):
        # Without a usable GPU, create refuses the device it was asked for, naming it.
        try:
            import torch
            if torch.cuda.is_available():
                self.skipTest("a CUDA device is here (tests/engine's EngineDevice tests cover GPU staging)")
        except ImportError:
            pass
        with ferry.StoreServer() as server:
            with self.assertRaises(ferry.UnavailableError) as cm:
                ferry.Producer(Counting(), server, backend="inproc", staging_device="cuda:0", rendezvous_timeout=1.0)
            self.assertIn("staging_device cuda:0 cannot be used here", str(cm.exception))

    def test_in_place_materializes_each_group_once_at_create_and_per_sync(self):
        for in_place in (True, False):
            with ferry.StoreServer() as server:
                source = Counting()
                groups = len(source.groups())
                p, c = run_threads([lambda: ferry.Producer(source, server, backend="inproc", in_place=in_place,
                                                           direct_min_bytes=0, job="once"),
                                    lambda: ferry.Consumer(CONFIG, store=server, backend="inproc", job="once")])
                created = 1 if in_place else 0  # create finds each box in the registered memory
                self.assertEqual(source.calls, {g: created for g in range(groups)} if created else {}, in_place)
                for v in (1, 2):
                    reports = run_threads([lambda: p.sync(v), lambda: c.sync(v)])
                    self.assertTrue(all(r["ok"] for r in reports), [r["text"] for r in reports])
                    self.assertEqual(source.calls, {g: created + v for g in range(groups)}, in_place)
                    self.assertEqual(reports[0]["sent_in_place"] > 0, in_place, reports[0]["text"])
                loader = ferry.ModelLoader(CONFIG)
                want = {n: np.zeros(d.shape, np.float32) for n, d in loader.params(0).items()}
                loader.record_plan(0).replay(source.arrays, want)
                for name, a in c.params().items():
                    self.assertTrue(np.array_equal(np.asarray(a), want[name]), name)
                p.close()
                c.close()

    def test_docs_list_every_keyword_with_its_default(self):
        with open(DOC) as f:
            text = f.read()
        section = text.split("### Producer and Consumer keywords", 1)[1].split("\n## ", 1)[0]
        documented = {}
        for line in section.splitlines():
            m = re.match(r"\|\s*`(\w+)`\s*\|\s*([^|]*)\|\s*([^|]*)\|\s*([^|]*)\|", line)
            if m:
                documented[m.group(1)] = (m.group(2).strip(), m.group(3).strip(), m.group(4).strip())
        for cls in ("Producer", "Consumer"):
            for name, param in inspect.signature(getattr(ferry, cls)).parameters.items():
                if name in ("self", "source", "store") or param.kind == param.VAR_KEYWORD:
                    continue
                self.assertIn(name, documented, f"ferry.{cls}({name}=...) is not in docs/python.md's keyword table")
                takes, default, meaning = documented[name]
                self.assertIn(cls, takes, (cls, name))
                self.assertTrue(default and meaning, (cls, name))
                value = param.default
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0:
                    spelled = {65536: "64 KiB"}.get(value, f"{value:g}")
                    self.assertIn(spelled, default, (cls, name))

if __name__ == "__main__":
    unittest.main()
