"""Delta syncs under a real optimizer (issue 28, docs/delta.md): a small Llama-shaped
torch model with bf16 parameters trained with Adam, synced after every step with
delta=True to two inference ranks (tp=2), every sync checked bit for bit against the
trainer's weights. Prints, per step, the fraction of bf16 elements the step changed (as
the producer counted it against what it sent last, and as torch counts it) and the bytes
that crossed against the dense bytes of the first sync.

  PYTHONPATH=build/python python3 bench/delta_adam.py [--steps 8] [--lr 1e-5] [--json]

Ranks are threads with the in-process transport (the bytes are what matter here, not the
time); the forward pass is a plain-torch stand-in for the model (embedding, per layer a
gated MLP and an attention-free token mix, RMSNorm, lm_head) over the HF tensors
themselves, so every tensor gets gradients.
"""
import argparse
import json
import os
import secrets
import threading

import torch

import ferry

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "vocab_size": 1024, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
TOKEN = os.environ.get("FERRY_TOKEN") or secrets.token_hex(16)


def rms_norm(x, weight, eps=1e-5):  # (torch 1.13 has no functional rms_norm)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Model(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        shapes = {n: tuple(d.shape) for n, d in ferry.ModelLoader(CONFIG).checkpoint.items()}
        self.names = sorted(shapes)
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(shapes[n], generator=gen) * 0.02).bfloat16()) for n in self.names])
        for n, p in zip(self.names, self.params):
            if n.endswith("norm.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
        self.by_name = dict(zip(self.names, self.params))

    def tensors(self):
        return {n: p.detach() for n, p in self.by_name.items()}

    def forward(self, ids):
        w = self.by_name
        h = w["model.embed_tokens.weight"][ids]
        for i in range(CONFIG["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = rms_norm(h, w[p + "input_layernorm.weight"])
            q = x @ w[p + "self_attn.q_proj.weight"].t()
            k = x @ w[p + "self_attn.k_proj.weight"].t()
            v = x @ w[p + "self_attn.v_proj.weight"].t()
            mix = torch.cumsum(v.repeat(1, 1, q.shape[-1] // v.shape[-1]) * torch.sigmoid(q), dim=1) / (
                1 + torch.arange(h.shape[1]).view(1, -1, 1)) + k.mean() * 0
            h = h + mix @ w[p + "self_attn.o_proj.weight"].t()
            x = rms_norm(h, w[p + "post_attention_layernorm.weight"])
            g = x @ w[p + "mlp.gate_proj.weight"].t()
            u = x @ w[p + "mlp.up_proj.weight"].t()
            h = h + (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].t()
        h = rms_norm(h, w["model.norm.weight"])
        return h @ w["lm_head.weight"].t()


class Source(ferry.WeightSource):
    def __init__(self, model):
        super().__init__(rank=0, world_size=1, layout="tp=1")
        self.model = model

    def metadata(self):
        return {n: (tuple(t.shape), torch.bfloat16) for n, t in self.model.tensors().items()}

    def materialize(self, group):
        t = self.model.tensors()
        out = {}
        for n, start, size in self.boxes(group):
            x = t[n]
            for dim, (s, k) in enumerate(zip(start, size)):
                x = x.narrow(dim, s, k)
            out[n] = x.contiguous()
        return out


def on_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i, f):
        try:
            results[i] = f()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.steps < 1 or not (a.lr > 0):
        raise SystemExit("--steps must be >= 1 and --lr > 0")
    torch.manual_seed(0)
    model = Model(1)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 64))
    server = ferry.StoreServer(host="127.0.0.1", port=0, token=TOKEN)
    loader = ferry.ModelLoader(CONFIG, "tp=2")
    source = Source(model)
    # (one host: delta_same_host, or the job would run without delta: rendezvous.h, delta_runs)
    common = dict(token=TOKEN, backend="inproc", job="delta-adam", timeout=60.0, delta=True, delta_same_host=True)
    made = on_threads([lambda: ferry.Producer(source, server.url, num_consumers=2, **common)] +
                      [lambda i=i: ferry.Consumer(loader=loader, rank=i, store=server.url, num_producers=1, **common)
                       for i in range(2)])
    producer, consumers = made[0], made[1:]
    rows = []
    dense = None
    before = {n: t.clone() for n, t in model.tensors().items()}
    for step in range(0, a.steps + 1):
        loss = None
        if step > 0:  # step 0: the initial weights (a dense sync: nothing kept yet)
            opt.zero_grad()
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
        now = model.tensors()
        changed = sum(int((now[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in now)
        total = sum(t.numel() for t in now.values())
        reports = on_threads([lambda: producer.sync(version=step + 1)] +
                             [lambda c=c: c.sync(version=step + 1) for c in consumers])
        assert all(r["ok"] for r in reports), [r.get("text") for r in reports]
        for i, c in enumerate(consumers):  # bit for bit: the loader's plan replayed on the trainer's weights
            expected = {n: torch.empty_like(t) for n, t in c.params().items()}
            loader.record_plan(i).replay(now, expected)
            for n, t in c.params().items():
                assert torch.equal(t.view(torch.int16), expected[n].view(torch.int16)), (step, i, n)
        p = reports[0]
        if dense is None:
            dense = p["bytes_sent"]
        row = {"step": step, "loss": float(loss) if loss is not None else None,
               "changed_fraction_torch": changed / total,
               "changed_fraction_seen": p["delta_changed"] / p["delta_elements"] if p["delta_elements"] else None,
               "bytes_sent": p["bytes_sent"], "patch_bytes": p["patch_bytes"], "dense_bytes": dense,
               "wire_ratio": p["bytes_sent"] / dense, "kept_copy": p["memory"]["kept_copy"],
               "patches_repaired": sum(r["patches_repaired"] for r in reports[1:])}
        rows.append(row)
        if not a.json:
            loss_text = "-" if row["loss"] is None else f"{row['loss']:.4f}"
            seen = "-" if row["changed_fraction_seen"] is None else f"{100 * row['changed_fraction_seen']:.3f}%"
            print(f"step {step}: loss {loss_text}, changed {100 * row['changed_fraction_torch']:.3f}% "
                  f"(producer saw {seen}), {row['bytes_sent']} bytes sent = {row['wire_ratio']:.4f} of dense "
                  f"({row['patch_bytes']} as patches), verified", flush=True)
        before = {n: t.clone() for n, t in now.items()}
    for x in [producer] + consumers:
        x.close()
    server.stop()
    if a.json:
        print(json.dumps({"lr": a.lr, "steps": a.steps, "config": CONFIG, "rows": rows}))


if __name__ == "__main__":
    main()
