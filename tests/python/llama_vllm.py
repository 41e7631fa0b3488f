"""The inference half of the real-client test: a Llama-style nn.Module loaded as vLLM loads.

Nothing here knows about ferry. It mirrors vLLM's layers and LlamaForCausalLM:

  * VocabParallelEmbedding / ParallelLMHead: vocab padded to a multiple of 64
    (DEFAULT_VOCAB_PADDING_SIZE), split evenly over TP; each rank copies its rows of the
    checkpoint and zero-fills the padded tail (``param[:n].data.copy_``, ``.fill_(0)``);
  * QKVParallelLinear (q/k/v -> qkv_proj, GQA: kv heads sharded, or replicated when
    tp > kv heads), MergedColumnParallelLinear (gate/up -> gate_up_proj),
    RowParallelLinear (o_proj, down_proj): per-parameter ``weight_loader`` and
    ``output_dim`` / ``input_dim`` attributes set on the Parameters;
  * RMSNorm with default_weight_loader; an untied lm_head;
  * ``load_weights(weights)`` with vLLM's ``stacked_params_mapping``, over
    ``dict(self.named_parameters())``.

``forward(input_ids)`` gives logits for tp == 1; ``tp_forward(modules, input_ids)`` runs
the ranks' shards of a tp > 1 layout in one process (the all-reduce and all-gather done
by summing / concatenating), as vLLM computes; ``hf_forward(state_dict, ...)`` is the
same model over an unsharded HF state dict (what a trainer computes).
"""
import math

import torch
from torch import nn

# The real-client test's model (the trainer half uses the same).
TEST_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,  # not a multiple of 64
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _dtype(cfg):
    return getattr(torch, cfg.get("torch_dtype", "float32"))


def _head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def padded_vocab(cfg):
    return -(-cfg["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING


def hf_shapes(cfg):
    """The HF checkpoint: {name: (shape, dtype)}."""
    H, V, I, dt = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], _dtype(cfg)
    hd, nh, nkv = _head_dim(cfg), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {"model.embed_tokens.weight": ((V, H), dt)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = ((nh * hd, H), dt)
        out[p + "self_attn.k_proj.weight"] = ((nkv * hd, H), dt)
        out[p + "self_attn.v_proj.weight"] = ((nkv * hd, H), dt)
        out[p + "self_attn.o_proj.weight"] = ((H, nh * hd), dt)
        out[p + "mlp.gate_proj.weight"] = ((I, H), dt)
        out[p + "mlp.up_proj.weight"] = ((I, H), dt)
        out[p + "mlp.down_proj.weight"] = ((H, I), dt)
        out[p + "input_layernorm.weight"] = ((H,), dt)
        out[p + "post_attention_layernorm.weight"] = ((H,), dt)
    out["model.norm.weight"] = ((H,), dt)
    out["lm_head.weight"] = ((V, H), dt)
    return out


def random_hf_state(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dt) in hf_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=torch.float32) * (0.02 if len(shape) == 2 else 1.0)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t  # norm weights near 1
        out[name] = t.to(dt)
    return out


# ---------------------------------------------------------------------------------------
# vLLM's parallel layers (their weight-loading parts, and a forward per shard)

def default_weight_loader(param, loaded_weight):
    assert param.size() == loaded_weight.size(), (param.size(), loaded_weight.size())
    param.data.copy_(loaded_weight)


def _set_weight_attrs(param, attrs):
    for k, v in attrs.items():
        assert not hasattr(param, k), k
        setattr(param, k, v)


class _Parallel(nn.Module):
    def __init__(self, tp_rank, tp_size):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size


class VocabParallelEmbedding(_Parallel):
    def __init__(self, num_embeddings, embedding_dim, tp_rank, tp_size, dtype):
        super().__init__(tp_rank, tp_size)
        self.org_vocab_size = num_embeddings
        padded = -(-num_embeddings // VOCAB_PADDING) * VOCAB_PADDING
        assert padded % tp_size == 0, (padded, tp_size)
        self.per_partition = padded // tp_size
        self.vocab_start = tp_rank * self.per_partition
        self.org_vocab_end = min(self.vocab_start + self.per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim, dtype=dtype), requires_grad=False)
        _set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0})

    def weight_loader(self, param, loaded_weight):
        output_dim = getattr(param, "output_dim", None)
        start = self.vocab_start
        shard = max(0, self.org_vocab_end - start)
        loaded_weight = loaded_weight.narrow(output_dim, start, shard)
        param[:loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)

    def forward_partial(self, ids):
        """This rank's share of the embedding (zeros for ids outside its range)."""
        mask = (ids >= self.vocab_start) & (ids < self.org_vocab_end)
        local = torch.where(mask, ids - self.vocab_start, torch.zeros_like(ids))
        return nn.functional.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    def logits_partial(self, h):
        return h @ self.weight.t()  # [.., per_partition] (padding rows are zero)


