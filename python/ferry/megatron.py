"""Megatron-Core's own tensors as ferry boxes (``ferry.megatron``; needs the engine).

A Megatron-Core GPT model (Llama, Qwen2/3 without biases, Mistral: dense, RMSNorm,
gated MLP) keeps its weights in its own layout: the vocabulary padded to a multiple of
``make_vocab_size_divisible_by * tp`` and split evenly over TP; q, k and v fused into one
``linear_qkv`` whose rows are, per TP rank and per kv group, ``[q heads of the group, k,
v]``; gate and up fused into ``linear_fc1`` (``[gate shard; up shard]`` per rank); the
norms inside the following linear (Transformer Engine's ``layer_norm_weight``) or apart.

``GPTLayout`` maps every HF tensor of such a model to the boxes each rank holds and to
*views* of the rank's native tensors (no copy): a row range of ``linear_qkv`` for the q
rows of a kv group, a half of ``linear_fc1``, the unpadded rows of the vocab shard
(padded rows are never sent), the whole ``linear_proj`` / ``linear_fc2`` shard for the
column range of ``o_proj`` / ``down_proj``. ``MegatronSource`` is the WeightSource over
them; with ``ferry.Producer(..., in_place=True)`` consumers read those views straight
from the trainer's parameters.

Ranks follow Megatron's order (tp fastest, then dp, then pp); layers split evenly over
PP stages; ``decoder.layers.{i}`` in native names is the stage-local index (what
``named_parameters()`` gives).
"""
from ._engine import WeightSource
from .errors import InvalidArgumentError, NotFoundError


def padded_vocab_size(vocab_size, tp=1, make_vocab_size_divisible_by=128):
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tp`` (1000 -> 1024 with 128 and tp=2: 512 rows a rank)."""
    multiple = int(make_vocab_size_divisible_by) * int(tp)
    if multiple <= 0:
        raise InvalidArgumentError(f"padded_vocab_size: make_vocab_size_divisible_by {make_vocab_size_divisible_by} "
                                   f"times tp {tp} must be positive")
    return -(-int(vocab_size) // multiple) * multiple


def vocab_rows(vocab_size, padded_vocab, tp, tp_rank):
    """(HF start row, rows) of TP rank ``tp_rank``'s vocab shard that are real tokens:
    Megatron gives each rank ``padded_vocab // tp`` rows; the padding is never sent."""
    per = padded_vocab // tp
    start = tp_rank * per
    return start, max(0, min(per, vocab_size - start))


def qkv_rows(num_heads, num_kv_heads, head_dim, tp, tp_rank):
    """Where the HF q/k/v rows of TP rank ``tp_rank`` lie in its fused ``linear_qkv``:
    ``{"q": [(hf_row, native_row, rows)], "k": [...], "v": [...]}``, one entry per kv
    group of the rank (Megatron's interleaved order: per group q heads, then k, then v)."""
    if num_kv_heads % tp:
        raise InvalidArgumentError(f"linear_qkv: tp {tp} does not divide num_key_value_heads {num_kv_heads} "
                                   "(Megatron-Core needs num_query_groups % tp == 0)")
    if num_heads % num_kv_heads:
        raise InvalidArgumentError(f"linear_qkv: num_key_value_heads {num_kv_heads} does not divide "
                                   f"num_attention_heads {num_heads}")
    q_per_group = num_heads // num_kv_heads
    group_rows = (q_per_group + 2) * head_dim
    groups = num_kv_heads // tp
    out = {"q": [], "k": [], "v": []}
    for j in range(groups):
        g = tp_rank * groups + j  # the global kv group
        base = j * group_rows
        out["q"].append((g * q_per_group * head_dim, base, q_per_group * head_dim))
        out["k"].append((g * head_dim, base + q_per_group * head_dim, head_dim))
        out["v"].append((g * head_dim, base + (q_per_group + 1) * head_dim, head_dim))
    return out


