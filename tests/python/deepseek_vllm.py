"""The inference half of the DeepSeek-V3 adoption test: a DeepSeek-V3 ``nn.Module`` loaded as
vLLM's DeepseekV2ForCausalLM loads (vllm/model_executor/models/deepseek_v2.py).

Nothing here knows about ferry. One TP rank of an engine with expert parallelism (vLLM's
``enable_expert_parallel``: each EP rank keeps whole experts, ``E / tp`` of them):

  * MLA: ``fused_qkv_a_proj`` (q_a_proj and kv_a_proj_with_mqa stacked, replicated:
    ``disable_tp``), ``q_a_layernorm``, ``q_b_proj`` and ``kv_b_proj`` column-parallel,
    ``kv_a_layernorm``, ``o_proj`` row-parallel;
  * dense MLPs below ``first_k_dense_replace`` and the shared experts: ``gate_up_proj``
    (MergedColumnParallelLinear), ``down_proj`` (RowParallelLinear);
  * the router (``gate``, replicated) with its ``e_score_correction_bias``; FusedMoE's
    ``w13_weight`` ``[E_local, 2I, H]`` and ``w2_weight`` ``[E_local, H, I]`` filled per
    expert by ``weight_loader(param, w, name, shard_id, expert_id)``, experts of other
    EP ranks skipped;
  * the vocab padded to 64 and split over TP; the MTP layers
    (``model.layers.{num_hidden_layers + k}``) skipped, as vLLM's main model does (its
    DeepSeekMTP draft loads them).
"""
import torch
from torch import nn

from llama_vllm import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead, RMSNorm,  # noqa: F401
                        RowParallelLinear, VocabParallelEmbedding, _set_weight_attrs, default_weight_loader)


def _dtype(cfg):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["torch_dtype"]]


class FusedMoE(nn.Module):
    def __init__(self, num_experts, hidden, inter, ep_rank, ep_size, dtype):
        super().__init__()
        assert num_experts % ep_size == 0
        self.local = num_experts // ep_size
        self.first = ep_rank * self.local
        self.inter = inter
        self.w13_weight = nn.Parameter(torch.empty(self.local, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.local, hidden, inter, dtype=dtype), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            _set_weight_attrs(p, {"weight_loader": self.weight_loader})

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        e = expert_id - self.first
        if not 0 <= e < self.local:
            return  # another EP rank's expert
        expert = param.data[e]
        if shard_id == "w1":
            expert.narrow(0, 0, self.inter).copy_(loaded_weight)
        elif shard_id == "w3":
            expert.narrow(0, self.inter, self.inter).copy_(loaded_weight)
        else:
            expert.copy_(loaded_weight)


class DeepseekV2MLP(nn.Module):
    def __init__(self, hidden, inter, tp_rank, tp_size, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank, tp_size, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp_rank, tp_size, dtype)


class Gate(nn.Module):
    def __init__(self, num_experts, hidden, bias, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        if bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)


class DeepseekV2MoE(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size, dtype):
        super().__init__()
        H, E, I = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        self.gate = Gate(E, H, cfg.get("topk_method") == "noaux_tc", dtype)
        self.experts = FusedMoE(E, H, I, tp_rank, tp_size, dtype)
        if cfg.get("n_shared_experts"):
            self.shared_experts = DeepseekV2MLP(H, cfg["n_shared_experts"] * I, tp_rank, tp_size, dtype)


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size, dtype):
        super().__init__()
        H, n = cfg["hidden_size"], cfg["num_attention_heads"]
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        self.q_lora_rank, kv_lora, eps = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg.get("rms_norm_eps", 1e-6)
        if self.q_lora_rank:
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                H, [self.q_lora_rank, kv_lora + cfg["qk_rope_head_dim"]], 0, 1, dtype)  # disable_tp
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, n * qk, tp_rank, tp_size, dtype)
        else:
            self.q_proj = ColumnParallelLinear(H, n * qk, tp_rank, tp_size, dtype)
            self.kv_a_proj_with_mqa = ColumnParallelLinear(H, kv_lora + cfg["qk_rope_head_dim"], 0, 1, dtype)
        self.kv_a_layernorm = RMSNorm(kv_lora, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(kv_lora, n * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                              tp_rank, tp_size, dtype)
        self.o_proj = RowParallelLinear(n * cfg["v_head_dim"], H, tp_rank, tp_size, dtype)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer, tp_rank, tp_size, dtype):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(H, eps, dtype)
        self.self_attn = DeepseekV2MLAAttention(cfg, tp_rank, tp_size, dtype)
        self.post_attention_layernorm = RMSNorm(H, eps, dtype)
        moe = cfg.get("n_routed_experts") and layer >= cfg.get("first_k_dense_replace", 0) and \
            layer % cfg.get("moe_layer_freq", 1) == 0
        self.mlp = DeepseekV2MoE(cfg, tp_rank, tp_size, dtype) if moe else \
            DeepseekV2MLP(H, cfg["intermediate_size"], tp_rank, tp_size, dtype)


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg, tp_rank, tp_size, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], tp_rank, tp_size, dtype)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i, tp_rank, tp_size, dtype)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), dtype)


class DeepseekV3ForCausalLM(nn.Module):
    """One TP (and EP) rank of the engine's DeepSeek-V3 (vLLM's parameter names)."""

    def __init__(self, cfg, tp_rank=0, tp_size=1):
        super().__init__()
        self.cfg = dict(cfg)
        dtype = _dtype(cfg)
        self.model = DeepseekV2Model(cfg, tp_rank, tp_size, dtype)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp_rank, tp_size, dtype)

    def load_weights(self, weights):
        """vLLM's DeepseekV2ForCausalLM.load_weights: (HF name, tensor) pairs."""
        cfg = self.cfg
        stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
        if cfg.get("q_lora_rank"):
            stacked_params_mapping += [("fused_qkv_a_proj", "q_a_proj", 0),
                                       ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]
        expert_params_mapping = []
        for e in range(cfg["n_routed_experts"]):
            expert_params_mapping += [("experts.w13_", f"experts.{e}.gate_proj.", e, "w1"),
                                      ("experts.w13_", f"experts.{e}.up_proj.", e, "w3"),
                                      ("experts.w2_", f"experts.{e}.down_proj.", e, "w2")]
        params_dict = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= cfg["num_hidden_layers"]:
                continue  # an MTP layer: the draft model's (DeepSeekMTP)
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                if "mlp.experts." in name and name not in params_dict:
                    continue  # a routed expert's gate/up: the expert mapping's
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in expert_params_mapping:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = params_dict[name]
                    param.weight_loader(param, loaded_weight, name, shard_id=shard_id, expert_id=expert_id)
                    break
                else:
                    param = params_dict[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, loaded_weight)
            loaded.add(name)
        return loaded
