"""ferry.megatron's DeepSeek-V3 layout (issue 47: an MLA + shared-expert + MTP trainer wrote
about 150 lines of holdings by hand).

* GPTLayout's metadata for a small DeepSeek-V3 (a dense layer, two MoE layers with a
  shared expert and the noaux_tc router bias, an MTP layer, a padded vocabulary) is the
  checkpoint ferry's C++ DeepseekV3 loader expects, with and without its MTP layer.
* The views of every rank's native tensors, over layouts with TP, PP, DP, EP and ETP, are
  the HF boxes, without copies; every element of every tensor is held, each expert's once
  per expert-data-parallel replica.
* End to end: a 4-rank Megatron-style trainer (tp=2, pp=2, ep=2, served in place) into 4
  inference ranks (ferry's DeepseekV3 loader, tp=4 with EP, the MTP layer loaded as the
  draft model) over two versions: bit for bit against the loader's plan replayed over the
  HF weights; with FP8 quantised on the trainer, the same bits as quantised on the
  consumer, and the bytes on the wire what the consumers keep.
* Issue 47's adoption case with nothing written by hand: the same trainer into a 4-rank
  engine-style module (deepseek_vllm.py: vLLM's DeepseekV2ForCausalLM loading) recorded
  with ferry.record_load and marked to keep its linear weights in FP8 (quantised on the
  trainer), beside the built-in loader in one job: the same plan, the same bits, the
  module's other params its own as its own load_weights leaves them, over two versions.

The Megatron native tensors are written here from the HF weights, independently of
ferry.megatron, after Megatron-Core's MLA (megatron/core/transformer/multi_latent_attention.py),
shared experts and multi-token prediction (multi_token_prediction.py).
"""
import os
import sys
import unittest

import torch

import ferry
from ferry import megatron

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_megatron_moe import check_rank_views, merged, run_threads  # noqa: E402

DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "topk_method": "noaux_tc", "vocab_size": 300, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
}


