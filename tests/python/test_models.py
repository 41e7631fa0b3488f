"""The built-in C++ model loaders from Python, and a Python loader that agrees with them.

A plain-torch Llama loader recorded with ferry.record() must yield the same canonical
plan (same hash) as the C++ LlamaForCausalLM loader: two loaders that write the same
element map produce identical plans.
"""
import unittest

import torch

import ferry

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 200, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def torch_llama_loader(params, weights, rank, tp, cfg):
    """vLLM's Llama weight loading, in plain torch (names as the C++ loader's)."""
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] // tp
    kv = max(1, cfg["num_key_value_heads"] // tp)
    replicas = max(1, tp // cfg["num_key_value_heads"])
    for name, w in weights:
        if any(k in name for k in ("q_proj", "k_proj", "v_proj")):
            p = params[name.rsplit(".", 2)[0] + ".qkv_proj.weight"]
            if "q_proj" in name:
                off, size, start = 0, q * hd, rank * q * hd
            else:
                off = (q + (0 if "k_proj" in name else kv)) * hd
                size = kv * hd
                start = (rank // replicas) * size
            p.data.narrow(0, off, size).copy_(w.narrow(0, start, size))
        elif "gate_proj" in name or "up_proj" in name:
            p = params[name.rsplit(".", 2)[0] + ".gate_up_proj.weight"]
            shard = 0 if "gate_proj" in name else 1
            size = w.shape[0] // tp
            p.data[shard * size:(shard + 1) * size] = w[rank * size:(rank + 1) * size]
        elif "o_proj" in name or "down_proj" in name:
            p = params[name]
            cols = p.shape[1]
            p.data.copy_(w[:, rank * cols:(rank + 1) * cols])
        elif "embed_tokens" in name or "lm_head" in name:
            p = params[name]
            rows = p.shape[0]
            n = max(0, min(rows, w.shape[0] - rank * rows))
            p.data[:n].copy_(w[rank * rows:rank * rows + n])
            p.data[n:].zero_()
        else:
            params[name].data.copy_(w)


class ModelLoaderTest(unittest.TestCase):
    def test_architectures(self):
        archs = ferry.supported_architectures()
        self.assertIn("LlamaForCausalLM", archs)

    def test_plans_and_replicas(self):
        loader = ferry.ModelLoader(LLAMA, "tp=2,replicas=2")
        self.assertEqual(loader.world_size, 4)
        self.assertEqual(loader.architecture, "LlamaForCausalLM")
        self.assertIn("model.layers.1.self_attn.q_proj.weight", loader.checkpoint)
        self.assertIn("model.layers.1.self_attn.qkv_proj.weight", loader.params(1))
        self.assertEqual(loader.rank_info(3)["replica"], 1)
        p1, p3 = loader.record_plan(1), loader.record_plan(3)
        self.assertEqual(p1.hash(), p3.hash())  # rank 1 of every replica: one plan
        self.assertNotEqual(p1.hash(), loader.record_plan(0).hash())
        p1.check_coverage()

    def test_python_loader_matches_cpp_loader(self):
        for tp in (1, 2, 4):
            loader = ferry.ModelLoader(LLAMA, f"tp={tp}")
            for rank in range(tp):
                with self.subTest(tp=tp, rank=rank):
                    expected = loader.record_plan(rank)
                    params = {n: ferry.param(n, d.shape, d.dtype) for n, d in loader.params(rank).items()}
                    weights = [(n, ferry.source(n, d.shape, d.dtype)) for n, d in loader.checkpoint.items()]
                    with ferry.record() as plan:
                        torch_llama_loader(params, weights, rank, tp, LLAMA)
                    self.assertEqual(plan.hash(), expected.hash(), plan.dump() + "\n---\n" + expected.dump())
                    self.assertEqual(plan, expected)

    def test_replay_cpp_plan(self):
        loader = ferry.ModelLoader(LLAMA, "tp=2")
        plan = loader.record_plan(1)
        g = torch.Generator().manual_seed(0)
        ckpt = {n: torch.randn(d.shape, generator=g).to(getattr(torch, d.dtype)) for n, d in loader.checkpoint.items()}
        params = {n: torch.full(d.shape, 5.0, dtype=getattr(torch, d.dtype)) for n, d in loader.params(1).items()}
        plan.replay(ckpt, params)
        expected = {n: torch.full(d.shape, 5.0, dtype=getattr(torch, d.dtype)) for n, d in loader.params(1).items()}
        torch_llama_loader(expected, ckpt.items(), 1, 2, LLAMA)
        for n in expected:
            self.assertTrue(torch.equal(expected[n].view(torch.int16), params[n].view(torch.int16)), n)

    def test_mtp_layers_skipped_or_loaded_as_the_draft(self):
        # A DeepSeek-V3 checkpoint with one MTP layer (model.layers.2.* after 2 layers):
        # skip accepts it and loads nothing of it, draft loads it as vLLM's DeepSeekMTP.
        cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
               "first_k_dense_replace": 1, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 256,
               "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
               "vocab_size": 256, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
        none, skip, draft = (ferry.ModelLoader(cfg, "tp=2", mtp=m) for m in ("none", "skip", "draft"))
        mtp = [n for n in skip.checkpoint if n.startswith("model.layers.2.")]
        self.assertIn("model.layers.2.eh_proj.weight", mtp)
        self.assertFalse([n for n in none.checkpoint if n.startswith("model.layers.2.")])
        self.assertEqual(set(skip.params(0)), set(none.params(0)))
        extra = set(draft.params(0)) - set(skip.params(0))
        self.assertIn("model.layers.2.mtp_block.self_attn.o_proj.weight", extra)
        self.assertIn("model.layers.2.eh_proj.weight", extra)
        self.assertTrue(all(n.startswith("model.layers.2.") for n in extra), extra)
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.ModelLoader(cfg, "tp=2", mtp="maybe")

    def test_errors(self):
        with self.assertRaises(ferry.InvalidArgumentError) as cm:
            ferry.ModelLoader(dict(LLAMA, architectures=["NopeForCausalLM"]), "tp=2")
        self.assertIn("NopeForCausalLM", str(cm.exception))
        with self.assertRaises(ferry.InvalidArgumentError) as cm:
            ferry.ModelLoader(LLAMA, "tp=3")
        self.assertIn("tp", str(cm.exception))
        with self.assertRaises(ferry.InvalidArgumentError):
            ferry.ModelLoader(LLAMA, "tp=two")
        with self.assertRaises(ferry.Error):
            ferry.ModelLoader("/nonexistent/config.json")
        loader = ferry.ModelLoader(LLAMA, "tp=2")
        with self.assertRaises(IndexError):
            loader.record_plan(2)


if __name__ == "__main__":
    unittest.main()