class ColumnParallelLinear(_Parallel):
    def __init__(self, input_size, output_size, tp_rank, tp_size, dtype):
        super().__init__(tp_rank, tp_size)
        assert output_size % tp_size == 0
        self.weight = nn.Parameter(torch.empty(output_size // tp_size, input_size, dtype=dtype), requires_grad=False)
        _set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0, "input_dim": 1})

    def weight_loader(self, param, loaded_weight):
        output_dim = getattr(param, "output_dim", None)
        param_data = param.data
        shard_size = param_data.shape[output_dim]
        loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size, output_sizes, tp_rank, tp_size, dtype):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), tp_rank, tp_size, dtype)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        param_data = param.data
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param_data.narrow(output_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, tp_rank, tp_size, dtype):
        self.head_size = head_size
        self.num_heads = total_num_heads // tp_size
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = total_num_kv_heads // tp_size
            self.num_kv_head_replicas = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, out, tp_rank, tp_size, dtype)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        param_data = param.data
        hd = self.head_size
        if loaded_shard_id == "q":
            shard_offset, shard_size = 0, self.num_heads * hd
        elif loaded_shard_id == "k":
            shard_offset, shard_size = self.num_heads * hd, self.num_kv_heads * hd
        else:
            shard_offset, shard_size = (self.num_heads + self.num_kv_heads) * hd, self.num_kv_heads * hd
        param_data = param_data.narrow(output_dim, shard_offset, shard_size)
        shard_id = self.tp_rank if loaded_shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        loaded_weight = loaded_weight.narrow(output_dim, shard_id * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)


class RowParallelLinear(_Parallel):
    def __init__(self, input_size, output_size, tp_rank, tp_size, dtype):
        super().__init__(tp_rank, tp_size)
        assert input_size % tp_size == 0
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp_size, dtype=dtype), requires_grad=False)
        _set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0, "input_dim": 1})

    def weight_loader(self, param, loaded_weight):
        input_dim = getattr(param, "input_dim", None)
        param_data = param.data
        shard_size = param_data.shape[input_dim]
        loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * shard_size, shard_size)
        assert param_data.shape == loaded_weight.shape
        param_data.copy_(loaded_weight)

    def forward_partial(self, x):
        """Before the all-reduce."""
        return nn.functional.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps, dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------------------------------
# The model

class LlamaAttention(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size):
        super().__init__()
        H, hd, dt = cfg["hidden_size"], _head_dim(cfg), _dtype(cfg)
        self.qkv_proj = QKVParallelLinear(H, hd, cfg["num_attention_heads"], cfg["num_key_value_heads"], tp_rank,
                                          tp_size, dt)
        self.o_proj = RowParallelLinear(cfg["num_attention_heads"] * hd, H, tp_rank, tp_size, dt)


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size):
        super().__init__()
        H, I, dt = cfg["hidden_size"], cfg["intermediate_size"], _dtype(cfg)
        self.gate_up_proj = MergedColumnParallelLinear(H, [I, I], tp_rank, tp_size, dt)
        self.down_proj = RowParallelLinear(I, H, tp_rank, tp_size, dt)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size):
        super().__init__()
        H, eps, dt = cfg["hidden_size"], cfg["rms_norm_eps"], _dtype(cfg)
        self.self_attn = LlamaAttention(cfg, tp_rank, tp_size)
        self.mlp = LlamaMLP(cfg, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(H, eps, dt)
        self.post_attention_layernorm = RMSNorm(H, eps, dt)


class LlamaModel(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size):
        super().__init__()
        dt = _dtype(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp_rank, tp_size, dt)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp_rank, tp_size) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dt)


