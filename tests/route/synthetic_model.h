// Test helpers: random small HF-style models (dense, MoE with per-expert or fused
// experts, Phi-3 fused qkv/gate_up, biases, a 0-d tensor), a vLLM-like synthetic loader
// that records inference plans with ferry::Recorder, and an in-process executor of
// routes (pack on producers from SyntheticSource, "read" = memcpy, unpack on consumers).
#pragma once

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ferry/plan.h"
#include "ferry/route.h"
#include "ferry/source.h"

namespace ferry::testing {

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(gen); }
  template <typename T>
  T pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(uniform(0, static_cast<int64_t>(v.size()) - 1))];
  }
};

struct ModelSpec {
  int64_t hidden = 16, heads = 4, kv_heads = 2, head_dim = 4, inter = 16, vocab = 37, layers = 2;
  int64_t experts = 0, moe_inter = 8;  // experts > 0: MoE layers
  bool fused_experts = false;          // Llama-4 style [E, H, 2I] / [E, I, H]
  bool phi3 = false;                   // fused qkv_proj / gate_up_proj
  bool qkv_bias = false;
  bool scalar = false;                 // a 0-d tensor per layer
  bool tied = false;                   // no lm_head
  DType dtype = DType::kBF16;
  int64_t q_rows() const { return heads * head_dim; }
  int64_t kv_rows() const { return kv_heads * head_dim; }
};

inline std::string layer(int64_t i) { return "model.layers." + std::to_string(i) + "."; }

inline std::vector<TensorDecl> make_metadata(const ModelSpec& m) {
  std::vector<TensorDecl> out;
  auto add = [&](std::string n, Shape s, DType d) { out.push_back(TensorDecl{std::move(n), d, std::move(s)}); };
  const DType dt = m.dtype;
  add("model.embed_tokens.weight", {m.vocab, m.hidden}, dt);
  for (int64_t i = 0; i < m.layers; ++i) {
    const std::string p = layer(i);
    add(p + "input_layernorm.weight", {m.hidden}, dt);
    if (m.phi3) {
      add(p + "self_attn.qkv_proj.weight", {m.q_rows() + 2 * m.kv_rows(), m.hidden}, dt);
    } else {
      add(p + "self_attn.q_proj.weight", {m.q_rows(), m.hidden}, dt);
      add(p + "self_attn.k_proj.weight", {m.kv_rows(), m.hidden}, dt);
      add(p + "self_attn.v_proj.weight", {m.kv_rows(), m.hidden}, dt);
      if (m.qkv_bias) {
        add(p + "self_attn.q_proj.bias", {m.q_rows()}, dt);
        add(p + "self_attn.k_proj.bias", {m.kv_rows()}, dt);
        add(p + "self_attn.v_proj.bias", {m.kv_rows()}, dt);
      }
    }
    add(p + "self_attn.o_proj.weight", {m.hidden, m.q_rows()}, dt);
    add(p + "post_attention_layernorm.weight", {m.hidden}, DType::kF32);
    if (m.scalar) add(p + "mlp.scale", {}, DType::kF32);
    if (m.experts > 0) {
      add(p + "mlp.gate.weight", {m.experts, m.hidden}, dt);
      if (m.fused_experts) {
        add(p + "feed_forward.experts.gate_up_proj", {m.experts, m.hidden, 2 * m.moe_inter}, dt);
        add(p + "feed_forward.experts.down_proj", {m.experts, m.moe_inter, m.hidden}, dt);
      } else {
        for (int64_t e = 0; e < m.experts; ++e) {
          const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
          add(x + "gate_proj.weight", {m.moe_inter, m.hidden}, dt);
          add(x + "up_proj.weight", {m.moe_inter, m.hidden}, dt);
          add(x + "down_proj.weight", {m.hidden, m.moe_inter}, dt);
        }
      }
    } else if (m.phi3) {
      add(p + "mlp.gate_up_proj.weight", {2 * m.inter, m.hidden}, dt);
      add(p + "mlp.down_proj.weight", {m.hidden, m.inter}, dt);
    } else {
      add(p + "mlp.gate_proj.weight", {m.inter, m.hidden}, dt);
      add(p + "mlp.up_proj.weight", {m.inter, m.hidden}, dt);
      add(p + "mlp.down_proj.weight", {m.hidden, m.inter}, dt);
    }
  }
  add("model.norm.weight", {m.hidden}, dt);
  if (!m.tied) add("lm_head.weight", {m.vocab, m.hidden}, dt);
  return out;
}

