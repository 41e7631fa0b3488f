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
PP stages, or ``first`` / ``last`` layers in the first and last stage and the rest evenly
(Megatron-Core's ``--decoder-first/last-pipeline-num-layers``); ``decoder.layers.{i}``
in native names is the stage-local index (what ``named_parameters()`` gives).

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

DeepSeek-V2/V3 and Kimi-K2 (``kv_lora_rank`` and ``n_routed_experts`` in the config) are
GPT models too, with Megatron-Core's multi-latent attention: ``linear_q_down_proj`` and
``linear_kv_down_proj`` (HF ``q_a_proj``, ``kv_a_proj_with_mqa``) whole on every TP rank,
``linear_q_up_proj`` / ``linear_kv_up_proj`` (``q_b_proj``, ``kv_b_proj``) split by heads
with the q/kv norms fused in (``layer_norm_weight``; or apart as ``q_layernorm`` /
``kv_layernorm``), ``linear_proj`` by columns, the input norm apart. The first
``first_k_dense_replace`` layers are dense; the MoE layers add the shared experts
(``mlp.shared_experts.linear_fc1`` / ``linear_fc2``, split over TP like a dense MLP) and,
with ``topk_method: noaux_tc``, the router's ``expert_bias``
(``e_score_correction_bias``). Multi-token-prediction layers
(``num_nextn_predict_layers``, or ``mtp_layers=``) are ``mtp.layers.{k}`` on the last
stage (``enorm``, ``hnorm``, ``eh_proj`` split by rows over TP, ``final_layernorm`` as
``shared_head.norm``, ``mtp_model_layer.*``, ``transformer_layer.*`` in earlier releases);
they share the output layer
(``shared_head.head``) and the embedding, which Megatron keeps on the last stage too.
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
    None (found per layer from the native names ``views`` is given).

    DeepSeek-style configs (MLA: kv_lora_rank, q_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim; n_routed_experts, n_shared_experts,
    first_k_dense_replace, moe_layer_freq, topk_method) as the module docstring says.
    ``mtp_layers``: the trainer's multi-token-prediction layers (default the config's
    num_nextn_predict_layers for a DeepSeek-style config, else 0; 0 for a trainer without
    them). ``first`` / ``last``: the layers of the first and last PP stage (uneven stages)."""

    def __init__(self, hf_config, tp=1, pp=1, dp=1, make_vocab_size_divisible_by=128, qk_layernorm=None, *, ep=1,
                 etp=None, expert_layout=None, mtp_layers=None, first=None, last=None):
        c = hf_config
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise InvalidArgumentError("GPTLayout: biases are not supported yet (attention_bias / mlp_bias)")
        if c.get("shared_expert_intermediate_size"):
            raise InvalidArgumentError("GPTLayout: Qwen2-MoE's gated shared expert (shared_expert_intermediate_size) "
                                       "is not supported yet; DeepSeek-style n_shared_experts are")
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
        # Multi-latent attention (DeepSeek-V2/V3, Kimi-K2): Megatron-Core's MLASelfAttention.
        self.mla = bool(c.get("kv_lora_rank"))
        if self.mla:
            self.q_lora = int(c.get("q_lora_rank") or 0)  # 0: no q down-projection (q_proj)
            self.kv_lora = int(c["kv_lora_rank"])
            self.qk_nope, self.qk_rope = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
            self.v_head = int(c["v_head_dim"])
        # Experts: Qwen2/3-MoE and DeepSeek name them mlp.experts.{e}.{gate,up,down}_proj,
        # Mixtral block_sparse_moe.experts.{e}.{w1,w3,w2}.
        self.num_experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
        self.mixtral = model_type == "mixtral" or "MixtralForCausalLM" in (c.get("architectures") or ())
        self.moe_intermediate = int(c.get("moe_intermediate_size") or self.intermediate) if self.num_experts else 0
        # DeepSeek's shared experts (one MLP of n_shared_experts * moe_intermediate_size, TP
        # split like a dense MLP) and its router's score-correction bias (noaux_tc).
        self.shared_intermediate = int(c.get("n_shared_experts") or 0) * self.moe_intermediate
        self.router_bias = c.get("topk_method") == "noaux_tc"
        # Multi-token-prediction layers (num_nextn_predict_layers): HF model.layers.{L+k},
        # Megatron mtp.layers.{k} on the last stage, sharing its embedding and output layer.
        # (DeepSeek-style configs only: another model's num_nextn_predict_layers, e.g. MiMo's
        # model.mtp_layers.*, is not this layout.)
        deepseek_style = self.mla or bool(c.get("n_routed_experts"))
        if mtp_layers is None:
            mtp_layers = int(c.get("num_nextn_predict_layers") or 0) if deepseek_style else 0
        self.mtp_layers = int(mtp_layers)
        self.ep = int(ep)
        self.etp = self.tp if etp is None else int(etp)
        if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
            raise InvalidArgumentError(f"GPTLayout: expert_layout {expert_layout!r} is none of {EXPERT_LAYOUTS}")
        self.expert_layout = expert_layout
        if self.mixtral:
            self._moe_layers = set(range(self.layers)) if self.num_experts else set()
        elif c.get("n_routed_experts"):  # DeepSeek: dense below first_k_dense_replace, MTP layers alike
            dense, freq = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
            self._moe_layers = {i for i in range(self.layers + self.mtp_layers) if i >= dense and i % freq == 0}
        else:
            step = int(c.get("decoder_sparse_step") or 1)
            only = {int(i) for i in (c.get("mlp_only_layers") or ())}
            self._moe_layers = {i for i in range(self.layers)
                                if self.num_experts > 0 and i not in only and (i + 1) % step == 0}
        for what, n in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp), ("ep", self.ep), ("etp", self.etp)):
            if n <= 0:
                raise InvalidArgumentError(f"GPTLayout: {what} must be positive, got {n}")
        # Uneven pipeline stages (Megatron-Core's --decoder-first-pipeline-num-layers and
        # --decoder-last-pipeline-num-layers): the layers of the first and last stage.
        self.first = None if first is None else int(first)
        self.last = None if last is None else int(last)
        self._stage_sizes = self._split_stages()
        self.padded_vocab = padded_vocab_size(self.vocab, self.tp, make_vocab_size_divisible_by)
        if self.mtp_layers < 0:
            raise InvalidArgumentError(f"GPTLayout: mtp_layers must be >= 0, got {self.mtp_layers}")
        checks = [("num_attention_heads", self.heads)]
        if len(self._moe_layers) < self.layers + self.mtp_layers:
            checks.append(("intermediate_size", self.intermediate))  # a dense MLP somewhere
        if self.shared_intermediate:
            checks.append(("n_shared_experts * moe_intermediate_size", self.shared_intermediate))
        if self.mtp_layers:
            checks.append(("hidden_size (eh_proj's rows)", self.hidden))
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
        if not self.mla:
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
        out = f"tp={self.tp},pp={self.pp},ep={self.ep},etp={self.etp},dp={self.dp}"
        for key, n in (("first", self.first), ("last", self.last)):
            if n is not None:
                out += f",{key}={n}"
        return out

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

    def _split_stages(self):
        """Layers per PP stage: ``first`` and ``last`` where given, the rest evenly (earlier
        stages take the remainder), as ferry's C++ Megatron layout splits them."""
        for what, n in (("first", self.first), ("last", self.last)):
            if n is not None and (n < 0 or self.pp == 1):
                raise InvalidArgumentError(f"GPTLayout: {what}={n} needs pp > 1 and a count >= 0")
        fixed = [n for n in (self.first, self.last) if n is not None]
        middle = self.pp - len(fixed)
        rest = self.layers - sum(fixed)
        if rest < 0 or (middle == 0 and rest != 0):
            raise InvalidArgumentError(f"GPTLayout: first={self.first}, last={self.last} do not leave "
                                       f"{self.layers} layers for pp {self.pp} stages")
        per, extra = divmod(rest, middle) if middle else (0, 0)
        sizes = [per + (1 if k < extra else 0) for k in range(middle)]
        if self.first is not None:
            sizes.insert(0, self.first)
        if self.last is not None:
            sizes.append(self.last)
        return sizes

    def stage_layers(self, stage):
        """The global layer indices of PP stage ``stage`` (contiguous; ``first`` / ``last``
        layers in the first and last stage where given, the rest evenly, earlier stages
        taking the remainder)."""
        start = sum(self._stage_sizes[:stage])
        return range(start, start + self._stage_sizes[stage])

    def _expert_names(self, layer, e):
        """HF names of expert ``e`` of ``layer``: (gate, up, down), and the router's."""
        p = f"model.layers.{layer}."
        if self.mixtral:
            x = p + f"block_sparse_moe.experts.{e}."
            return (x + "w1.weight", x + "w3.weight", x + "w2.weight"), p + "block_sparse_moe.gate.weight"
        x = p + f"mlp.experts.{e}."
        return (x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"), p + "mlp.gate.weight"

    def _attention_shapes(self):
        """{HF attention tensor suffix: shape} of one layer."""
        H, hd = self.hidden, self.head_dim
        if self.mla:
            qk = self.qk_nope + self.qk_rope
            m = {}
            if self.q_lora:
                m["self_attn.q_a_proj.weight"] = (self.q_lora, H)
                m["self_attn.q_a_layernorm.weight"] = (self.q_lora,)
                m["self_attn.q_b_proj.weight"] = (self.heads * qk, self.q_lora)
            else:
                m["self_attn.q_proj.weight"] = (self.heads * qk, H)
            m["self_attn.kv_a_proj_with_mqa.weight"] = (self.kv_lora + self.qk_rope, H)
            m["self_attn.kv_a_layernorm.weight"] = (self.kv_lora,)
            m["self_attn.kv_b_proj.weight"] = (self.heads * (self.qk_nope + self.v_head), self.kv_lora)
            m["self_attn.o_proj.weight"] = (H, self.heads * self.v_head)
            return m
        q, kv = self.heads * hd, self.kv_heads * hd
        m = {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H)}
        if self.qk_layernorm:
            m["self_attn.q_norm.weight"] = (hd,)
            m["self_attn.k_norm.weight"] = (hd,)
        m["self_attn.o_proj.weight"] = (H, q)
        return m

    def _layer_metadata(self, i, m, dtype):
        H, I = self.hidden, self.intermediate
        p = f"model.layers.{i}."
        m[p + "input_layernorm.weight"] = ((H,), dtype)
        for suffix, shape in self._attention_shapes().items():
            m[p + suffix] = (shape, dtype)
        m[p + "post_attention_layernorm.weight"] = ((H,), dtype)
        if self.is_moe_layer(i):
            Im = self.moe_intermediate
            m[self._expert_names(i, 0)[1]] = ((self.num_experts, H), dtype)
            if self.router_bias:  # fp32 whatever the model's dtype (Megatron's fp32 buffer, the checkpoint's)
                m[p + "mlp.gate.e_score_correction_bias"] = ((self.num_experts,), _float32_like(dtype))
            for e in range(self.num_experts):
                (gate, up, down), _ = self._expert_names(i, e)
                m[gate] = ((Im, H), dtype)
                m[up] = ((Im, H), dtype)
                m[down] = ((H, Im), dtype)
            if self.shared_intermediate:
                Is = self.shared_intermediate
                m[p + "mlp.shared_experts.gate_proj.weight"] = ((Is, H), dtype)
                m[p + "mlp.shared_experts.up_proj.weight"] = ((Is, H), dtype)
                m[p + "mlp.shared_experts.down_proj.weight"] = ((H, Is), dtype)
        else:
            m[p + "mlp.gate_proj.weight"] = ((I, H), dtype)
            m[p + "mlp.up_proj.weight"] = ((I, H), dtype)
            m[p + "mlp.down_proj.weight"] = ((H, I), dtype)

    def metadata(self, dtype):
        """{HF name: (shape, dtype)} of the model (unpadded vocab), its MTP layers included
        (``model.layers.{num_hidden_layers + k}.*``, as DeepSeek-V3's checkpoint has them)."""
        H = self.hidden
        m = {"model.embed_tokens.weight": ((self.vocab, H), dtype)}
        for i in range(self.layers):
            self._layer_metadata(i, m, dtype)
        m["model.norm.weight"] = ((H,), dtype)
        if not self.tied:
            m["lm_head.weight"] = ((self.vocab, H), dtype)
        for k in range(self.mtp_layers):
            i = self.layers + k
            p = f"model.layers.{i}."
            m[p + "embed_tokens.weight"] = ((self.vocab, H), dtype)
            m[p + "enorm.weight"] = ((H,), dtype)
            m[p + "hnorm.weight"] = ((H,), dtype)
            m[p + "eh_proj.weight"] = ((H, 2 * H), dtype)
            m[p + "shared_head.norm.weight"] = ((H,), dtype)
            m[p + "shared_head.head.weight"] = ((self.vocab, H), dtype)
            self._layer_metadata(i, m, dtype)
        return m

    def _pieces(self, rank):
        """[(HF name, start, size, native name, get)] of ``rank``: each box, the native
        tensor that holds it, and ``get(native)``: the box's view of that tensor."""
        stage, _, r = self.coords(rank)
        H = self.hidden
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
        first = self.stage_layers(stage).start
        for i in self.stage_layers(stage):
            self._layer_pieces(rank, i, f"decoder.layers.{i - first}.", whole, rows, out)
        if stage == self.pp - 1:
            whole("model.norm.weight", (0,), (H,), "decoder.final_layernorm.weight")
            if not self.tied:
                vocab_piece("lm_head.weight", "output_layer.weight")
            # MTP layers: on the last stage, which then keeps the embedding too (Megatron
            # builds it there for them) and shares the output layer with them.
            for k in range(self.mtp_layers):
                p, n = f"model.layers.{self.layers + k}.", f"mtp.layers.{k}."
                vocab_piece(p + "embed_tokens.weight", "embedding.word_embeddings.weight")
                whole(p + "enorm.weight", (0,), (H,), n + "enorm.weight")
                whole(p + "hnorm.weight", (0,), (H,), n + "hnorm.weight")
                rows_h = H // self.tp  # eh_proj: column-parallel, its rows split over TP
                whole(p + "eh_proj.weight", (r * rows_h, 0), (rows_h, 2 * H), n + "eh_proj.weight")
                whole(p + "shared_head.norm.weight", (0,), (H,), n + "final_layernorm.weight")
                vocab_piece(p + "shared_head.head.weight", "output_layer.weight" if not self.tied
                            else "embedding.word_embeddings.weight")
                self._layer_pieces(rank, self.layers + k, n + "transformer_layer.", whole, rows, out)
        return out

    def _layer_pieces(self, rank, i, n, whole, rows, out):
        """The pieces of HF layer ``i`` on ``rank``, whose native layer prefix is ``n``."""
        _, _, r = self.coords(rank)
        H, hd, I = self.hidden, self.head_dim, self.intermediate
        p = f"model.layers.{i}."
        if self.mla:
            # MLASelfAttention: the down projections are whole on every TP rank (TE's
            # "duplicated" linears), the up projections split by heads (column-parallel;
            # their norms fused in: TE's layer_norm_weight), linear_proj by columns. The
            # input norm is a TENorm of its own.
            whole(p + "input_layernorm.weight", (0,), (H,), n + "input_layernorm.weight")
            a = n + "self_attention."
            qk, heads = self.qk_nope + self.qk_rope, self.heads // self.tp
            if self.q_lora:
                whole(p + "self_attn.q_a_proj.weight", (0, 0), (self.q_lora, H), a + "linear_q_down_proj.weight")
                whole(p + "self_attn.q_a_layernorm.weight", (0,), (self.q_lora,),
                      a + "linear_q_up_proj.layer_norm_weight")
                whole(p + "self_attn.q_b_proj.weight", (r * heads * qk, 0), (heads * qk, self.q_lora),
                      a + "linear_q_up_proj.weight")
            else:
                whole(p + "self_attn.q_proj.weight", (r * heads * qk, 0), (heads * qk, H), a + "linear_q_proj.weight")
            whole(p + "self_attn.kv_a_proj_with_mqa.weight", (0, 0), (self.kv_lora + self.qk_rope, H),
                  a + "linear_kv_down_proj.weight")
            whole(p + "self_attn.kv_a_layernorm.weight", (0,), (self.kv_lora,), a + "linear_kv_up_proj.layer_norm_weight")
            kvr = heads * (self.qk_nope + self.v_head)
            whole(p + "self_attn.kv_b_proj.weight", (r * kvr, 0), (kvr, self.kv_lora), a + "linear_kv_up_proj.weight")
            vc = heads * self.v_head
            whole(p + "self_attn.o_proj.weight", (0, r * vc), (H, vc), a + "linear_proj.weight")
        else:
            qkv = n + "self_attention.linear_qkv.weight"
            whole(p + "input_layernorm.weight", (0,), (H,), n + "self_attention.linear_qkv.layer_norm_weight")
            for part, entries in qkv_rows(self.heads, self.kv_heads, hd, self.tp, r).items():
                for hf_row, native_row, count in entries:
                    rows(p + f"self_attn.{part}_proj.weight", (hf_row, 0), (count, H), qkv, native_row, count)
            if self.qk_layernorm:
                whole(p + "self_attn.q_norm.weight", (0,), (hd,), n + "self_attention.q_layernorm.weight")
                whole(p + "self_attn.k_norm.weight", (0,), (hd,), n + "self_attention.k_layernorm.weight")
            q_cols = self.heads * hd // self.tp
            whole(p + "self_attn.o_proj.weight", (0, r * q_cols), (H, q_cols), n + "self_attention.linear_proj.weight")
        if self.is_moe_layer(i):
            _, edp_rank, ep_rank, etp_rank = self.expert_coords(rank)
            # No norm fused into the experts: Megatron keeps pre_mlp_layernorm apart.
            whole(p + "post_attention_layernorm.weight", (0,), (H,), n + "pre_mlp_layernorm.weight")
            whole(self._expert_names(i, 0)[1], (0, 0), (self.num_experts, H), n + "mlp.router.weight")
            if self.router_bias:
                whole(p + "mlp.gate.e_score_correction_bias", (0,), (self.num_experts,), n + "mlp.router.expert_bias")
            Ix = self.moe_intermediate // self.etp
            for j in range(self.local_experts):
                (gate, up, down), _ = self._expert_names(i, ep_rank * self.local_experts + j)
                for hf, part, start, size in ((gate, "gate", (etp_rank * Ix, 0), (Ix, H)),
                                              (up, "up", (etp_rank * Ix, 0), (Ix, H)),
                                              (down, "down", (0, etp_rank * Ix), (H, Ix))):
                    out.append((hf, start, size, n + "mlp.experts",
                                lambda native, n=n, j=j, part=part, hf=hf, size=size:
                                self._expert_view(native, n, j, part, hf, size)))
            if self.shared_intermediate:  # SharedExpertMLP: a dense MLP, TP split
                ic = self.shared_intermediate // self.tp
                fc1 = n + "mlp.shared_experts.linear_fc1.weight"
                rows(p + "mlp.shared_experts.gate_proj.weight", (r * ic, 0), (ic, H), fc1, 0, ic)
                rows(p + "mlp.shared_experts.up_proj.weight", (r * ic, 0), (ic, H), fc1, ic, ic)
                whole(p + "mlp.shared_experts.down_proj.weight", (0, r * ic), (H, ic),
                      n + "mlp.shared_experts.linear_fc2.weight")
        else:
            i_cols = I // self.tp
            whole(p + "post_attention_layernorm.weight", (0,), (H,), n + "mlp.linear_fc1.layer_norm_weight")
            fc1 = n + "mlp.linear_fc1.weight"
            rows(p + "mlp.gate_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, 0, i_cols)
            rows(p + "mlp.up_proj.weight", (r * i_cols, 0), (i_cols, H), fc1, i_cols, i_cols)
            whole(p + "mlp.down_proj.weight", (0, r * i_cols), (H, i_cols), n + "mlp.linear_fc2.weight")

    def _expert_layout_of(self, native, n):
        """The form of the experts of native layer prefix ``n``: ``expert_layout``, else
        the one whose names ``native`` has."""
        if self.expert_layout is not None:
            return self.expert_layout
        for form in EXPERT_LAYOUTS:
            if _aliased(native, _expert_native_names(form, n, 0)[0]) is not None:
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
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


# Megatron-Core's MTP layer names its decoder layer mtp_model_layer (transformer_layer in
# releases before it, and in checkpoints).
_PREFIX_ALIASES = ((".transformer_layer.", ".mtp_model_layer."),)


def _float32_like(dtype):
    """float32 in the kind of dtype ``dtype`` is (a torch or numpy dtype, or a name)."""
    if isinstance(dtype, str):
        return "float32"
    if type(dtype).__module__.startswith("torch"):
        import torch
        return torch.float32
    import numpy
    return numpy.dtype("float32")


def _aliased(native, name):
    """The name ``native`` has ``name`` under (itself, or its newer prefix), or None."""
    if name in native:
        return name
    for old, new in _PREFIX_ALIASES:
        if old in name and name.replace(old, new, 1) in native:
            return name.replace(old, new, 1)
    return None


def _native(native, name):
    found = _aliased(native, name)
    if found is not None:
        return native[found]
    for fused, apart in _NORM_ALIASES.items():
        if name.endswith(fused):
            alt = name[:-len(fused)] + apart
            if alt in native:
                return native[alt]
    raise NotFoundError(f"GPTLayout: the trainer has no tensor '{name}' (native Megatron-Core name)")


class MegatronSource(WeightSource):
    """A WeightSource over a Megatron-Core GPT rank's own parameters (no copies).

    ``layout``: a ``GPTLayout``; ``params``: the rank's model (an ``nn.Module``: its named
    parameters and buffers, e.g. the router's fp32 ``expert_bias`` buffer) or its native
    tensors by Megatron name (``dict(model.named_parameters())``, with the buffers a layout
    needs); ``rank``: the global rank (default: ``RANK`` from the launcher); ``dtype``: the
    checkpoint dtype (default: the params')."""

    def __init__(self, layout, params, rank=None, dtype=None):
        super().__init__(rank=rank, world_size=layout.world_size)
        self.gpt = layout
        if hasattr(params, "named_parameters") and hasattr(params, "named_buffers"):
            params = {**dict(params.named_parameters()), **dict(params.named_buffers())}
        self.params = params
        if dtype is None:  # the dtype most tensors have (not an fp32 buffer's beside bf16 weights)
            counts = {}
            for t in params.values():
                counts[t.dtype] = counts.get(t.dtype, 0) + 1
            dtype = max(counts, key=counts.get)
        self.dtype = dtype

    def metadata(self):
        return self.gpt.metadata(self.dtype)

    def holdings(self, rank):
        return self.gpt.holdings(rank)

    def materialize(self, group):
        return self.gpt.views(self.rank, self.params, {name for name, _, _ in self.boxes(group)})