class LlamaForCausalLM(nn.Module):
    """One TP rank of the inference engine's model (vLLM's parameter names)."""

    def __init__(self, cfg=TEST_CONFIG, tp_rank=0, tp_size=1):
        super().__init__()
        self.cfg, self.tp_rank, self.tp_size = dict(cfg), tp_rank, tp_size
        self.model = LlamaModel(cfg, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp_rank, tp_size, _dtype(cfg))

    def load_weights(self, weights):
        """vLLM's LlamaForCausalLM.load_weights: (HF name, tensor) pairs."""
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]
        params_dict = dict(self.named_parameters())
        loaded_params = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                weight_loader = param.weight_loader
                weight_loader(param, loaded_weight, shard_id)
                break
            else:
                param = params_dict[name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
            loaded_params.add(name)
        return loaded_params

    def forward(self, input_ids):
        """Logits [batch, seq, vocab] (tp == 1; see tp_forward for tp > 1)."""
        if self.tp_size != 1:
            raise ValueError("forward: this is one rank of a tp > 1 layout; use tp_forward(ranks, input_ids)")
        return tp_forward([self], input_ids)


# ---------------------------------------------------------------------------------------
# Forward passes

def rms_norm(x, weight, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def _rope(x, theta):
    """HF Llama / vLLM neox-style rotary embedding; x: [batch, heads, seq, head_dim]."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _attention(q, k, v, cfg):
    """q: [b, s, nh, hd], k/v: [b, s, nkv, hd] -> [b, s, nh * hd] (causal, GQA)."""
    hd = q.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = _rope(q, cfg.get("rope_theta", 10000.0)), _rope(k, cfg.get("rope_theta", 10000.0))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], s, -1)


def hf_forward(state, input_ids, cfg=TEST_CONFIG):
    """Logits [batch, seq, vocab] of the model over an unsharded HF state dict."""
    hd, nh, nkv, eps = _head_dim(cfg), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    b, s = input_ids.shape
    h = nn.functional.embedding(input_ids, state["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, state[p + "input_layernorm.weight"], eps)
        q = (x @ state[p + "self_attn.q_proj.weight"].t()).view(b, s, nh, hd)
        k = (x @ state[p + "self_attn.k_proj.weight"].t()).view(b, s, nkv, hd)
        v = (x @ state[p + "self_attn.v_proj.weight"].t()).view(b, s, nkv, hd)
        h = h + _attention(q, k, v, cfg) @ state[p + "self_attn.o_proj.weight"].t()
        x = rms_norm(h, state[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ state[p + "mlp.gate_proj.weight"].t(), x @ state[p + "mlp.up_proj.weight"].t()
        h = h + (nn.functional.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].t()
    h = rms_norm(h, state["model.norm.weight"], eps)
    return h @ state["lm_head.weight"].t()


def tp_forward(ranks, input_ids):
    """Logits [batch, seq, vocab] from the modules of every rank of one TP group (in rank
    order), as vLLM runs them: each rank computes with its own shard; row-parallel outputs
    and the embedding are summed (the all-reduce), lm_head shards concatenated (the
    all-gather) and the vocab padding dropped."""
    cfg = ranks[0].cfg
    b, s = input_ids.shape
    hd, eps = _head_dim(cfg), cfg["rms_norm_eps"]
    with torch.no_grad():
        h = sum(r.model.embed_tokens.forward_partial(input_ids) for r in ranks)
        for i in range(cfg["num_hidden_layers"]):
            x = ranks[0].model.layers[i].input_layernorm(h)
            attn = 0
            for r in ranks:
                layer = r.model.layers[i]
                qkv = layer.self_attn.qkv_proj
                q_size, kv_size = qkv.num_heads * hd, qkv.num_kv_heads * hd
                q, k, v = qkv(x).split([q_size, kv_size, kv_size], dim=-1)
                out = _attention(q.reshape(b, s, -1, hd), k.reshape(b, s, -1, hd), v.reshape(b, s, -1, hd), cfg)
                attn = attn + layer.self_attn.o_proj.forward_partial(out)
            h = h + attn
            x = ranks[0].model.layers[i].post_attention_layernorm(h)
            mlp = 0
            for r in ranks:
                layer = r.model.layers[i]
                gate, up = layer.mlp.gate_up_proj(x).chunk(2, dim=-1)
                mlp = mlp + layer.mlp.down_proj.forward_partial(nn.functional.silu(gate) * up)
            h = h + mlp
        h = ranks[0].model.norm(h)
        logits = torch.cat([r.lm_head.logits_partial(h) for r in ranks], dim=-1)
    return logits[..., : cfg["vocab_size"]]
