"""Bytes a LoRA adapter sync moves per inference rank against a full sync (docs/targets.md,
docs/RESULTS.md "Targets"): the full sync from ferry's built-in loader of llama-3.1-8b at tp=4,
the adapter (rank 16 on every linear layer) as vLLM shards it (column parallel: lora_A whole,
lora_B by rows; row parallel: lora_A by columns, lora_B whole).
Run: PYTHONPATH=build/python python3 scripts/lora_bytes.py"""
import json
import os

import numpy as np

import ferry

cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "llama-3.1-8b.json")))
tp, r = 4, 16
loader = ferry.ModelLoader(cfg, f"tp={tp}")
full = sum(int(np.prod(d.shape)) * 2 for d in loader.params(0).values())
H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
hd = H // nh
col = [(H, nh * hd), (H, nkv * hd), (H, nkv * hd), (H, I), (H, I)]   # q k v gate up: (in, out)
row = [(nh * hd, H), (I, H)]                                           # o down
whole = sum(r * (i + o) for i, o in col + row) * 2 * L
kept = (sum(r * i + o // tp * r for i, o in col) + sum(r * (i // tp) + o * r for i, o in row)) * 2 * L
print(f"llama-3.1-8b tp={tp}: full sync per rank {full/1e6:.1f} MB; rank-{r} LoRA on every linear: "
      f"{whole/1e6:.1f} MB whole, {kept/1e6:.2f} MB per rank ({kept/full:.4f} of the full per-rank bytes, 1/{full/kept:.0f})")
