"""ferry.megatron's MoE layouts (issue 30: an MoE Megatron trainer wrote its holdings by hand).

* Qwen3-30B-A3B (configs/qwen3-30b-a3b.json): GPTLayout's metadata is the checkpoint
  ferry's C++ loader expects, and every rank's holdings, over layouts with EP, ETP, DP,
  PP and expert-data-parallel replicas, are those of ferry's C++ Megatron helper
  (make_holdings, through ferry._ferry._LayoutHoldings) for GPTLayout.trainer_layout,
  box for box (but the vocab rows, which Megatron pads: checked on their own).
* A small Qwen3-MoE (a dense layer between two MoE layers) and a Mixtral: the views of a
  rank's native tensors, in each of Megatron-Core's three expert forms (TE grouped GEMM,
  legacy grouped GEMM, sequential), are the HF boxes, without copies; every expert
  element is held once per expert-data-parallel replica.
* End to end: MegatronSource over each form (in place) into a ModelLoader consumer, bit
  for bit against the loader's plan replayed over the HF weights.

The Megatron native tensors are written here from the HF weights, independently of
ferry.megatron, after Megatron-Core's layout (megatron/core/transformer/moe/experts.py).
"""
import json
import os
import threading
import unittest

import torch

import ferry
from ferry import megatron

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_30B = os.path.join(HERE, "..", "..", "configs", "qwen3-30b-a3b.json")

SMALL_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
    "mlp_only_layers": [1], "decoder_sparse_step": 1, "vocab_size": 300, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
SMALL_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 48,
    "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 300, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def merged(boxes):
    """{name: sorted boxes}, boxes of one tensor that continue each other on dim 0 merged
    (ferry.megatron lists the q/k/v rows of a rank per kv group; the C++ helper as one box)."""
    by_name = {}
    for name, start, size in boxes:
        by_name.setdefault(name, []).append((tuple(start), tuple(size)))
    out = {}
    for name, bs in by_name.items():
        bs.sort()
        m = [bs[0]]
        for start, size in bs[1:]:
            ps, pz = m[-1]
            if start[1:] == ps[1:] and size[1:] == pz[1:] and start[0] == ps[0] + pz[0]:
                m[-1] = (ps, (pz[0] + size[0],) + pz[1:])
            else:
                m.append((start, size))
        out[name] = m
    return out


def cpp_holdings(layout, checkpoint):
    meta = [(n, tuple(d.shape), d.dtype) for n, d in checkpoint.items()]
    return ferry._ferry._LayoutHoldings(meta, layout.trainer_layout, layout.heads * layout.head_dim,
                                        layout.kv_heads * layout.head_dim)


