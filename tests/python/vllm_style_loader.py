"""A vLLM-style weight loader in plain torch, for the recording tests.

Nothing here knows about ferry: the same code runs on real torch tensors and on
ferry.source / ferry.param recording tensors. It mirrors what vLLM's model files do:

  * load_weights() walks (checkpoint name, tensor) pairs with a stacked_params_mapping
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and calls each parameter's weight
    loader with a shard id;
  * QKVParallelLinear: q heads sharded over TP; k/v heads sharded, or replicated when
    TP > num_kv_heads (each kv head on tp/num_kv_heads ranks);
  * MergedColumnParallelLinear (gate_up_proj), RowParallelLinear (o_proj, down_proj);
  * VocabParallelEmbedding / ParallelLMHead with the padded tail zero-filled;
  * FusedMoE with expert parallelism, from Llama-4's fused, transposed checkpoint
    tensors (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]): local
    experts picked with unbind(0), halves with chunk(2, -1), transposed into
    w13 [E_local, 2I, H] and w2 [E_local, H, I];
  * FusedMoE with tensor parallelism inside experts from a gpt-oss-style interleaved
    gate_up [E, H, 2I] (gate = [..., 0::2], up = [..., 1::2]);
  * the HF-Llama rotary "unpermute" of k_proj (view/transpose/reshape: not a view, so the
    recording keeps an element map);
  * a norm kept in fp32 from a bf16 checkpoint and a router kept in bf16 from an fp32
    checkpoint (dtype conversion in copy_).
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Config:
    hidden: int = 16
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    inter: int = 24
    vocab: int = 50
    vocab_pad_to: int = 16  # padded vocab is a multiple of this * tp
    experts: int = 8
    moe_inter: int = 8
    # one entry per layer: "dense", "moe_llama4" (EP), "moe_interleaved" (TP in experts)
    layers: list = field(default_factory=lambda: ["dense", "moe_llama4", "moe_interleaved"])
    unpermute_k: bool = True
    dtype: torch.dtype = torch.bfloat16


def padded_vocab(cfg, tp):
    m = cfg.vocab_pad_to * tp
    return (cfg.vocab + m - 1) // m * m


def checkpoint_shapes(cfg):
    """HF checkpoint tensor names -> (shape, dtype)."""
    H, hd, dt = cfg.hidden, cfg.head_dim, cfg.dtype
    out = {"model.embed_tokens.weight": ((cfg.vocab, H), dt), "lm_head.weight": ((cfg.vocab, H), dt),
           "model.norm.weight": ((H,), dt)}
    for i, kind in enumerate(cfg.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), dt)
        out[p + "self_attn.q_proj.weight"] = ((cfg.heads * hd, H), dt)
        out[p + "self_attn.k_proj.weight"] = ((cfg.kv_heads * hd, H), dt)
        out[p + "self_attn.v_proj.weight"] = ((cfg.kv_heads * hd, H), dt)
        out[p + "self_attn.o_proj.weight"] = ((H, cfg.heads * hd), dt)
        if kind == "dense":
            out[p + "mlp.gate_proj.weight"] = ((cfg.inter, H), dt)
            out[p + "mlp.up_proj.weight"] = ((cfg.inter, H), dt)
            out[p + "mlp.down_proj.weight"] = ((H, cfg.inter), dt)
        else:
            E, I = cfg.experts, cfg.moe_inter
            out[p + "mlp.router.weight"] = ((E, H), torch.float32)
            out[p + "mlp.experts.gate_up_proj"] = ((E, H, 2 * I), dt)
            out[p + "mlp.experts.down_proj"] = ((E, I, H), dt)
    return out


def param_shapes(cfg, tp_rank, tp):
    """vLLM parameter names of one TP rank -> (shape, dtype)."""
    H, hd, dt = cfg.hidden, cfg.head_dim, cfg.dtype
    q = cfg.heads // tp
    kv = max(1, cfg.kv_heads // tp)
    V = padded_vocab(cfg, tp) // tp
    out = {"model.embed_tokens.weight": ((V, H), dt), "lm_head.weight": ((V, H), dt),
           "model.norm.weight": ((H,), torch.float32)}
    for i, kind in enumerate(cfg.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), dt)
        out[p + "self_attn.qkv_proj.weight"] = (((q + 2 * kv) * hd, H), dt)
        out[p + "self_attn.o_proj.weight"] = ((H, q * hd), dt)
        if kind == "dense":
            I = cfg.inter // tp
            out[p + "mlp.gate_up_proj.weight"] = ((2 * I, H), dt)
            out[p + "mlp.down_proj.weight"] = ((H, I), dt)
        elif kind == "moe_llama4":  # expert parallel: whole experts per rank
            E, I = cfg.experts // tp, cfg.moe_inter
            out[p + "mlp.router.weight"] = ((cfg.experts, H), dt)
            out[p + "mlp.experts.w13_weight"] = ((E, 2 * I, H), dt)
            out[p + "mlp.experts.w2_weight"] = ((E, H, I), dt)
        else:  # tensor parallel inside every expert
            E, I = cfg.experts, cfg.moe_inter // tp
            out[p + "mlp.router.weight"] = ((E, H), dt)
            out[p + "mlp.experts.w13_weight"] = ((E, 2 * I, H), dt)
            out[p + "mlp.experts.w2_weight"] = ((E, H, I), dt)
    return out


class Loader:
    """The weight loaders of one TP rank, as vLLM's layers define them."""

    def __init__(self, cfg, tp_rank, tp):
        self.cfg, self.rank, self.tp = cfg, tp_rank, tp

    # --- linear layers ------------------------------------------------------------
    def replicated(self, param, w, shard_id=None):
        assert param.shape == w.shape, (param.shape, w.shape)
        param.data.copy_(w)

    def row_parallel(self, param, w, shard_id=None):
        size = param.shape[1]
        param.data.copy_(w.narrow(1, self.rank * size, size))

    def merged_column(self, param, w, shard_id):
        size = w.shape[0] // self.tp
        param.data.narrow(0, shard_id * size, size).copy_(w.narrow(0, self.rank * size, size))

    def qkv(self, param, w, shard_id):
        cfg, tp, hd = self.cfg, self.tp, self.cfg.head_dim
        q = cfg.heads // tp
        kv = max(1, cfg.kv_heads // tp)
        if shard_id == "q":
            offset, size, start = 0, q * hd, self.rank * q * hd
        else:
            replicas = max(1, tp // cfg.kv_heads)
            offset = (q + (0 if shard_id == "k" else kv)) * hd
            size = kv * hd
            start = (self.rank // replicas) * size
        param.data[offset:offset + size].copy_(w[start:start + size])

    def vocab_parallel(self, param, w, shard_id=None):
        per = param.shape[0]
        start = self.rank * per
        n = max(0, min(per, w.shape[0] - start))
        if n:
            param.data[:n].copy_(w.narrow(0, start, n))
        param.data[n:].fill_(0)  # padding rows

    # --- MoE ------------------------------------------------------------------------
    def llama4_experts(self, param, w, shard_id):
        """EP: this rank holds experts [rank*E_local, (rank+1)*E_local)."""
        e_local = param.shape[0]
        first = self.rank * e_local
        for e, expert in enumerate(w.unbind(0)):
            if not first <= e < first + e_local:
                continue
            dst = param.data[e - first]
            if shard_id == "w13":  # expert: [H, 2I] -> w13: [2I, H]
                gate, up = expert.chunk(2, dim=-1)
                I = gate.shape[-1]
                dst[:I].copy_(gate.transpose(0, 1))
                dst[I:].copy_(up.t())
            else:  # expert: [I, H] -> w2: [H, I]
                dst.copy_(expert.transpose(-1, -2))

    def interleaved_experts(self, param, w, shard_id):
        """TP inside experts, from an interleaved gate_up [E, H, 2I]."""
        I = param.shape[1] // 2 if shard_id == "w13" else param.shape[2]
        if shard_id == "w13":
            gate = w[..., 0::2].narrow(-1, self.rank * I, I)  # [E, H, I]
            up = w[:, :, 1::2].narrow(2, self.rank * I, I)
            param.data[:, :I, :].copy_(gate.permute(0, 2, 1))
            param.data[:, I:].copy_(up.transpose(1, 2))
        else:  # [E, I_full, H] -> [E, H, I]
            param.data.copy_(w.narrow(1, self.rank * I, I).transpose(1, 2))

    # --- model ------------------------------------------------------------------------
    def load_weights(self, params, weights):
        """params: {vLLM name: tensor}; weights: iterable of (HF name, tensor)."""
        stacked_params_mapping = [
            ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
        ]
        loaded = set()
        for name, w in weights:
            if self.cfg.unpermute_k and name.endswith("k_proj.weight"):
                # HF Llama's rotary permutation, undone: rows (heads, 2, hd/2) -> (heads, hd/2, 2).
                n, H = w.shape
                hd = self.cfg.head_dim
                w = w.view(n // hd, 2, hd // 2, H).transpose(1, 2).reshape(n, H)
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name or "mlp.experts." in name:
                    continue
                target = name.replace(weight_name, param_name)
                loader = self.qkv if param_name == "qkv_proj" else self.merged_column
                loader(params[target], w, shard_id)
                loaded.add(target)
                break
            else:
                if "experts.gate_up_proj" in name or "experts.down_proj" in name:
                    layer = int(name.split(".")[2])
                    shard_id = "w13" if "gate_up" in name else "w2"
                    target = name.replace("gate_up_proj", "w13_weight").replace("down_proj", "w2_weight")
                    if self.cfg.layers[layer] == "moe_llama4":
                        self.llama4_experts(params[target], w, shard_id)
                    else:
                        self.interleaved_experts(params[target], w, shard_id)
                elif "embed_tokens" in name or "lm_head" in name:
                    target = name
                    self.vocab_parallel(params[name], w)
                elif "o_proj" in name or "down_proj" in name:
                    target = name
                    self.row_parallel(params[name], w)
                else:
                    target = name
                    self.replicated(params[name], w)
                loaded.add(target)
        return loaded
