"""Megatron-Core's own tensors as ferry boxes (``ferry.megatron``; needs the engine).

A Megatron-Core GPT model (Llama, Qwen2/3 without biases, Mistral: dense, RMSNorm,
gated MLP; Qwen3-MoE and Mixtral: routed experts, below) keeps its weights in its own
layout: the vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``
and split evenly over TP; q, k and v fused into one
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

MoE layers (``ep``, ``etp``): the routed experts of a stage are spread over its
``tp * dp`` ranks re-factored as Megatron's expert grid, ``edp * (ep * etp)`` (etp
fastest, then ep, then the expert-data-parallel replicas): EP rank ``o`` holds experts
``o * E/ep ... (o + 1) * E/ep - 1``, each expert's ``linear_fc1`` (``[gate; up]``) and
``linear_fc2`` split over ETP like a dense MLP over TP. The router and the norms are
whole on every rank of the stage. The holdings are those of ferry's C++ Megatron helper
(``make_holdings``, what ``WeightSource(layout=...)`` computes) for the layout string
``GPTLayout.trainer_layout``, but for the vocab rows, which Megatron pads. The experts'
native tensors are found in each of Megatron-Core's three forms (``expert_layout``):
``"te_grouped"`` (TEGroupedMLP, ``--moe-grouped-gemm`` with Transformer Engine:
``mlp.experts.linear_fc1.weight{j}``), ``"legacy_grouped"`` (GroupedMLP,
``--moe-use-legacy-grouped-gemm``: ``mlp.experts.weight1`` / ``weight2``, every local
expert in one tensor) and ``"sequential"`` (SequentialMLP, no grouped GEMM:
``mlp.experts.local_experts.{j}.linear_fc1.weight``); by default the form the native
tensors have.
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


EXPERT_LAYOUTS = ("te_grouped", "legacy_grouped", "sequential")


class GPTLayout:
    """How a Megatron-Core GPT trainer of ``tp * pp * dp`` ranks holds an HF model.

    ``hf_config``: the HF config dict (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, num_hidden_layers, vocab_size,
    tie_word_embeddings; for MoE models num_experts (Qwen3-MoE) or num_local_experts
    (Mixtral), moe_intermediate_size, decoder_sparse_step, mlp_only_layers).
    ``qk_layernorm``: the model has q/k norms (default: Qwen3 and Qwen3-MoE).

    MoE: ``ep`` (expert_model_parallel_size), ``etp`` (expert_tensor_parallel_size;
    default ``tp``, as in Megatron-Core), ``expert_layout``: one of ``EXPERT_LAYOUTS`` or
    None (found per layer from the native names ``views`` is given)."""

    def __init__(self, hf_config, tp=1, pp=1, dp=1, make_vocab_size_divisible_by=128, qk_layernorm=None, *, ep=1,
                 etp=None, expert_layout=None):
        c = hf_config
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise InvalidArgumentError("GPTLayout: biases are not supported yet (attention_bias / mlp_bias)")
        if c.get("n_routed_experts"):
            raise InvalidArgumentError("GPTLayout: DeepSeek-style MoE (n_routed_experts, MLA attention) is not a GPT "
                                       "layout; pass its holdings to WeightSource instead")
        if c.get("shared_expert_intermediate_size") or c.get("n_shared_experts"):
            raise InvalidArgumentError("GPTLayout: shared experts are not supported yet (shared_expert_intermediate_size)")
        self.hidden = int(c["hidden_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or self.hidden // self.heads)
        self.intermediate = int(c["intermediate_size"])
        self.layers = int(c["num_hidden_layers"])
        self.vocab = int(c["vocab_size"])
        self.tied = bool(c.get("tie_word_embeddings", False))
        model_type = c.get("model_type")
        self.qk_layernorm = bool(model_type in ("qwen3", "qwen3_moe") if qk_layernorm is None else qk_layernorm)
        self.tp, self.pp, self.dp = int(tp), int(pp), int(dp)
        # Experts: Qwen2/3-MoE name them mlp.experts.{e}.{gate,up,down}_proj, Mixtral
        # block_sparse_moe.experts.{e}.{w1,w3,w2}.
        self.num_experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
        self.mixtral = model_type == "mixtral" or "MixtralForCausalLM" in (c.get("architectures") or ())
        self.moe_intermediate = int(c.get("moe_intermediate_size") or self.intermediate) if self.num_experts else 0
        self.ep = int(ep)
        self.etp = self.tp if etp is None else int(etp)
        if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
            raise InvalidArgumentError(f"GPTLayout: expert_layout {expert_layout!r} is none of {EXPERT_LAYOUTS}")
        self.expert_layout = expert_layout
        if self.mixtral:
            self._moe_layers = set(range(self.layers)) if self.num_experts else set()
        else:
            step = int(c.get("decoder_sparse_step") or 1)
            only = {int(i) for i in (c.get("mlp_only_layers") or ())}
            self._moe_layers = {i for i in range(self.layers)
                                if self.num_experts > 0 and i not in only and (i + 1) % step == 0}
        for what, n in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("ep", self.ep), ("etp", self.etp)):
            if n <= 0:
                raise InvalidArgumentError(f"GPTLayout: {what} must be positive, got {n}")
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, make_vocab_size_divisible_by)
        checks = [("num_attention_heads", self.heads)]
        if len(self._moe_layers) < self.layers:
            checks.append(("intermediate_size", self.intermediate))  # a dense MLP somewhere
        for what, n in checks:
            if n % self.tp:
                raise InvalidArgumentError(f"GPTLayout: tp {self.tp} does not divide {what} {n}")
        if self.layers < self.pp:
            raise InvalidArgumentError(f"GPTLayout: pp {self.pp} exceeds num_hidden_layers {self.layers}")
        # The expert grid, as ferry's C++ Megatron layout checks it (TrainerLayout::parse).
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise InvalidArgumentError(f"GPTLayout: ep*etp = {self.ep * self.etp} must divide tp*dp = "
                                       f"{self.tp * self.dp} (the experts of a stage are spread over its tp*dp ranks)")
        if self._moe_layers:
            if self.num_experts % self.ep:
                raise InvalidArgumentError(f"GPTLayout: ep {self.ep} does not divide the {self.num_experts} experts")
            if self.moe_intermediate % self.etp:
                raise InvalidArgumentError(f"GPTLayout: etp {self.etp} does not divide moe_intermediate_size "
                                           f"{self.moe_intermediate}")
        qkv_rows(self.heads, self.kv_heads, self.head_dim, self.tp, 0)  # checks the head counts
        self._by_name = {}  # rank -> {HF name: its pieces}

    @property
    def world_size(self):
        return self.tp * self.pp * self.dp

    @property
    def edp(self):
        """Expert data parallel: the replicas of each expert in a stage, ``tp * dp / (ep * etp)``."""
        return self.tp * self.dp // (self.ep * self.etp)

    @property
    def local_experts(self):
        """Experts per EP rank (``num_experts / ep``); 0 for a dense model."""
        return self.num_experts // self.ep

    @property
    def trainer_layout(self):
        """The same layout as ferry's Megatron layout string ("tp=..,pp=..,ep=..,etp=..,dp=.."):
        ``WeightSource(layout=...)`` / ``ferry plan --trainer``, whose C++ holdings are
        this layout's but for the vocab rows (ferry's helper chunks the unpadded vocab;
        Megatron pads it: ``padded_vocab``)."""
        return f"tp={self.tp},pp={self.pp},ep={self.ep},etp={self.etp},dp={self.dp}"

    def is_moe_layer(self, layer):
        """Whether global layer ``layer`` has routed experts (else a dense MLP)."""
        return layer in self._moe_layers

    def coords(self, rank):
        """(pp stage, dp index, tp rank) of global ``rank`` (Megatron's order)."""
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"GPTLayout: rank {rank} outside {self.world_size} ranks "
                                       f"(tp={self.tp}, pp={self.pp}, dp={self.dp})")
        return rank // (self.tp * self.dp), rank // self.tp % self.dp, rank % self.tp

    def expert_coords(self, rank):
        """(pp stage, edp index, ep rank, etp rank) of global ``rank``: the ranks of a stage
        as Megatron's expert grid, etp fastest, then ep, then edp (ferry's C++ helper's
        ``stage * tp * dp + edp * (ep * etp) + ep * etp + etp``)."""
        stage, _, _ = self.coords(rank)
        local = rank % (self.tp * self.dp)
        return stage, local // (self.ep * self.etp), local // self.etp % self.ep, local % self.etp

    def stage_layers(self, stage):
        """The global layer indices of PP stage ``stage`` (contiguous, earlier stages take the remainder)."""
        per, extra = divmod(self.layers, self.pp)
        start = stage * per + min(stage, extra)
        return range(start, start + per + (1 if stage < extra else 0))

    def _expert_names(self, layer, e):
        """HF names of expert ``e`` of ``layer``: (gate, up, down), and the router's."""
        p = f"model.layers.{layer}."
        if self.mixtral:
            x = p + f"block_sparse_moe.experts.{e}."
            return (x + "w1.weight", x + "w3.weight", x + "w2.weight"), p + "block_sparse_moe.gate.weight"
        x = p + f"mlp.experts.{e}."
        return (x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"), p + "mlp.gate.weight"

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
            if self.is_moe_layer(i):
                Im = self.moe_intermediate
                m[self._expert_names(i, 0)[1]] = ((self.num_experts, H), dtype)
                for e in range(self.num_experts):
                    (gate, up, down), _ = self._expert_names(i, e)
                    m[gate] = ((Im, H), dtype)
                    m[up] = ((Im, H), dtype)
                    m[down] = ((H, Im), dtype)
            else:
                m[p + "mlp.gate_proj.weight"] = ((I, H), dtype)
                m[p + "mlp.up_proj.weight"] = ((I, H), dtype)
                m[p + "mlp.down_proj.weight"] = ((H, I), dtype)
        m["model.norm.weight"] = ((H,), dtype)
        if not self.tied:
            m["lm_head.weight"] = ((self.vocab, H), dtype)
        return m

    def _pieces(self, rank):
        """[(HF name, start, size, native name, get)] of ``rank``: each box, the native
        tensor that holds it, and ``get(native)``: the box's view of that tensor."""
        stage, _, r = self.coords(rank)
        H, hd, I = self.hidden, self.head_dim, self.intermediate
        q_cols, i_cols = self.heads * hd // self.tp, I // self.tp
        out = []

        def whole(hf, start, size, nat):
            out.append((hf, start, size, nat, lambda native: _native(native, nat)))

        def rows(hf, start, size, nat, row, count):
            out.append((hf, start, size, nat, lambda native: _rows(native, nat, hf, size, row, count)))

        def vocab_piece(hf, native):
            start, n = vocab_rows(self.vocab, self.padded_vocab, self.tp, r)
            if n:
                rows(hf, (start, 0), (n, H), native, 0, n)

        if stage == 0:
            vocab_piece("model.embed_tokens.weight", "embedding.word_embeddings.weight")
        qkv_of_rank = qkv_rows(self.heads, self.kv_heads, hd, self.tp, r)
        first = self.stage_layers(stage).start
        _, edp_rank, ep_rank, etp_rank = self.expert_coords(rank)
        for i in self.stage_layers(stage):
            p, n = f"model.layers.{i}.", f"decoder.layers.{i - first}."
            qkv = n + "self_attention.linear_qkv.weight"
            whole(p + "input_layernorm.weight", (0,), (H,), n + "self_attention.linear_qkv.layer_norm_weight")
            for part in ("q", "k", "v"):
                for hf_row, native_row, count in qkv_of_rank[part]:
                    rows(p + f"self_attn.{part}_proj.weight", (hf_row, 0), (count, H), qkv, native_row, count)
            if self.qk_layernorm:
                whole(p + "self_attn.q_norm.weight", (0,), (hd,), n + "self_attention.q_layernorm.weight")
                whole(p + "self_attn.k_norm.weight", (0,), (hd,), n + "self_attention.k_layernorm.weight")
            whole(p + "self_attn.o_proj.weight", (0, r * q_cols), (H, q_cols), n + "self_attention.linear_proj.weight")
            if self.is_moe_layer(i):
                # No norm fused into the experts: Megatron keeps pre_mlp_layernorm apart.
                whole(p + "post_attention_layernorm.weight", (0,), (H,), n + "pre_mlp_layernorm.weight")
                whole(self._expert_names(i, 0)[1], (0, 0), (self.num_experts, H), n + "mlp.router.weight")
                Ix = self.moe_intermediate // self.etp
                for j in range(self.local_experts):
                    (gate, up, down), _ = self._expert_names(i, ep_rank * self.local_experts + j)
                    for hf, part, start, size in ((gate, "gate", (etp_rank * Ix, 0), (Ix, H)),
                                                  (up, "up", (etp_rank * Ix, 0), (Ix, H)),
                                                  (down, "down", (0, etp_rank * Ix), (H, Ix))):
                        out.append((hf, start, size, n + "mlp.experts",
                                    lambda native, n=n, j=j, part=part, hf=hf, size=size:
                                    self._expert_view(native, n, j, part, hf, size)))
            else:
                whole(p + "post_attention_layernorm.weight", (0,), (H,), n + "mlp.linear_fc1.layer_norm_weight")
                fc1 = n + "mlp.linear_fc1.weight"
                rows(p + "mlp.gate_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, 0, i_cols)
                rows(p + "mlp.up_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, i_cols, i_cols)
                whole(p + "mlp.down_proj.weight", (0, r * i_cols), (H, i_cols), n + "mlp.linear_fc2.weight")
        if stage == self.pp - 1:
            whole("model.norm.weight", (0,), (H,), "decoder.final_layernorm.weight")
            if not self.tied:
                vocab_piece("lm_head.weight", "output_layer.weight")
        return out

    def _expert_layout_of(self, native, n):
        """The form of the experts of native layer prefix ``n``: ``expert_layout``, else
        the one whose names ``native`` has."""
        if self.expert_layout is not None:
            return self.expert_layout
        for form in EXPERT_LAYOUTS:
            if _expert_native_names(form, n, 0)[0] in native:
                return form
        raise NotFoundError(f"GPTLayout: the trainer has none of '{n}mlp.experts.linear_fc1.weight0' (te_grouped), "
                            f"'{n}mlp.experts.weight1' (legacy_grouped), '{n}mlp.experts.local_experts.0.linear_fc1.weight' "
                            "(sequential): no routed experts under Megatron-Core's names")

    def _expert_view(self, native, n, j, part, hf, size):
        """The view of local expert ``j``'s ``part`` ("gate", "up", "down") of native layer
        prefix ``n``, as the HF box of shape ``size``."""
        form = self._expert_layout_of(native, n)
        fc1_name, fc2_name = _expert_native_names(form, n, j)
        H, Ix, E = self.hidden, self.moe_intermediate // self.etp, self.local_experts
        if form == "legacy_grouped":
            # GroupedMLP: weight1 [H, E * 2Ix] is used as [E, H, 2Ix] (gate | up on the last
            # dim), weight2 [E * Ix, H] as [E, Ix, H] (its forward's .view): transposed views.
            if part == "down":
                w = _grouped(native, fc2_name, (E, Ix, H), hf)
                return w[j].T
            w = _grouped(native, fc1_name, (E, H, 2 * Ix), hf)
            half = w[j][:, 0:Ix] if part == "gate" else w[j][:, Ix:2 * Ix]
            return half.T
        if part == "down":
            return _native(native, fc2_name)
        return _rows(native, fc1_name, hf, size, 0 if part == "gate" else Ix, Ix)

    def holdings(self, rank):
        """[(HF name, start, size)]: the boxes ``rank`` holds (for ``WeightSource.holdings``)."""
        return [(hf, start, size) for hf, start, size, _, _ in self._pieces(rank)]

    def views(self, rank, native, names=None):
        """{HF name: view} of ``rank``'s native tensors (``native``: Megatron name ->
        tensor, e.g. ``dict(model.named_parameters())``); a list of views where the rank
        holds several boxes of a tensor (one per kv group). ``names``: only these HF
        names. Norms are looked up under Transformer Engine's fused names
        (``linear_qkv.layer_norm_weight``) and the local spec's (``input_layernorm.weight``);
        experts in the form ``expert_layout`` says, else the one ``native`` has."""
        by_name = self._by_name.get(rank)
        if by_name is None:
            by_name = {}
            for piece in self._pieces(rank):
                by_name.setdefault(piece[0], []).append(piece)
            self._by_name[rank] = by_name
        out = {}
        pieces = by_name.values() if names is None else [by_name[n] for n in names if n in by_name]
        for hf, _, size, nat, get in (p for ps in pieces for p in ps):
            v = get(native)
            if tuple(v.shape) != tuple(size):
                raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' gives {tuple(v.shape)} for '{hf}', "
                                           f"whose box is {tuple(size)}")
            v = v.detach() if hasattr(v, "detach") else v
            if hf in out:
                out[hf] = (out[hf] if isinstance(out[hf], list) else [out[hf]]) + [v]
            else:
                out[hf] = v
        return out


def _expert_native_names(form, n, j):
    """(fc1, fc2) native names of local expert ``j`` of layer prefix ``n`` in ``form``."""
    if form == "te_grouped":
        return f"{n}mlp.experts.linear_fc1.weight{j}", f"{n}mlp.experts.linear_fc2.weight{j}"
    if form == "legacy_grouped":
        return f"{n}mlp.experts.weight1", f"{n}mlp.experts.weight2"
    return f"{n}mlp.experts.local_experts.{j}.linear_fc1.weight", f"{n}mlp.experts.local_experts.{j}.linear_fc2.weight"


def _rows(native, nat, hf, size, row, count):
    """Rows ``row .. row + count`` of native tensor ``nat``, the box of ``hf`` (``size``)."""
    t = _native(native, nat)
    if tuple(t.shape[1:]) != tuple(size[1:]):
        raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' has shape {tuple(t.shape)}, "
                                   f"expected rows of {tuple(size[1:])} for '{hf}'")
    return t[row:row + count]


def _grouped(native, nat, shape, hf):
    """A grouped-GEMM weight as the 3-D view its forward uses (no copy)."""
    t = _native(native, nat)
    numel = shape[0] * shape[1] * shape[2]
    got = 1
    for d in t.shape:
        got *= int(d)
    if got != numel:
        raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' has shape {tuple(t.shape)}, expected "
                                   f"{numel} elements ({' x '.join(map(str, shape))}) for '{hf}'")
    if hasattr(t, "view") and hasattr(t, "data_ptr"):  # torch: a view or an error, never a copy
        return t.view(*shape)
    v = t.reshape(shape)
    if v.base is None and t.size:  # numpy copied (not contiguous)
        raise InvalidArgumentError(f"GPTLayout.views: native '{nat}' is not contiguous; '{hf}' needs a view of it")
    return v


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
