"""Integrate with your stack: a Megatron-Core MoE trainer (docs/python.md, "Integrate with
your stack"), for the two MoE shapes RL jobs train most:

  * a Qwen3-MoE (grouped query attention, routed experts, a dense layer), trainer
    tp=2, dp=2, ep=2 (4 ranks), into a vLLM-style engine of tp=2;
  * a DeepSeek-V3 / Kimi-K2 (multi-latent attention, a dense first layer, routed and
    shared experts, the router's fp32 score-correction bias, an MTP layer), the same
    trainer layout, into a vLLM-style engine of tp=2 that loads the MTP layer as its
    draft.

Each trainer rank holds Megatron-Core's own tensors (fused ``linear_qkv``, MLA's down and
up projections, TE's grouped ``linear_fc1.weight{j}`` experts, a vocab padded to 128 x tp),
as a checkpoint converter leaves them. ``ferry.megatron.GPTLayout`` says which HF boxes
each rank's tensors hold and ``MegatronSource`` serves views of them, no copies: no
hand-written holdings, no gather on the trainer. The engine uses ferry's built-in loaders
(a vLLM-style engine would pass its own ``record_load`` plan: vllm_worker.py).

Run as is: every rank a thread of this process over the in-process transport, two
training steps per shape, each synced and checked bit for bit against the engine's loader
on the full HF checkpoint. In a real job: one process per rank, ``backend="ucx"``, and
``MegatronSource(layout, model)`` over your ``GPTModel``."""
import threading

import torch

import ferry
from ferry import megatron