class GPTLayout:
    """How a Megatron-Core GPT trainer of ``tp * pp * dp`` ranks holds an HF model.

    ``hf_config``: the HF config dict (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, num_hidden_layers, vocab_size,
    tie_word_embeddings). ``qk_layernorm``: the model has q/k norms (Qwen3)."""

    def __init__(self, hf_config, tp=1, pp=1, dp=1, make_vocab_size_divisible_by=128, qk_layernorm=None):
        c = hf_config
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise InvalidArgumentError("GPTLayout: biases are not supported yet (attention_bias / mlp_bias)")
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.intermediate = int(c["intermediate_size"])
        self.layers = int(c["num_hidden_layers"])
        self.vocab = int(c["vocab_size"])
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.qk_layernorm = bool(c.get("model_type") == "qwen3" if qk_layernorm is None else qk_layernorm)
        self.tp, self.pp, self.dp = int(tp), int(pp), int(dp)
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, make_vocab_size_divisible_by)
        for what, n in (("num_attention_heads", self.heads), ("intermediate_size", self.intermediate)):
            if n % self.tp:
                raise InvalidArgumentError(f"GPTLayout: tp {self.tp} does not divide {what} {n}")
        if self.layers < self.pp:
            raise InvalidArgumentError(f"GPTLayout: pp {self.pp} exceeds num_hidden_layers {self.layers}")
        qkv_rows(self.heads, self.kv_heads, self.head_dim, self.tp, 0)  # checks the head counts
        self._by_name = {}  # rank -> {HF name: its pieces}

    @property
    def world_size(self):
        return self.tp * self.pp * self.dp

    def coords(self, rank):
        """(pp stage, dp index, tp rank) of global ``rank`` (Megatron's order)."""
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"GPTLayout: rank {rank} outside {self.world_size} ranks "
                                       f"(tp={self.tp}, pp={self.pp}, dp={self.dp})")
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp

    def stage_layers(self, stage):
        """The global layer indices of PP stage ``stage`` (contiguous, earlier stages take the remainder)."""
        per, extra = divmod(self.layers, self.pp)
        start = stage * per + min(stage, extra)
        return range(start, start + per + (1 if stage < extra else 0))

    def metadata(self, dtype):
        """{HF name: (shape, dtype)} of the model (unpadded vocab)."""
        H, q, kv, I = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        m = {"model.embed_tokens.weight": ((self.vocab, H), dtype)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = ((H,), dtype)
            m[p + "self_attn.q_proj.weight"] = ((q, H), dtype)
            m[p + "self_attn.k_proj.weight"] = ((kv, H), dtype)
            m[p + "self_attn.v_proj.weight"] = ((kv, H), dtype)
            if self.qk_layernorm:
                m[p + "self_attn.q_norm.weight"] = ((self.head_dim,), dtype)
                m[p + "self_attn.k_norm.weight"] = ((self.head_dim,), dtype)
            m[p + "self_attn.o_proj.weight"] = ((H, q), dtype)
            m[p + "post_attention_layernorm.weight"] = ((H,), dtype)
            m[p + "mlp.gate_proj.weight"] = ((I, H), dtype)
            m[p + "mlp.up_proj.weight"] = ((I, H), dtype)
            m[p + "mlp.down_proj.weight"] = ((H, I), dtype)
        m["model.norm.weight"] = ((H,), dtype)
        if not self.tied:
            m["lm_head.weight"] = ((self.vocab, H), dtype)
        return m

    def _pieces(self, rank):
        """[(HF name, start, size, native name, native row, rows)] of ``rank``: each box
        and the rows of the native tensor that hold it (None: the whole native tensor)."""
        stage, _, r = self.coords(rank)
        H, hd, I = self.hidden, self.head_dim, self.intermediate
        q_cols, i_cols = self.heads * hd // self.tp, I // self.tp
        out = []

        def vocab_piece(hf, native):
            start, n = vocab_rows(self.vocab, self.padded_vocab, self.tp, r)
            if n:
                out.append((hf, (start, 0), (n, H), native, 0, n))

        if stage == 0:
            vocab_piece("model.embed_tokens.weight", "embedding.word_embeddings.weight")
        rows = qkv_rows(self.heads, self.kv_heads, hd, self.tp, r)
        first = self.stage_layers(stage).start
        for i in self.stage_layers(stage):
            p, n = f"model.layers.{i}.", f"decoder.layers.{i - first}."
            qkv = n + "self_attention.linear_qkv.weight"
            out.append((p + "input_layernorm.weight", (0,), (H,), n + "self_attention.linear_qkv.layer_norm_weight", None,
                        None))
            for part in ("q", "k", "v"):
                for hf_row, native_row, count in rows[part]:
                    out.append((p + f"self_attn.{part}_proj.weight", (hf_row, 0), (count, H), qkv, native_row, count))
            if self.qk_layernorm:
                out.append((p + "self_attn.q_norm.weight", (0,), (hd,), n + "self_attention.q_layernorm.weight", None,
                            None))
                out.append((p + "self_attn.k_norm.weight", (0,), (hd,), n + "self_attention.k_layernorm.weight", None,
                            None))
            out.append((p + "self_attn.o_proj.weight", (0, r * q_cols), (H, q_cols),
                        n + "self_attention.linear_proj.weight", None, None))
            out.append((p + "post_attention_layernorm.weight", (0,), (H,), n + "mlp.linear_fc1.layer_norm_weight", None,
                        None))
            fc1 = n + "mlp.linear_fc1.weight"
            out.append((p + "mlp.gate_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, 0, i_cols))
            out.append((p + "mlp.up_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, i_cols, i_cols))
            out.append((p + "mlp.down_proj.weight", (0, r * i_cols), (H, i_cols), n + "mlp.linear_fc2.weight", None,
                        None))
        if stage == self.pp - 1:
            out.append(("model.norm.weight", (0,), (H,), "decoder.final_layernorm.weight", None, None))
            if not self.tied:
                vocab_piece("lm_head.weight", "output_layer.weight")
        return out

    def holdings(self, rank):
        """[(HF name, start, size)]: the boxes ``rank`` holds (for ``WeightSource.holdings``)."""
        return [(hf, start, size) for hf, start, size, _, _, _ in self._pieces(rank)]

    def views(self, rank, native, names=None):
        """{HF name: view} of ``rank``'s native tensors (``native``: Megatron name ->
        tensor, e.g. ``dict(model.named_parameters())``); a list of views where the rank
        holds several boxes of a tensor (one per kv group). ``names``: only these HF
        names. Norms are looked up under Transformer Engine's fused names
        (``linear_qkv.layer_norm_weight``) and the local spec's (``input_layernorm.weight``)."""
        by_name = self._by_name.get(rank)
        if by_name is None:
            by_name = {}
            for piece in self._pieces(rank):
                by_name.setdefault(piece[0], []).append(piece)
            self._by_name[rank] = by_name
        out = {}
        pieces = by_name.values() if names is None else [by_name[n] for n in names if n in by_name]
        for hf, _, size, nat, row, rows in (p for ps in pieces for p in ps):
            t = _native(native, nat)
            if tuple(t.shape[1:]) != tuple(size[1:]) and row is not None:
                raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' has shape {tuple(t.shape)}, "
                                           f"expected rows of {tuple(size[1:])} for '{hf}'")
            v = t if row is None else t[row:row + rows]
            if tuple(v.shape) != tuple(size):
                raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' gives {tuple(v.shape)} for '{hf}', "
                                           f"whose box is {tuple(size)}")
            v = v.detach() if hasattr(v, "detach") else v
            if hf in out:
                out[hf] = (out[hf] if isinstance(out[hf], list) else [out[hf]]) + [v]
            else:
                out[hf] = v
        return out


# Transformer Engine fuses the norms into the following linear; the local spec keeps them apart.
_NORM_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _native(native, name):
    if name in native:
        return native[name]
    for fused, apart in _NORM_ALIASES.items():
        if name.endswith(fused):
            alt = name[:-len(fused)] + apart
            if alt in native:
                return native[alt]
    raise NotFoundError(f"GPTLayout: the trainer has no tensor '{name}' (native Megatron-Core name)")


class MegatronSource(WeightSource):
    """A WeightSource over a Megatron-Core GPT rank's own parameters (no copies).

    ``layout``: a ``GPTLayout``; ``params``: the rank's native tensors by Megatron name
    (``dict(model.named_parameters())``); ``rank``: the global rank (default: ``RANK``
    from the launcher); ``dtype``: the checkpoint dtype (default: the params')."""

    def __init__(self, layout, params, rank=None, dtype=None):
        super().__init__(rank=rank, world_size=layout.world_size)
        self.gpt = layout
        self.params = params
        self.dtype = dtype if dtype is not None else next(iter(params.values())).dtype

    def metadata(self):
        return self.gpt.metadata(self.dtype)

    def holdings(self, rank):
        return self.gpt.holdings(rank)

    def materialize(self, group):
        return self.gpt.views(self.rank, self.params, {name for name, _, _ in self.boxes(group)})