class Qwen3_30B_A3B_Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(QWEN3_30B) as f:
            cls.config = json.load(f)
        cls.checkpoint = ferry.ModelLoader(QWEN3_30B).checkpoint

    def test_metadata_is_the_checkpoint(self):
        layout = megatron.GPTLayout(self.config, tp=4, ep=8, etp=1, dp=2)
        meta = layout.metadata("bfloat16")
        self.assertEqual({n: tuple(s) for n, (s, _) in meta.items()},
                         {n: tuple(d.shape) for n, d in self.checkpoint.items()})
        self.assertEqual(len(meta), 18867)  # 48 layers x 128 experts x 3, attention, router, norms, vocab
        self.assertTrue(layout.is_moe_layer(0) and layout.is_moe_layer(47))
        self.assertEqual(layout.local_experts, 16)

    def test_holdings_are_the_cpp_helpers(self):
        # (tp, pp, dp, ep, etp): EP alone, EP x ETP, expert-data-parallel replicas (edp 2),
        # PP, and etp left to Megatron's default (tp).
        for tp, pp, dp, ep, etp in ((4, 2, 2, 8, 1), (2, 1, 4, 4, 2), (2, 3, 4, 2, 2), (1, 1, 8, 8, None),
                                    (2, 2, 2, 2, None), (4, 1, 2, 2, 4)):
            with self.subTest(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp):
                # Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * tp;
                # 151936 = 128 * 1187, so 128 / tp pads nothing and the vocab split is the C++ one.
                layout = megatron.GPTLayout(self.config, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp,
                                            make_vocab_size_divisible_by=128 // tp)
                self.assertEqual(layout.padded_vocab, self.config["vocab_size"])
                cpp = cpp_holdings(layout, self.checkpoint)
                self.assertEqual(cpp.world_size, layout.world_size)
                experts_held = 0
                for rank in range(layout.world_size):
                    mine = layout.holdings(rank)
                    self.assertEqual(merged(mine), merged(cpp.rank(rank)), f"rank {rank} of {layout.trainer_layout}")
                    experts_held += sum(1 for name, _, _ in mine if ".experts." in name)
                # Every expert box of every layer, once per edp replica and ETP slice.
                self.assertEqual(experts_held, 48 * 128 * 3 * layout.edp * layout.etp)

    def test_padded_vocab_differs_from_the_cpp_chunks_only_in_vocab_rows(self):
        layout = megatron.GPTLayout(self.config, tp=4, dp=2, ep=8, etp=1)  # Megatron's default: 128 * tp
        self.assertEqual(layout.padded_vocab, 152064)
        cpp = cpp_holdings(layout, self.checkpoint)
        for rank in (0, 3):
            mine, theirs = merged(layout.holdings(rank)), merged(cpp.rank(rank))
            vocab = {"model.embed_tokens.weight", "lm_head.weight"}
            self.assertEqual({k: v for k, v in mine.items() if k not in vocab},
                             {k: v for k, v in theirs.items() if k not in vocab})
            start, rows = megatron.vocab_rows(151936, 152064, 4, rank % 4)
            self.assertEqual(mine["lm_head.weight"], [((start, 0), (rows, 2048))])
        self.assertEqual(megatron.vocab_rows(151936, 152064, 4, 3), (114048, 37888))

    def test_expert_grid_and_refusals(self):
        layout = megatron.GPTLayout(self.config, tp=2, pp=2, dp=4, ep=2, etp=2)
        self.assertEqual(layout.edp, 2)
        self.assertEqual(layout.trainer_layout, "tp=2,pp=2,ep=2,etp=2,dp=4")
        # Stage 1 starts at rank 8; within a stage etp fastest, then ep, then edp.
        self.assertEqual(layout.expert_coords(8 + 0), (1, 0, 0, 0))
        self.assertEqual(layout.expert_coords(8 + 1), (1, 0, 0, 1))
        self.assertEqual(layout.expert_coords(8 + 2), (1, 0, 1, 0))
        self.assertEqual(layout.expert_coords(8 + 5), (1, 1, 0, 1))
        with self.assertRaisesRegex(ferry.InvalidArgumentError, r"ep\*etp = 4 must divide tp\*dp = 2"):
            megatron.GPTLayout(self.config, tp=2, dp=1, ep=4, etp=1)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "ep 3 does not divide the 128 experts"):
            megatron.GPTLayout(self.config, tp=1, dp=3, ep=3, etp=1)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "etp 8 does not divide moe_intermediate_size 764"):
            megatron.GPTLayout(dict(self.config, moe_intermediate_size=764), tp=1, dp=8, ep=1, etp=8)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "expert_layout"):
            megatron.GPTLayout(self.config, expert_layout="grouped")
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "gated shared expert"):
            megatron.GPTLayout(dict(self.config, shared_expert_intermediate_size=512))


# --- Megatron-Core native tensors of a rank, written from the HF weights ---------------------