QWEN3_MOE = {  # Qwen3-30B-A3B's shape, small
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
    "mlp_only_layers": [1], "decoder_sparse_step": 1, "vocab_size": 300, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
DEEPSEEK_V3 = {  # DeepSeek-V3 / Kimi-K2's shape, small
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "topk_method": "noaux_tc", "vocab_size": 300, "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
}
TP, DP, EP, ENGINE_TP = 2, 2, 2, 2


def megatron_rank(hf, cfg, rank):
    """{Megatron-Core name: tensor} of trainer rank ``rank`` (tp=TP, dp=DP, ep=EP, etp=1,
    pp=1, TE grouped experts): what an HF -> Megatron checkpoint converter gives that rank.
    Megatron-Core lays the expert grid over the tp*dp ranks of a stage, etp fastest."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    t, e_rank = rank % TP, rank % (TP * DP) % EP
    E = cfg.get("num_experts") or cfg["n_routed_experts"]
    El, Im, I = E // EP, cfg["moe_intermediate_size"], cfg["intermediate_size"]
    V, Vp = cfg["vocab_size"], -(-cfg["vocab_size"] // (128 * TP)) * 128 * TP
    per = Vp // TP

    def rows(w, n):  # TP rank t's n rows
        return w[t * n:(t + 1) * n].clone()

    def cols(w, n):  # TP rank t's n columns
        return w[:, t * n:(t + 1) * n].clone()

    def vocab(w):
        out = torch.zeros(per, H)
        n = max(0, min(per, V - t * per))
        out[:n] = w[t * per:t * per + n]
        return out

    def attention(p, n, out):
        a = p + "self_attn."
        if cfg.get("kv_lora_rank"):  # MLA: down projections whole, up projections by heads
            h, qk = cfg["num_attention_heads"] // TP, cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            out[n + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"].clone()
            out[n + "self_attention.linear_q_down_proj.weight"] = hf[a + "q_a_proj.weight"].clone()
            out[n + "self_attention.linear_q_up_proj.layer_norm_weight"] = hf[a + "q_a_layernorm.weight"].clone()
            out[n + "self_attention.linear_q_up_proj.weight"] = rows(hf[a + "q_b_proj.weight"], h * qk)
            out[n + "self_attention.linear_kv_down_proj.weight"] = hf[a + "kv_a_proj_with_mqa.weight"].clone()
            out[n + "self_attention.linear_kv_up_proj.layer_norm_weight"] = hf[a + "kv_a_layernorm.weight"].clone()
            out[n + "self_attention.linear_kv_up_proj.weight"] = rows(
                hf[a + "kv_b_proj.weight"], h * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]))
            out[n + "self_attention.linear_proj.weight"] = cols(hf[a + "o_proj.weight"], h * cfg["v_head_dim"])
            return
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        q, k, v = (hf[a + f"{c}_proj.weight"] for c in "qkv")
        qkv = []
        for g in range(t * nkv // TP, (t + 1) * nkv // TP):  # per kv group: its q heads, k, v
            qkv += [q[g * nh // nkv * hd:(g + 1) * nh // nkv * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
        out[n + "self_attention.linear_qkv.weight"] = torch.cat(qkv)
        out[n + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"].clone()
        out[n + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"].clone()
        out[n + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"].clone()
        out[n + "self_attention.linear_proj.weight"] = cols(hf[a + "o_proj.weight"], nh * hd // TP)

    def mlp(i, p, n, out):
        m = p + "mlp."
        dense = i < cfg.get("first_k_dense_replace", 0) or i in cfg.get("mlp_only_layers", [])
        if dense:
            ic = I // TP
            out[n + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"].clone()
            out[n + "mlp.linear_fc1.weight"] = torch.cat([rows(hf[m + "gate_proj.weight"], ic),
                                                          rows(hf[m + "up_proj.weight"], ic)])
            out[n + "mlp.linear_fc2.weight"] = cols(hf[m + "down_proj.weight"], ic)
            return
        out[n + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[n + "mlp.router.weight"] = hf[m + "gate.weight"].clone()
        if cfg.get("topk_method") == "noaux_tc":  # an fp32 buffer in Megatron-Core
            out[n + "mlp.router.expert_bias"] = hf[m + "gate.e_score_correction_bias"].float().clone()
        for j in range(El):  # this EP rank's experts, whole (etp=1)
            ex = m + f"experts.{e_rank * El + j}."
            out[n + f"mlp.experts.linear_fc1.weight{j}"] = torch.cat([hf[ex + "gate_proj.weight"],
                                                                       hf[ex + "up_proj.weight"]])
            out[n + f"mlp.experts.linear_fc2.weight{j}"] = hf[ex + "down_proj.weight"].clone()
        if cfg.get("n_shared_experts"):  # one MLP, TP split like a dense one
            sc = cfg["n_shared_experts"] * Im // TP
            out[n + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [rows(hf[m + "shared_experts.gate_proj.weight"], sc), rows(hf[m + "shared_experts.up_proj.weight"], sc)])
            out[n + "mlp.shared_experts.linear_fc2.weight"] = cols(hf[m + "shared_experts.down_proj.weight"], sc)

    out = {"embedding.word_embeddings.weight": vocab(hf["model.embed_tokens.weight"])}
    for i in range(L):
        attention(f"model.layers.{i}.", f"decoder.layers.{i}.", out)
        mlp(i, f"model.layers.{i}.", f"decoder.layers.{i}.", out)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    if cfg.get("num_nextn_predict_layers"):  # the MTP layer; it shares the embedding and output layer
        p, n = f"model.layers.{L}.", "mtp.layers.0."
        out[n + "enorm.weight"] = hf[p + "enorm.weight"].clone()
        out[n + "hnorm.weight"] = hf[p + "hnorm.weight"].clone()
        out[n + "eh_proj.weight"] = rows(hf[p + "eh_proj.weight"], H // TP)
        out[n + "final_layernorm.weight"] = hf[p + "shared_head.norm.weight"].clone()
        attention(p, n + "transformer_layer.", out)
        mlp(L, p, n + "transformer_layer.", out)
    return out


def hf_checkpoint(cfg, loader):
    gen = torch.Generator().manual_seed(0)
    hf = {}
    for name, d in loader.checkpoint.items():
        x = torch.randn(tuple(d.shape), generator=gen)
        hf[name] = 1.0 + 0.1 * x if len(d.shape) == 1 else 0.02 * x
    L = cfg["num_hidden_layers"]
    if cfg.get("num_nextn_predict_layers"):  # Megatron's MTP layer has no embedding or head of its own
        hf[f"model.layers.{L}.embed_tokens.weight"] = hf["model.embed_tokens.weight"]
        hf[f"model.layers.{L}.shared_head.head.weight"] = hf["lm_head.weight"]
    return hf


def run_threads(fns):
    out, errors = [None] * len(fns), []

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def train_and_sync(server, name, cfg, mtp):
    loader = ferry.ModelLoader(cfg, f"tp={ENGINE_TP}", mtp=mtp)
    hf = hf_checkpoint(cfg, loader)
    layout = megatron.GPTLayout(cfg, tp=TP, dp=DP, ep=EP, etp=1)
    natives = [megatron_rank(hf, cfg, r) for r in range(layout.world_size)]
    common = dict(backend="inproc", job=f"megatron-{name}", timeout=20.0)
    made = run_threads(
        [lambda r=r: ferry.Producer(megatron.MegatronSource(layout, natives[r], rank=r), server,
                                    num_consumers=ENGINE_TP, **common) for r in range(layout.world_size)] +
        [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=layout.world_size, **common)
         for r in range(ENGINE_TP)])
    trainers, engines = made[:layout.world_size], made[layout.world_size:]
    for step in (1, 2):
        with torch.no_grad():  # the optimizer step, in place on every rank's own tensors
            for native in natives:
                for t in native.values():
                    t.mul_(1.0 + 0.01 * step)
            for n, t in hf.items():  # (the reference: the same step on the HF tensors)
                if n.endswith((".embed_tokens.weight", ".shared_head.head.weight")) and n.startswith("model.layers."):
                    continue  # (the MTP layer's: the embedding and head themselves, stepped once)
                t.mul_(1.0 + 0.01 * step)
        reports = run_threads([lambda p=p: p.sync(step) for p in trainers] + [lambda c=c: c.sync(step) for c in engines])
        assert all(r["ok"] for r in reports), [r["text"] for r in reports]
        for r, engine in enumerate(engines):
            expect = {n: torch.zeros(tuple(d.shape), dtype=torch.float32) for n, d in loader.params(r).items()}
            loader.record_plan(r).replay(hf, expect)
            got = engine.params()
            for n, t in expect.items():
                assert torch.equal(torch.as_tensor(got[n]), t), (name, step, r, n)
        sent = sum(r["bytes_sent"] for r in reports[:layout.world_size])
        print(f"{name} step {step}: {layout.world_size} Megatron ranks ({layout.trainer_layout}) -> "
              f"{ENGINE_TP} engine ranks, {sent} bytes, {len(expect)} params per rank verified")
    for x in trainers + engines:
        x.close()


def main():
    with ferry.StoreServer() as server:
        train_and_sync(server, "qwen3-moe", QWEN3_MOE, mtp="none")
        train_and_sync(server, "deepseek-v3", DEEPSEEK_V3, mtp="draft")
    print("ok")


if __name__ == "__main__":
    main()