def hf_state(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, d in ferry.ModelLoader(cfg, mtp="skip").checkpoint.items():
        t = torch.randn(tuple(d.shape), generator=g)
        out[name] = 1.0 + 0.1 * t if len(d.shape) == 1 else 0.02 * t
    return out


def native_rank(hf, cfg, tp, pp, dp, ep, etp, rank, mtp=True, mtp_inner="transformer_layer", first=None):
    """{Megatron-Core name: tensor} of global ``rank`` of a DeepSeek-V3 (experts in the
    TE grouped-GEMM form; the other forms are test_megatron_moe.py's). ``mtp_inner``: the
    MTP layer's decoder layer, ``transformer_layer`` or (newer Megatron-Core)
    ``mtp_model_layer``."""
    H, L, nh = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    qk, nope, vd = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    E, Im, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Is = cfg["n_shared_experts"] * Im
    stage, t = rank // (tp * dp), rank % tp
    local = rank % (tp * dp)
    x, o = local % etp, local // etp % ep
    El, Ix, h = E // ep, Im // etp, nh // tp
    if first is None:
        per_stage, extra = divmod(L, pp)
        start = stage * per_stage + min(stage, extra)
        layers = range(start, start + per_stage + (1 if stage < extra else 0))
    else:  # `first` layers in stage 0, the rest evenly (pp=2 here: all in stage 1)
        assert pp == 2
        layers = range(0, first) if stage == 0 else range(first, L)
    V = cfg["vocab_size"]
    Vp = -(-V // (128 * tp)) * 128 * tp
    per = Vp // tp

    def vocab(w):
        out = torch.zeros(per, H)
        n = max(0, min(per, V - t * per))
        out[:n] = w[t * per:t * per + n]
        return out

    def rows(w, n):  # TP rank t's n rows
        return w[t * n:(t + 1) * n].clone()

    def layer(i, n, out):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[n + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
        if cfg.get("q_lora_rank"):
            out[n + "self_attention.linear_q_down_proj.weight"] = hf[a + "q_a_proj.weight"].clone()
            out[n + "self_attention.linear_q_up_proj.layer_norm_weight"] = hf[a + "q_a_layernorm.weight"].clone()
            out[n + "self_attention.linear_q_up_proj.weight"] = rows(hf[a + "q_b_proj.weight"], h * qk)
        else:  # DeepSeek-V2-Lite: no q down projection
            out[n + "self_attention.linear_q_proj.weight"] = rows(hf[a + "q_proj.weight"], h * qk)
        out[n + "self_attention.linear_kv_down_proj.weight"] = hf[a + "kv_a_proj_with_mqa.weight"].clone()
        out[n + "self_attention.linear_kv_up_proj.layer_norm_weight"] = hf[a + "kv_a_layernorm.weight"].clone()
        out[n + "self_attention.linear_kv_up_proj.weight"] = rows(hf[a + "kv_b_proj.weight"], h * (nope + vd))
        out[n + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"][:, t * h * vd:(t + 1) * h * vd].clone()
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            ic = I // tp
            out[n + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"].clone()
            out[n + "mlp.linear_fc1.weight"] = torch.cat([rows(hf[m + "gate_proj.weight"], ic),
                                                          rows(hf[m + "up_proj.weight"], ic)])
            out[n + "mlp.linear_fc2.weight"] = hf[m + "down_proj.weight"][:, t * ic:(t + 1) * ic].clone()
            return
        out[n + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[n + "mlp.router.weight"] = hf[m + "gate.weight"].clone()
        if cfg.get("topk_method") == "noaux_tc":  # an fp32 buffer in Megatron-Core
            out[n + "mlp.router.expert_bias"] = hf[m + "gate.e_score_correction_bias"].float().clone()
        for j in range(El):
            ex = m + f"experts.{o * El + j}."
            out[n + f"mlp.experts.linear_fc1.weight{j}"] = torch.cat(
                [hf[ex + "gate_proj.weight"][x * Ix:(x + 1) * Ix], hf[ex + "up_proj.weight"][x * Ix:(x + 1) * Ix]])
            out[n + f"mlp.experts.linear_fc2.weight{j}"] = hf[ex + "down_proj.weight"][:, x * Ix:(x + 1) * Ix].clone()
        sc = Is // tp
        out[n + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [rows(hf[m + "shared_experts.gate_proj.weight"], sc), rows(hf[m + "shared_experts.up_proj.weight"], sc)])
        out[n + "mlp.shared_experts.linear_fc2.weight"] = \
            hf[m + "shared_experts.down_proj.weight"][:, t * sc:(t + 1) * sc].clone()

    out = {}
    mtp = mtp and bool(cfg.get("num_nextn_predict_layers"))
    if stage == 0 or (stage == pp - 1 and mtp):  # the last stage keeps the embedding for its MTP layer
        out["embedding.word_embeddings.weight"] = vocab(hf["model.embed_tokens.weight"])
    for li, i in enumerate(layers):
        layer(i, f"decoder.layers.{li}.", out)
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        out["output_layer.weight"] = vocab(hf["lm_head.weight"])
        if mtp:
            p, n = f"model.layers.{L}.", "mtp.layers.0."
            # The MTP layer's own embed_tokens / shared_head.head are in the checkpoint; a
            # Megatron trainer ties them to its embedding and output layer, so the HF
            # state here makes them equal (as DeepSeek-V3's checkpoint has them).
            out[n + "enorm.weight"] = hf[p + "enorm.weight"].clone()
            out[n + "hnorm.weight"] = hf[p + "hnorm.weight"].clone()
            out[n + "eh_proj.weight"] = rows(hf[p + "eh_proj.weight"], H // tp)
            out[n + "final_layernorm.weight"] = hf[p + "shared_head.norm.weight"].clone()
            layer(L, n + mtp_inner + ".", out)
    return out


def tied_mtp_state(cfg, seed):
    """An HF state whose MTP layer shares the main model's embedding and head (a Megatron
    trainer's MTP has no copies of its own)."""
    hf = hf_state(cfg, seed)
    L = cfg["num_hidden_layers"]
    if cfg.get("num_nextn_predict_layers"):
        hf[f"model.layers.{L}.embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
        hf[f"model.layers.{L}.shared_head.head.weight"] = hf["lm_head.weight"].clone()
    return hf


# DeepSeek-V2-Lite's shape: no q_lora_rank (q_proj), no MTP, softmax routing (no bias).
DEEPSEEK_V2_LITE = {k: v for k, v in DEEPSEEK.items() if k not in ("q_lora_rank", "topk_method")}
DEEPSEEK_V2_LITE.update(num_nextn_predict_layers=0)


# The sync tests' trainer: (tp, pp, dp, ep, etp), 4 ranks.
TRAINER = (2, 2, 1, 2, 1)


def step_and_sync(test, natives, cfg, hf, version, producers, consumers):
    """The trainer's step (each TRAINER rank's native tensors rewritten in place from
    ``hf``), then ``version`` synced by every rank, each report
    ok: the consumers' reports."""
    for r, native in enumerate(natives):
        for name, t in native_rank(hf, cfg, *TRAINER, r).items():
            native[name].copy_(t)
    reports = run_threads([lambda p=p: p.sync(version) for p in producers] +
                          [lambda c=c: c.sync(version) for c in consumers])
    for rep in reports:
        test.assertTrue(rep["ok"], rep["text"])
    return reports[len(producers):]


def bits(t):
    t = torch.as_tensor(t)
    return t.contiguous().view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)


class DeepSeekLayoutTest(unittest.TestCase):
    def test_metadata_is_the_loaders_checkpoint_with_and_without_mtp(self):
        bf16 = dict(DEEPSEEK, torch_dtype="bfloat16")
        layout = megatron.GPTLayout(bf16, tp=2, pp=2, ep=2, etp=1)
        meta = layout.metadata(torch.bfloat16)
        ckpt = ferry.ModelLoader(bf16, mtp="skip").checkpoint
        # Names, shapes and dtypes (the router bias fp32 in a bf16 model, as Megatron keeps it).
        self.assertEqual({n: (tuple(s), str(d).replace("torch.", "")) for n, (s, d) in meta.items()},
                         {n: (tuple(d.shape), d.dtype) for n, d in ckpt.items()})
        self.assertEqual(meta["model.layers.1.mlp.gate.e_score_correction_bias"][1], torch.float32)
        lite = megatron.GPTLayout(DEEPSEEK_V2_LITE, tp=2).metadata(torch.float32)
        self.assertEqual(set(lite), set(ferry.ModelLoader(DEEPSEEK_V2_LITE).checkpoint))
        self.assertIn("model.layers.0.self_attn.q_proj.weight", lite)
        # num_nextn_predict_layers of a model that is not DeepSeek-style is not its MTP.
        qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_hidden_layers": 2, "vocab_size": 300, "num_nextn_predict_layers": 1}
        self.assertEqual(megatron.GPTLayout(qwen).mtp_layers, 0)
        self.assertIn("model.layers.3.eh_proj.weight", meta)
        self.assertIn("model.layers.1.mlp.gate.e_score_correction_bias", meta)
        no_mtp = megatron.GPTLayout(DEEPSEEK, tp=2, mtp_layers=0).metadata(torch.float32)
        cfg = dict(DEEPSEEK, num_nextn_predict_layers=0)
        self.assertEqual(set(no_mtp), set(ferry.ModelLoader(cfg).checkpoint))
        self.assertEqual([layout.is_moe_layer(i) for i in range(4)], [False, True, True, True])

    def test_holdings_are_the_cpp_helpers_but_for_the_padded_vocab_rows(self):
        """ferry's C++ Megatron helper (make_holdings, what WeightSource(layout=...) and
        ferry plan --trainer compute) holds a DeepSeek-V3 as GPTLayout does, MTP layer
        included (its eh_proj rows, the last stage), box for box: only the vocab rows
        differ, which Megatron pads and the C++ helper chunks unpadded."""
        def meta_of(layout):
            return [(n, tuple(s), d) for n, (s, d) in layout.metadata(torch.float32).items()]

        vocab = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")
        for tp, pp, dp, ep, etp, first in ((2, 2, 1, 2, 1, None), (2, 1, 2, 4, 1, None), (1, 2, 2, 2, 1, 1),
                                           (2, 2, 2, 2, 2, 2)):
            with self.subTest(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, first=first):
                layout = megatron.GPTLayout(DEEPSEEK, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, first=first)
                cpp = ferry._ferry._LayoutHoldings(meta_of(layout), layout.trainer_layout, 0, 0)
                for rank in range(layout.world_size):
                    mine = {k: v for k, v in merged(layout.holdings(rank)).items() if not k.endswith(vocab)}
                    theirs = {k: v for k, v in merged(cpp.rank(rank)).items() if not k.endswith(vocab)}
                    self.assertEqual(mine, theirs, f"rank {rank} of {layout.trainer_layout}")
                    if rank == layout.world_size - 1:
                        self.assertIn("model.layers.3.eh_proj.weight", mine)

    def test_refusals_name_the_field(self):
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "tp 8 does not divide num_attention_heads 4"):
            megatron.GPTLayout(DEEPSEEK, tp=8, dp=1)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "ep 3 does not divide the 4 experts"):
            megatron.GPTLayout(DEEPSEEK, tp=1, dp=3, ep=3)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "shared_expert_intermediate_size"):
            megatron.GPTLayout(dict(DEEPSEEK, shared_expert_intermediate_size=64))
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "do not leave 3 layers for pp 2 stages"):
            megatron.GPTLayout(DEEPSEEK, pp=2, first=2, last=2)
        with self.assertRaisesRegex(ferry.InvalidArgumentError, "first=1 needs pp > 1"):
            megatron.GPTLayout(DEEPSEEK, first=1)

    def test_views_are_the_hf_boxes_of_every_rank(self):
        cases = [(DEEPSEEK, 2, 2, 1, 2, 1, {}), (DEEPSEEK, 2, 1, 2, 4, 1, {}), (DEEPSEEK, 1, 2, 2, 2, 1, {}),
                 (DEEPSEEK, 2, 2, 2, 2, 2, {}),
                 # newer Megatron-Core's MTP naming; uneven stages (Megatron's first/last flags)
                 (DEEPSEEK, 2, 2, 1, 2, 1, {"mtp_inner": "mtp_model_layer", "first": 1}),
                 (DEEPSEEK_V2_LITE, 2, 2, 1, 2, 1, {})]
        for cfg, tp, pp, dp, ep, etp, extra in cases:
            hf = tied_mtp_state(cfg, seed=3)
            first = extra.get("first")
            with self.subTest(model=cfg["model_type"], tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, **extra):
                layout = megatron.GPTLayout(cfg, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, first=first)
                held = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in hf.items()}
                for rank in range(layout.world_size):
                    native = native_rank(hf, cfg, tp, pp, dp, ep, etp, rank,
                                         mtp_inner=extra.get("mtp_inner", "transformer_layer"), first=first)
                    check_rank_views(self, layout, rank, native, hf, held)
                for name, count in held.items():
                    self.assertTrue(bool((count > 0).all()), (name, "some element is held by no rank"))
                    if ".experts." in name and "shared" not in name:
                        self.assertTrue(bool((count == layout.edp).all()), name)  # once per edp replica


class DeepSeekSyncTest(unittest.TestCase):
    def sync_job(self, job, hf_states, quantize, quantize_on, server):
        """A 4-rank Megatron-style trainer (tp=2, pp=2, ep=2) into 4 DeepseekV3 ranks (tp=4,
        EP, the MTP layer as the draft): [(reports, [params of each consumer])] per version."""
        tp, pp, dp, ep, etp = TRAINER
        layout = megatron.GPTLayout(DEEPSEEK, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
        loader = ferry.ModelLoader(DEEPSEEK, "tp=4,ep=4", quantize=quantize, mtp="draft")
        natives = [native_rank(hf_states[0], DEEPSEEK, tp, pp, dp, ep, etp, r) for r in range(layout.world_size)]
        common = dict(backend="inproc", job=job, timeout=20.0, quantize_on=quantize_on)
        made = run_threads(
            [lambda r=r: ferry.Producer(megatron.MegatronSource(layout, natives[r], rank=r), server, num_consumers=4,
                                        in_place=True, direct_min_bytes=0, **common)
             for r in range(layout.world_size)] +
            [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=layout.world_size, **common)
             for r in range(4)])
        producers, consumers = made[:layout.world_size], made[layout.world_size:]
        out = []
        for version, hf in enumerate(hf_states, start=1):
            received = step_and_sync(self, natives, DEEPSEEK, hf, version, producers, consumers)
            out.append((received, [{n: bits(t).clone() for n, t in c.params().items()} for c in consumers]))
        for x in made:
            x.close()
        return loader, out

    def test_megatron_deepseek_trainer_to_inference_ranks_bit_for_bit(self):
        states = [tied_mtp_state(DEEPSEEK, seed=s) for s in (11, 12)]
        with ferry.StoreServer() as server:
            loader, dense = self.sync_job("ds-dense", states, "none", "producer", server)
            for (reports, params), hf in zip(dense, states):
                for r in range(4):
                    expected = {n: torch.zeros(tuple(d.shape)) for n, d in loader.params(r).items()}
                    loader.record_plan(r).replay(hf, expected)
                    self.assertIn("model.layers.3.mtp_block.self_attn.o_proj.weight", expected)  # the draft
                    self.assertEqual(set(params[r]), set(expected))
                    for n, t in expected.items():
                        self.assertTrue(torch.equal(params[r][n], bits(t)), (r, n))
            fp8_loader, on_trainer = self.sync_job("ds-fp8-producer", states, "fp8", "producer", server)
            _, on_consumer = self.sync_job("ds-fp8-consumer", states, "fp8", "consumer", server)
            for v, ((reports, params), (c_reports, c_params), (_, dense_params)) in enumerate(
                    zip(on_trainer, on_consumer, dense)):
                for r in range(4):
                    self.assertEqual(set(params[r]), set(c_params[r]))
                    for n, b in params[r].items():
                        self.assertTrue(torch.equal(b, c_params[r][n]), (v, r, n))  # same bits either side
                        if n in dense_params[r] and not n.endswith("_scale_inv") and \
                                fp8_loader.final_params(r)[n].dtype == loader.params(r)[n].dtype:
                            self.assertTrue(torch.equal(b, dense_params[r][n]), (v, r, n))  # not quantised
                    kept = sum(t.numel() for t in params[r].values())  # bytes (uint8 views)
                    padding = fp8_loader.record_plan(r).stats()["zero_elements"] * 4  # padded vocab rows, f32
                    self.assertEqual(reports[r]["bytes_received"], kept - padding, r)
                    self.assertGreater(c_reports[r]["bytes_received"], kept - padding, r)

    def test_a_bf16_trainer_module_with_its_fp32_router_bias_buffer(self):
        """Megatron-Core keeps the router's expert_bias an fp32 buffer beside bf16 weights:
        MegatronSource given the model takes its parameters and buffers, publishes the
        model's dtype (bf16) and the bias as fp32, and the sync is bit for bit."""

        class Model:  # stands in for the rank's Megatron-Core module
            def __init__(self, native):
                self.buffers = {n: t for n, t in native.items() if n.endswith("router.expert_bias")}
                self.params = {n: t for n, t in native.items() if n not in self.buffers}

            def named_parameters(self):
                return iter(self.params.items())

            def named_buffers(self):
                return iter(self.buffers.items())

        cfg = dict(DEEPSEEK, torch_dtype="bfloat16")
        tp, pp, dp, ep, etp = TRAINER
        hf = {n: (t if n.endswith("e_score_correction_bias") else t.bfloat16())
              for n, t in tied_mtp_state(cfg, seed=41).items()}
        layout = megatron.GPTLayout(cfg, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
        models = [Model({n: t.bfloat16() if not n.endswith("expert_bias") else t
                         for n, t in native_rank(hf, cfg, tp, pp, dp, ep, etp, r).items()})
                  for r in range(layout.world_size)]
        self.assertTrue(models[0].buffers)
        loader = ferry.ModelLoader(cfg, "tp=4,ep=4", mtp="draft")
        with ferry.StoreServer() as server:
            common = dict(backend="inproc", job="ds-bf16", timeout=20.0)
            sources = [megatron.MegatronSource(layout, models[r], rank=r) for r in range(layout.world_size)]
            self.assertEqual(sources[0].dtype, torch.bfloat16)
            made = run_threads(
                [lambda r=r: ferry.Producer(sources[r], server, num_consumers=4, in_place=True, **common)
                 for r in range(layout.world_size)] +
                [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=layout.world_size,
                                            **common) for r in range(4)])
            reports = run_threads([lambda x=x: x.sync(1) for x in made])
            for rep in reports:
                self.assertTrue(rep["ok"], rep["text"])
            for r, c in enumerate(made[layout.world_size:]):
                expected = {n: torch.zeros(tuple(d.shape), dtype=getattr(torch, d.dtype))
                            for n, d in loader.params(r).items()}
                loader.record_plan(r).replay(hf, expected)
                got = c.params()
                self.assertEqual(got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype, torch.float32)
                for n, t in expected.items():
                    self.assertTrue(torch.equal(bits(got[n]), bits(t)), (r, n))
            for x in made:
                x.close()


class EngineModuleTest(unittest.TestCase):
    """Issue 47's adoption case, with nothing written by hand: the Megatron-style trainer
    above (GPTLayout's holdings and views; fp32 masters of a bf16 checkpoint) into a 4-rank
    engine-style DeepSeek-V3 module (deepseek_vllm.py, vLLM's loading) recorded with
    ferry.record_load and marked to keep its linear weights in FP8, quantised on the
    trainer."""

    def test_recorded_engine_module_with_fp8_from_the_trainer_bit_for_bit(self):
        from deepseek_vllm import DeepseekV3ForCausalLM

        # A bf16 checkpoint; the trainer keeps fp32 masters (its natives below are float32).
        cfg = dict(DEEPSEEK, torch_dtype="bfloat16")
        tp, pp, dp, ep, etp = TRAINER
        layout = megatron.GPTLayout(cfg, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
        # Ranks 0-3: ferry's built-in DeepseekV3 loader, the reference; ranks 4-7: the module.
        builtin = ferry.ModelLoader(cfg, "tp=4,ep=4,replicas=2", quantize="fp8", mtp="skip")
        modules = [DeepseekV3ForCausalLM(cfg, r, 4) for r in range(4)]
        plans = []
        for r, m in enumerate(modules):
            marks = builtin.record_plan(r).quantized_params
            plan = ferry.record_load(m, builtin.checkpoint, quantize="fp8", quantize_params=list(marks))
            self.assertEqual(plan, builtin.record_plan(r))  # the engine's own loading, the same plan class
            self.assertIn("model.layers.1.mlp.experts.w13_weight", marks)
            self.assertIn("model.layers.0.self_attn.fused_qkv_a_proj.weight", marks)
            plans.append(plan)
        states = [tied_mtp_state(cfg, seed=s) for s in (31, 32)]
        natives = [native_rank(states[0], cfg, tp, pp, dp, ep, etp, r) for r in range(layout.world_size)]
        self.assertEqual(natives[0]["decoder.layers.0.input_layernorm.weight"].dtype, torch.float32)
        with ferry.StoreServer() as server:
            common = dict(backend="inproc", job="ds-module", timeout=20.0, num_consumers=8)
            made = run_threads(
                [lambda r=r: ferry.Producer(megatron.MegatronSource(layout, natives[r], rank=r), server, in_place=True,
                                            direct_min_bytes=0, **common) for r in range(layout.world_size)] +
                [lambda r=r: ferry.Consumer(loader=builtin, rank=r, store=server, num_producers=layout.world_size,
                                            **common) for r in range(4)] +
                [lambda r=r: ferry.Consumer(plan=plans[r], params=modules[r], rank=4 + r, store=server,
                                            num_producers=layout.world_size, **common) for r in range(4)])
            producers, consumers = made[:layout.world_size], made[layout.world_size:]
            for version, hf in enumerate(states, start=1):
                received = step_and_sync(self, natives, cfg, hf, version, producers, consumers)
                for r in range(4):
                    theirs, ours = consumers[r].params(), consumers[4 + r].params()
                    self.assertEqual(sorted(theirs), sorted(ours))
                    for name, t in ours.items():
                        self.assertTrue(torch.equal(bits(t), bits(theirs[name])), (version, r, name))
                    # The module's other params are its own, as its own load_weights leaves them.
                    itself = DeepseekV3ForCausalLM(cfg, r, 4)
                    itself.load_weights(hf.items())  # the fp32 masters, converted by torch's copy_
                    marks = plans[r].quantized_params
                    for name, p in itself.named_parameters():
                        if name not in marks:
                            self.assertTrue(torch.equal(bits(dict(modules[r].named_parameters())[name]), bits(p)),
                                            (version, r, name))
                        else:
                            self.assertEqual(ours[name].dtype, getattr(torch, "float8_e4m3fn", torch.uint8), name)
                    # Quantised on the trainer: the wire carries what the rank keeps (padding aside).
                    kept = sum(bits(t).numel() for t in ours.values())
                    padding = plans[r].stats()["zero_elements"] * 2  # bf16
                    self.assertEqual(received[4 + r]["bytes_received"], kept - padding, (version, r))
            for x in made:
                x.close()


class DocsTest(unittest.TestCase):
    def test_the_docs_deepseek_example_runs(self):
        import re
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        with open(os.path.join(root, "docs", "python.md")) as f:
            section = f.read().split("### DeepSeek-V3 and Kimi-K2", 1)[1].split("\n## ", 1)[0]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        cwd = os.getcwd()
        os.chdir(root)  # its config path is the repository's
        try:
            exec(compile(code, "docs/python.md (DeepSeek)", "exec"), {"__name__": "docs_deepseek"})
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    unittest.main()