def padded(cfg, tp, divisible_by=128):
    m = divisible_by * tp
    return -(-cfg["vocab_size"] // m) * m


def native_rank(hf, cfg, tp, dp, ep, etp, rank, form):
    """{Megatron-Core name: tensor} of global ``rank`` (pp=1) of a Qwen3-MoE / Mixtral."""
    mixtral = cfg["model_type"] == "mixtral"
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    Im = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    I = cfg["intermediate_size"]
    t = rank % tp
    local = rank % (tp * dp)
    x, o = local % etp, local // etp % ep   # ETP and EP rank in the expert grid
    El, Ix = E // ep, Im // etp
    V, Vp = cfg["vocab_size"], padded(cfg, tp)
    per = Vp // tp

    def vocab(w):
        out = torch.zeros(per, H)
        n = max(0, min(per, V - t * per))
        out[:n] = w[t * per:t * per + n]
        return out

    out = {"embedding.word_embeddings.weight": vocab(hf["model.embed_tokens.weight"])}
    qpg, groups = nh // nkv, nkv // tp
    for i in range(cfg["num_hidden_layers"]):
        p, n = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{c}_proj.weight"] for c in "qkv")
        rows = []
        for j in range(groups):
            g = t * groups + j
            rows += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
        out[n + "self_attention.linear_qkv.weight"] = torch.cat(rows).contiguous()
        out[n + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"].clone()
        if not mixtral:
            out[n + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"].clone()
            out[n + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"].clone()
        qc = nh * hd // tp
        out[n + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, t * qc:(t + 1) * qc].clone()
        moe = mixtral or i not in cfg.get("mlp_only_layers", [])
        if not moe:
            ic = I // tp
            out[n + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][t * ic:(t + 1) * ic],
                                                          hf[p + "mlp.up_proj.weight"][t * ic:(t + 1) * ic]])
            out[n + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"].clone()
            out[n + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, t * ic:(t + 1) * ic].clone()
            continue
        out[n + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        moe_p = p + ("block_sparse_moe." if mixtral else "mlp.")
        out[n + "mlp.router.weight"] = hf[moe_p + "gate.weight"].clone()
        fc1s, fc2s = [], []
        for j in range(El):
            e = o * El + j
            ex = moe_p + f"experts.{e}."
            gate, up, down = ((ex + "w1.weight", ex + "w3.weight", ex + "w2.weight") if mixtral else
                              (ex + "gate_proj.weight", ex + "up_proj.weight", ex + "down_proj.weight"))
            fc1s.append(torch.cat([hf[gate][x * Ix:(x + 1) * Ix], hf[up][x * Ix:(x + 1) * Ix]]))  # [2Ix, H]
            fc2s.append(hf[down][:, x * Ix:(x + 1) * Ix].clone())                              # [H, Ix]
        if form == "te_grouped":      # TEGroupedMLP: TE GroupedLinear's weight0..weight{El-1}
            for j in range(El):
                out[n + f"mlp.experts.linear_fc1.weight{j}"] = fc1s[j].contiguous()
                out[n + f"mlp.experts.linear_fc2.weight{j}"] = fc2s[j].contiguous()
        elif form == "sequential":    # SequentialMLP: one MLP per local expert
            for j in range(El):
                out[n + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1s[j].contiguous()
                out[n + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = fc2s[j].contiguous()
        else:                         # GroupedMLP: weight1 [H, El*2Ix] used as [El, H, 2Ix], weight2 [El*Ix, H]
            out[n + "mlp.experts.weight1"] = torch.stack([f.t() for f in fc1s]).contiguous().view(H, El * 2 * Ix)
            out[n + "mlp.experts.weight2"] = torch.stack([f.t() for f in fc2s]).contiguous().view(El * Ix, H)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    return out


def hf_state(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, d in ferry.ModelLoader(cfg).checkpoint.items():
        t = torch.randn(tuple(d.shape), generator=g)
        out[name] = 1.0 + 0.1 * t if len(d.shape) == 1 else 0.02 * t
    return out


def check_rank_views(test, layout, rank, native, hf, held):
    """Asserts that ``layout.views(rank, native)`` are the HF boxes of the rank's holdings,
    each as many as it has boxes, views of ``native`` (not copies) with ``hf``'s values
    (in its dtype), and counts each viewed element in ``held[name]`` where ``held`` has
    the name."""
    storages = {t.storage().data_ptr() for t in native.values()}
    views = layout.views(rank, native)
    boxes = {}
    for name, start, size in layout.holdings(rank):
        boxes.setdefault(name, []).append((start, size))
    test.assertEqual(set(views), set(boxes))
    for name, vs in views.items():
        vs = vs if isinstance(vs, list) else [vs]
        test.assertEqual(len(vs), len(boxes[name]), name)
        for v, (start, size) in zip(vs, boxes[name]):
            box = tuple(slice(a, a + n) for a, n in zip(start, size))
            test.assertIn(v.storage().data_ptr(), storages, name)  # a view, not a copy
            test.assertTrue(torch.equal(v.to(hf[name].dtype), hf[name][box]), (rank, name, start))
            if name in held:
                held[name][box] += 1


class NativeViewsTest(unittest.TestCase):
    def check_views(self, cfg, tp, dp, ep, etp, form):
        hf = hf_state(cfg, seed=3)
        layout = megatron.GPTLayout(cfg, tp=tp, dp=dp, ep=ep, etp=etp)
        meta = layout.metadata(torch.float32)
        self.assertEqual({n: tuple(s) for n, (s, _) in meta.items()}, {n: tuple(t.shape) for n, t in hf.items()})
        held = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in hf.items() if ".experts." in n}
        for rank in range(layout.world_size):
            with self.subTest(form=form, rank=rank):
                check_rank_views(self, layout, rank, native_rank(hf, cfg, tp, dp, ep, etp, rank, form), hf, held)
        for name, count in held.items():
            self.assertTrue(bool((count == layout.edp).all()), (form, name))  # once per edp replica
        return layout

    def test_qwen3_moe_views_in_every_expert_form(self):
        for form in megatron.EXPERT_LAYOUTS:
            for tp, dp, ep, etp in ((2, 2, 2, 1), (2, 2, 2, 2), (1, 4, 2, 1)):
                with self.subTest(form=form, tp=tp, dp=dp, ep=ep, etp=etp):
                    layout = self.check_views(SMALL_QWEN3_MOE, tp, dp, ep, etp, form)
                    self.assertEqual([layout.is_moe_layer(i) for i in range(3)], [True, False, True])

    def test_mixtral_views(self):
        for form in megatron.EXPERT_LAYOUTS:
            with self.subTest(form=form):
                self.check_views(SMALL_MIXTRAL, 2, 2, 4, 1, form)

    def test_an_explicit_expert_layout_must_match_the_native_names(self):
        hf = hf_state(SMALL_QWEN3_MOE, seed=1)
        native = native_rank(hf, SMALL_QWEN3_MOE, 2, 1, 1, 2, 0, "sequential")
        layout = megatron.GPTLayout(SMALL_QWEN3_MOE, tp=2, expert_layout="te_grouped")
        with self.assertRaisesRegex(ferry.NotFoundError, "mlp.experts.linear_fc1.weight0"):
            layout.views(0, native)
        del native["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
        with self.assertRaisesRegex(ferry.NotFoundError, "no routed experts"):
            megatron.GPTLayout(SMALL_QWEN3_MOE, tp=2).views(0, native)


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


class MoESyncTest(unittest.TestCase):
    def test_megatron_moe_trainer_to_inference_ranks_bit_for_bit(self):
        # Trainer: tp=2, dp=2, ep=2, etp=1 (4 ranks; each expert on 2 edp replicas); inference tp=2.
        cfg, tp, dp, ep, etp = SMALL_QWEN3_MOE, 2, 2, 2, 1
        loader = ferry.ModelLoader(cfg, "tp=2")
        hf = hf_state(cfg, seed=7)
        expected = []
        for r in range(2):
            params = {n: torch.zeros(tuple(d.shape)) for n, d in loader.params(r).items()}
            loader.record_plan(r).replay(hf, params)
            expected.append(params)
        with ferry.StoreServer() as server:
            for form in megatron.EXPERT_LAYOUTS:
                with self.subTest(form=form):
                    layout = megatron.GPTLayout(cfg, tp=tp, dp=dp, ep=ep, etp=etp)
                    natives = [native_rank(hf, cfg, tp, dp, ep, etp, r, form) for r in range(layout.world_size)]
                    common = dict(backend="inproc", job=f"moe-{form}", timeout=20.0)
                    makers = [lambda r=r: ferry.Producer(megatron.MegatronSource(layout, natives[r], rank=r), server,
                                                         num_consumers=2, in_place=True, direct_min_bytes=0, **common)
                              for r in range(layout.world_size)]
                    makers += [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server,
                                                          num_producers=layout.world_size, **common)
                               for r in range(2)]
                    made = run_threads(makers)
                    producers, consumers = made[:layout.world_size], made[layout.world_size:]
                    reports = run_threads([lambda p=p: p.sync(1) for p in producers] +
                                          [lambda c=c: c.sync(1) for c in consumers])
                    for rep in reports:
                        self.assertTrue(rep["ok"], rep["text"])
                    self.assertGreater(sum(rep["sent_in_place"] for rep in reports[:layout.world_size]), 0)
                    for r, c in enumerate(consumers):
                        got = c.params()
                        for n, t in expected[r].items():
                            self.assertTrue(torch.equal(torch.as_tensor(got[n]), t), (form, r, n))
                    for x in producers + consumers:
                        x.close()


class DocsTest(unittest.TestCase):
    def test_the_docs_moe_example_runs(self):
        import re
        with open(os.path.join(HERE, "..", "..", "docs", "python.md")) as f:
            section = f.read().split("## Megatron-Core MoE trainers", 1)[1].split("\n## ", 1)[0]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        cwd = os.getcwd()
        os.chdir(os.path.join(HERE, "..", ".."))  # its config path is the repository's
        try:
            exec(compile(code, "docs/python.md (MoE)", "exec"), {"__name__": "docs_moe"})
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    unittest.main()
