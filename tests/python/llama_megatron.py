"""The trainer half of the real-client test: a Llama-style model with Megatron-Core's
tensor-parallel layout, in plain torch over torch.distributed (gloo).

Nothing here knows about ferry. Per TP rank it holds Megatron-Core's own tensors, under
Megatron-Core's names (Transformer Engine spec):

  * ``embedding.word_embeddings.weight`` / ``output_layer.weight``: the vocab padded to a
    multiple of ``make_vocab_size_divisible_by * tp`` (128 * 2: 1000 -> 1024) and split
    evenly (512 rows a rank; rank 1's last 24 are padding);
  * ``self_attention.linear_qkv.weight``: q, k, v fused, rows interleaved per kv group
    ``[q heads of the group, k, v]``; ``linear_proj`` row-parallel;
  * ``mlp.linear_fc1.weight``: ``[gate shard; up shard]``; ``linear_fc2`` row-parallel;
  * the norms as Transformer Engine fuses them (``linear_qkv.layer_norm_weight``,
    ``linear_fc1.layer_norm_weight``), ``decoder.final_layernorm.weight``.

The forward pass is Megatron's: column-parallel linears after an identity whose
backward all-reduces, row-parallel outputs and the embedding all-reduced, logits
all-gathered over the vocab (padding dropped). ``native_shard`` / ``hf_from_native``
convert to and from the HF checkpoint, written out independently of ferry's helpers.
"""
import torch
import torch.distributed as dist
from torch import nn

from llama_vllm import TEST_CONFIG, _attention, rms_norm  # the same model maths as the inference side

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron's default


def padded_vocab(cfg, tp):
    m = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-cfg["vocab_size"] // m) * m


def _dims(cfg):
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], hd, cfg["intermediate_size"]


