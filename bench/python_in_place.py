"""Serving a torch trainer's tensors in place against staging them (issue 46): one
Python trainer rank (tp=1, every tensor contiguous in the trainer's own storage) and two
inference ranks (tp=2) as threads of this process over UCX, `in_place=False` (the
default: every byte packed into the staging ring) and `in_place=True` (contiguous boxes
read straight from the torch storage), synced one after the other in one run, every sync
checked bit for bit against the trainer's tensors.

  PYTHONPATH=build/python python3 bench/python_in_place.py [--syncs 5] [--layers 8] [--tls sm,tcp,self] [--json]

Prints, per setting, the median wall seconds of a sync (every rank's sync() returned) and
the share of the bytes served in place.
"""
import argparse
import json
import os
import secrets
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import ferry

TOKEN = os.environ.get("FERRY_TOKEN") or secrets.token_hex(16)


def config(layers):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
            "intermediate_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
            "num_hidden_layers": layers, "vocab_size": 16000, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


class Trainer(ferry.WeightSource):
    """The whole model on one rank, in torch tensors it owns (the trainer's parameters)."""

    def __init__(self, cfg):
        super().__init__(rank=0, world_size=1, layout="tp=1")
        gen = torch.Generator().manual_seed(1)
        self.tensors = {n: torch.randn(tuple(d.shape), generator=gen).bfloat16()
                        for n, d in ferry.ModelLoader(cfg).checkpoint.items()}

    def metadata(self):
        return {n: (tuple(t.shape), torch.bfloat16) for n, t in self.tensors.items()}

    def materialize(self, group):
        out = {}
        for n, start, size in self.boxes(group):
            x = self.tensors[n]
            for dim, (s, k) in enumerate(zip(start, size)):
                x = x.narrow(dim, s, k)
            out[n] = x  # a view: served in place where contiguous (in_place=True)
        return out

    def step(self):  # a new version: every element changes, in place (the promise in_place asks)
        with torch.no_grad():
            for t in self.tensors.values():
                t.add_(1.0)


def on_threads(fns):
    """Every function on a thread of its own (ranks meet each other); results in order."""
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def run(cfg, in_place, syncs, tls):
    trainer = Trainer(cfg)
    loader = ferry.ModelLoader(cfg, "tp=2")
    server = ferry.StoreServer(host="127.0.0.1", port=0, token=TOKEN)
    job = f"inplace-{int(in_place)}"
    common = dict(token=TOKEN, backend="ucx", job=job, timeout=60.0, transport_params={"tls": tls})
    made = on_threads([lambda: ferry.Producer(trainer, server.url, num_consumers=2, in_place=in_place, **common)] +
                      [lambda i=i: ferry.Consumer(loader=loader, rank=i, store=server.url, num_producers=1, **common)
                       for i in range(2)])
    producer, consumers = made[0], made[1:]
    plans = [loader.record_plan(r) for r in range(2)]
    seconds, shares = [], []
    try:
        for v in range(1, syncs + 2):  # the first: connections and first touches, not counted
            trainer.step()
            t0 = time.perf_counter()
            reports = on_threads([lambda: producer.sync(v)] + [lambda c=c: c.sync(v) for c in consumers])
            dt = time.perf_counter() - t0
            assert all(r["ok"] for r in reports), [r["text"] for r in reports]
            # Bit for bit: each inference rank's params against its loader's plan replayed on
            # the trainer's tensors (the fused, sharded params a direct load makes).
            for r, c in enumerate(consumers):
                want = {n: torch.zeros(tuple(d.shape), dtype=torch.bfloat16) for n, d in loader.params(r).items()}
                plans[r].replay(trainer.tensors, want)
                got = c.params()
                for name, t in want.items():
                    assert torch.equal(got[name], t), (r, name)
            if v > 1:
                seconds.append(dt)
                shares.append(reports[0]["sent_in_place"] / max(1, reports[0]["bytes_sent"]))
    finally:
        for x in made:
            x.close()
        server.stop()
    return {"in_place": in_place, "median_seconds": statistics.median(seconds), "seconds": seconds,
            "in_place_share": statistics.median(shares),
            "bytes": sum(t.numel() * t.element_size() for t in trainer.tensors.values())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tls", default=os.environ.get("FERRY_UCX_TLS", "sm,tcp,self"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.syncs < 1 or a.layers < 1:
        raise SystemExit("--syncs and --layers must be >= 1")
    cfg = config(a.layers)
    rows = [run(cfg, False, a.syncs, a.tls), run(cfg, True, a.syncs, a.tls)]
    if a.json:
        print(json.dumps({"tls": a.tls, "runs": rows}))
        return
    print(f"model {rows[0]['bytes'] / 1e6:.1f} MB, trainer tp=1 -> inference tp=2, UCX_TLS={a.tls}, "
          f"median of {a.syncs} syncs, every one verified")
    for r in rows:
        print(f"  in_place={str(r['in_place']):5}  {r['median_seconds']:.4f} s  (in place: {100 * r['in_place_share']:.0f}% "
              f"of the bytes; syncs {', '.join(f'{s:.4f}' for s in r['seconds'])})")
    print(f"  in_place=True / in_place=False: {rows[1]['median_seconds'] / rows[0]['median_seconds']:.2f}")


if __name__ == "__main__":
    main()