struct InferSpec {
  int tp = 1, dp = 1, replicas = 1;
  bool ep = false;  // experts over tp*dp
  int world() const { return tp * dp * replicas; }
};

// Records the plan of inference rank `global` the way vLLM's loaders shard (TP split
// rows/cols, fused qkv with kv-head replication, fused gate_up, vocab padding with
// zero_, EP over tp*dp, a transposed param, fp32 norms).
inline Result<Plan> record_synthetic_plan(const ModelSpec& m, const std::vector<TensorDecl>& meta, const InferSpec& is,
                                          int global) {
  const int T = is.tp;
  const int r = global % T;
  const int engine_rank = global % (is.tp * is.dp);
  const int engine = is.tp * is.dp;
  std::map<std::string, Tensor> src;
  for (const auto& d : meta) src.emplace(d.name, Tensor::source(d.name, d.shape, d.dtype));
  auto S = [&](const std::string& n) { return src.at(n); };
  Recorder rec;
  const DType dt = m.dtype;
  const int64_t vp = (m.vocab + 8 * T - 1) / (8 * T) * (8 * T), vper = vp / T;
  auto vocab_param = [&](const std::string& pname, const std::string& sname) -> Status {
    Tensor p = Tensor::param(pname, {vper, m.hidden}, dt);
    const int64_t a = std::min<int64_t>(m.vocab, r * vper);
    const int64_t n = std::min<int64_t>(m.vocab, a + vper) - a;
    if (n > 0) FERRY_RETURN_IF_ERROR(p.narrow(0, 0, n).copy_(S(sname).narrow(0, a, n)));
    if (n < vper) FERRY_RETURN_IF_ERROR(p.narrow(0, n, vper - n).zero_());
    return Status::Ok();
  };
  FERRY_RETURN_IF_ERROR(vocab_param("embed", "model.embed_tokens.weight"));
  const int64_t qh = m.heads / T;
  const bool kv_rep = m.kv_heads < T;
  const int64_t kvh = kv_rep ? 1 : m.kv_heads / T;
  const int64_t kv_head0 = kv_rep ? r / (T / m.kv_heads) : r * kvh;
  const int64_t hd = m.head_dim;
  for (int64_t i = 0; i < m.layers; ++i) {
    const std::string p = layer(i);
    const std::string q = std::to_string(i) + ".";
    FERRY_RETURN_IF_ERROR(Tensor::param(q + "ln1", {m.hidden}, DType::kF32).copy_(S(p + "input_layernorm.weight")));
    Tensor qkv = Tensor::param(q + "qkv", {(qh + 2 * kvh) * hd, m.hidden}, dt);
    Tensor qs, ks, vs;
    if (m.phi3) {
      Tensor f = S(p + "self_attn.qkv_proj.weight");
      qs = f.narrow(0, 0, m.q_rows());
      ks = f.narrow(0, m.q_rows(), m.kv_rows());
      vs = f.narrow(0, m.q_rows() + m.kv_rows(), m.kv_rows());
    } else {
      qs = S(p + "self_attn.q_proj.weight");
      ks = S(p + "self_attn.k_proj.weight");
      vs = S(p + "self_attn.v_proj.weight");
    }
    FERRY_RETURN_IF_ERROR(qkv.narrow(0, 0, qh * hd).copy_(qs.narrow(0, r * qh * hd, qh * hd)));
    FERRY_RETURN_IF_ERROR(qkv.narrow(0, qh * hd, kvh * hd).copy_(ks.narrow(0, kv_head0 * hd, kvh * hd)));
    FERRY_RETURN_IF_ERROR(qkv.narrow(0, (qh + kvh) * hd, kvh * hd).copy_(vs.narrow(0, kv_head0 * hd, kvh * hd)));
    if (m.qkv_bias && !m.phi3) {
      Tensor b = Tensor::param(q + "qkv_bias", {(qh + 2 * kvh) * hd}, DType::kF32);
      FERRY_RETURN_IF_ERROR(b.narrow(0, 0, qh * hd).copy_(S(p + "self_attn.q_proj.bias").narrow(0, r * qh * hd, qh * hd)));
      FERRY_RETURN_IF_ERROR(
          b.narrow(0, qh * hd, kvh * hd).copy_(S(p + "self_attn.k_proj.bias").narrow(0, kv_head0 * hd, kvh * hd)));
      FERRY_RETURN_IF_ERROR(b.narrow(0, (qh + kvh) * hd, kvh * hd)
                                .copy_(S(p + "self_attn.v_proj.bias").narrow(0, kv_head0 * hd, kvh * hd)));
    }
    // o_proj stored transposed: [in/T, H] (a strided read of the source).
    FERRY_RETURN_IF_ERROR(Tensor::param(q + "o_t", {qh * hd, m.hidden}, dt)
                              .copy_(S(p + "self_attn.o_proj.weight").narrow(1, r * qh * hd, qh * hd).t()));
    FERRY_RETURN_IF_ERROR(
        Tensor::param(q + "ln2", {m.hidden}, DType::kF32).copy_(S(p + "post_attention_layernorm.weight")));
    if (m.scalar) FERRY_RETURN_IF_ERROR(Tensor::param(q + "scale", {1}, DType::kF32).copy_(S(p + "mlp.scale").view({1})));
    if (m.experts > 0) {
      FERRY_RETURN_IF_ERROR(Tensor::param(q + "router", {m.experts, m.hidden}, dt).copy_(S(p + "mlp.gate.weight")));
      const int64_t eloc = is.ep ? m.experts / engine : m.experts;
      const int64_t e0 = is.ep ? engine_rank * eloc : 0;
      const int64_t ts = is.ep ? 1 : engine, tr = is.ep ? 0 : engine_rank;
      const int64_t ni = m.moe_inter / ts;
      Tensor w13 = Tensor::param(q + "w13", {eloc, 2 * ni, m.hidden}, dt);
      Tensor w2 = Tensor::param(q + "w2", {eloc, m.hidden, ni}, dt);
      for (int64_t e = 0; e < eloc; ++e) {
        if (m.fused_experts) {
          Tensor gu = S(p + "feed_forward.experts.gate_up_proj")[e0 + e];  // [H, 2I]
          FERRY_RETURN_IF_ERROR(w13[e].narrow(0, 0, ni).copy_(gu.narrow(1, tr * ni, ni).t()));
          FERRY_RETURN_IF_ERROR(w13[e].narrow(0, ni, ni).copy_(gu.narrow(1, m.moe_inter + tr * ni, ni).t()));
          Tensor dn = S(p + "feed_forward.experts.down_proj")[e0 + e];  // [I, H]
          FERRY_RETURN_IF_ERROR(w2[e].copy_(dn.narrow(0, tr * ni, ni).t()));
        } else {
          const std::string x = p + "mlp.experts." + std::to_string(e0 + e) + ".";
          FERRY_RETURN_IF_ERROR(w13[e].narrow(0, 0, ni).copy_(S(x + "gate_proj.weight").narrow(0, tr * ni, ni)));
          FERRY_RETURN_IF_ERROR(w13[e].narrow(0, ni, ni).copy_(S(x + "up_proj.weight").narrow(0, tr * ni, ni)));
          FERRY_RETURN_IF_ERROR(w2[e].copy_(S(x + "down_proj.weight").narrow(1, tr * ni, ni)));
        }
      }
    } else {
      const int64_t ni = m.inter / T;
      Tensor gu = Tensor::param(q + "gate_up", {2 * ni, m.hidden}, dt);
      Tensor gs = m.phi3 ? S(p + "mlp.gate_up_proj.weight").narrow(0, 0, m.inter) : S(p + "mlp.gate_proj.weight");
      Tensor us = m.phi3 ? S(p + "mlp.gate_up_proj.weight").narrow(0, m.inter, m.inter) : S(p + "mlp.up_proj.weight");
      FERRY_RETURN_IF_ERROR(gu.narrow(0, 0, ni).copy_(gs.narrow(0, r * ni, ni)));
      FERRY_RETURN_IF_ERROR(gu.narrow(0, ni, ni).copy_(us.narrow(0, r * ni, ni)));
      FERRY_RETURN_IF_ERROR(
          Tensor::param(q + "down", {m.hidden, ni}, dt).copy_(S(p + "mlp.down_proj.weight").narrow(1, r * ni, ni)));
    }
  }
  FERRY_RETURN_IF_ERROR(Tensor::param("norm", {m.hidden}, dt).copy_(S("model.norm.weight")));
  FERRY_RETURN_IF_ERROR(vocab_param("lm_head", m.tied ? "model.embed_tokens.weight" : "lm_head.weight"));
  return rec.finish();
}