def native_shard(hf, cfg, tp, r):
    """{Megatron name: tensor} of TP rank r from an HF state dict."""
    H, nh, nkv, hd, I = _dims(cfg)
    V, Vp = cfg["vocab_size"], padded_vocab(cfg, tp)
    per = Vp // tp
    qpg, groups = nh // nkv, nkv // tp

    def vocab(w):
        out = torch.zeros(per, H, dtype=w.dtype)
        n = max(0, min(per, V - r * per))
        out[:n] = w[r * per:r * per + n]
        return out

    out = {"embedding.word_embeddings.weight": vocab(hf["model.embed_tokens.weight"])}
    for i in range(cfg["num_hidden_layers"]):
        p, n = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        rows = []
        for j in range(groups):
            g = r * groups + j
            rows += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
        out[n + "self_attention.linear_qkv.weight"] = torch.cat(rows).contiguous()
        out[n + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"].clone()
        qc = nh * hd // tp
        out[n + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, r * qc:(r + 1) * qc].contiguous()
        ic = I // tp
        out[n + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][r * ic:(r + 1) * ic],
                                                      hf[p + "mlp.up_proj.weight"][r * ic:(r + 1) * ic]]).contiguous()
        out[n + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"].clone()
        out[n + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"][:, r * ic:(r + 1) * ic].contiguous()
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    out["output_layer.weight"] = vocab(hf["lm_head.weight"])
    return out


def hf_from_native(shards, cfg):
    """The HF state dict from every TP rank's {Megatron name: tensor} (rank order)."""
    tp = len(shards)
    H, nh, nkv, hd, I = _dims(cfg)
    V = cfg["vocab_size"]
    qpg, groups = nh // nkv, nkv // tp
    out = {"model.embed_tokens.weight": torch.cat([s["embedding.word_embeddings.weight"] for s in shards])[:V]}
    for i in range(cfg["num_hidden_layers"]):
        p, n = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = [], [], []
        for s in shards:
            fused = s[n + "self_attention.linear_qkv.weight"].view(groups, (qpg + 2) * hd, H)
            q.append(fused[:, :qpg * hd].reshape(-1, H))
            k.append(fused[:, qpg * hd:(qpg + 1) * hd].reshape(-1, H))
            v.append(fused[:, (qpg + 1) * hd:].reshape(-1, H))
        out[p + "self_attn.q_proj.weight"] = torch.cat(q)
        out[p + "self_attn.k_proj.weight"] = torch.cat(k)
        out[p + "self_attn.v_proj.weight"] = torch.cat(v)
        out[p + "self_attn.o_proj.weight"] = torch.cat([s[n + "self_attention.linear_proj.weight"] for s in shards], 1)
        ic = I // tp
        out[p + "mlp.gate_proj.weight"] = torch.cat([s[n + "mlp.linear_fc1.weight"][:ic] for s in shards])
        out[p + "mlp.up_proj.weight"] = torch.cat([s[n + "mlp.linear_fc1.weight"][ic:] for s in shards])
        out[p + "mlp.down_proj.weight"] = torch.cat([s[n + "mlp.linear_fc2.weight"] for s in shards], 1)
        out[p + "input_layernorm.weight"] = shards[0][n + "self_attention.linear_qkv.layer_norm_weight"]
        out[p + "post_attention_layernorm.weight"] = shards[0][n + "mlp.linear_fc1.layer_norm_weight"]
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = torch.cat([s["output_layer.weight"] for s in shards])[:V]
    return {k: t.contiguous() for k, t in out.items()}


# --- Megatron's TP communication, as autograd functions ---------------------------------

class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (before a column-parallel linear)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (after a row-parallel linear); identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.size = dist.get_rank(), dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.size, -1)[ctx.rank].contiguous()


class MegatronLlama(nn.Module):
    """TP rank ``rank`` of ``tp`` (the torch.distributed group is the TP group)."""

    def __init__(self, hf_state, cfg=TEST_CONFIG, tp=2, rank=0):
        super().__init__()
        self.cfg, self.tp, self.rank = dict(cfg), tp, rank
        # Parameters under their Megatron names ('.' is not allowed in a module's
        # parameter names, so they live in a ParameterDict keyed by the name with '/').
        self.weights = nn.ParameterDict({k.replace(".", "/"): nn.Parameter(v)
                                         for k, v in native_shard(hf_state, cfg, tp, rank).items()})

    def native(self):
        """{Megatron name: parameter} (the trainer's own tensors)."""
        return {k.replace("/", "."): p for k, p in self.weights.items()}

    def forward(self, ids):
        cfg, w = self.cfg, self.native()
        H, nh, nkv, hd, I = _dims(cfg)
        eps, tp = cfg["rms_norm_eps"], self.tp
        b, s = ids.shape
        per = padded_vocab(cfg, tp) // tp
        start = self.rank * per
        mask = (ids >= start) & (ids < start + per)
        local = torch.where(mask, ids - start, torch.zeros_like(ids))
        h = _ReduceFromTP.apply(nn.functional.embedding(local, w["embedding.word_embeddings.weight"])
                                * mask.unsqueeze(-1).to(torch.float32))
        qpg, groups = nh // nkv, nkv // tp
        for i in range(cfg["num_hidden_layers"]):
            n = f"decoder.layers.{i}."
            x = _CopyToTP.apply(rms_norm(h, w[n + "self_attention.linear_qkv.layer_norm_weight"], eps))
            qkv = (x @ w[n + "self_attention.linear_qkv.weight"].t()).view(b, s, groups, (qpg + 2) * hd)
            q = qkv[..., :qpg * hd].reshape(b, s, groups * qpg, hd)
            k = qkv[..., qpg * hd:(qpg + 1) * hd].reshape(b, s, groups, hd)
            v = qkv[..., (qpg + 1) * hd:].reshape(b, s, groups, hd)
            h = h + _ReduceFromTP.apply(_attention(q, k, v, cfg) @ w[n + "self_attention.linear_proj.weight"].t())
            x = _CopyToTP.apply(rms_norm(h, w[n + "mlp.linear_fc1.layer_norm_weight"], eps))
            gate, up = (x @ w[n + "mlp.linear_fc1.weight"].t()).chunk(2, -1)
            h = h + _ReduceFromTP.apply((nn.functional.silu(gate) * up) @ w[n + "mlp.linear_fc2.weight"].t())
        h = _CopyToTP.apply(rms_norm(h, w["decoder.final_layernorm.weight"], eps))
        logits = _GatherFromTP.apply(h @ w["output_layer.weight"].t())
        return logits[..., :cfg["vocab_size"]]

    def gather_hf(self):
        """The HF state dict of the whole model (every rank gets it): for checks only."""
        shards = [{} for _ in range(self.tp)]
        for name, p in sorted(self.native().items()):
            parts = [torch.empty_like(p.data) for _ in range(self.tp)]
            dist.all_gather(parts, p.data.contiguous())
            for r in range(self.tp):
                shards[r][name] = parts[r]
        return hf_from_native(shards, self.cfg)