// Executes routes in process and returns every consumer's params.
inline Result<std::vector<TensorMap>> run_routes(const Routes& routes, const std::vector<TensorDecl>& meta,
                                                 const std::vector<Holdings>& holdings, uint64_t seed,
                                                 uint64_t version) {
  auto shared = std::make_shared<const std::vector<Holdings>>(holdings);
  std::vector<TensorMap> out(routes.consumer_plan.size());
  for (size_t c = 0; c < out.size(); ++c) {
    for (const auto& d : routes.consumer(c).params) out[c].emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
  }
  for (int g = 0; g < routes.num_groups(); ++g) {
    std::vector<std::vector<std::byte>> staging(holdings.size());
    for (uint32_t p = 0; p < holdings.size(); ++p) {
      SyntheticSource source(meta, shared, static_cast<int>(p), seed);
      source.set_version(version);
      FERRY_ASSIGN_OR_RETURN(auto boxes, source.materialize(g));
      staging[p].assign(routes.producers[p].groups[static_cast<size_t>(g)].staging_bytes, std::byte{0x5a});
      FERRY_RETURN_IF_ERROR(pack_group(routes, p, g, holdings[p], boxes, staging[p]));
    }
    for (size_t c = 0; c < out.size(); ++c) {
      const PlanGroup& pg = routes.consumer(c).groups[static_cast<size_t>(g)];
      std::vector<std::byte> recv(pg.recv_bytes, std::byte{0xa5});
      for (const Read& r : pg.reads) {
        if (r.length) std::memcpy(recv.data() + r.recv_offset, staging[r.producer].data() + r.offset, r.length);
      }
      FERRY_RETURN_IF_ERROR(unpack_group(routes.consumer(c), g, recv, out[c]));
    }
  }
  return out;
}

// The direct-load reference: the plan executed on the full synthetic tensors.
inline Result<TensorMap> direct_load(const Plan& plan, const std::vector<TensorDecl>& meta, uint64_t seed,
                                     uint64_t version) {
  TensorMap sources, params;
  for (const auto& d : meta) {
    if (plan.find_source(d.name)) sources.emplace(d.name, synthetic_tensor(seed, version, d));
  }
  for (const auto& d : plan.params()) params.emplace(d.name, Tensor::empty(d.shape, d.dtype, d.name));
  ExecuteOptions opt;
  opt.threads = 1;
  FERRY_RETURN_IF_ERROR(execute(plan, sources, params, opt));
  return params;
}

}  // namespace ferry::testing
