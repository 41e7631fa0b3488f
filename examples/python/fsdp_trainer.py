"""Integrate with your stack: an FSDP trainer (docs/python.md, "Integrate with your stack").

FSDP2 (``fully_shard``) keeps every parameter as a DTensor sharded on dim 0; each rank's
``param.to_local()`` is a torch.chunk of the full tensor. ferry's ``layout="fsdp=N"``
describes exactly that, so a trainer rank serves its local shards as they are, and each
inference rank reads only the rows it keeps, fused and sharded for its own layout (here a
vLLM-style engine with tp=2, ferry's built-in Qwen3 loader), straight from the trainer
ranks that hold them: no all-gather on the trainer.

Run as is: two trainer ranks and two inference ranks as threads of this process, over
the in-process transport, three training steps, each synced and checked bit for bit. In
a real job each rank is its own process (``backend="ucx"``), trainer rank 0 runs the
StoreServer, and the shards are your model's own ``p.to_local()``."""
import threading

import torch

import ferry

CONFIG = {  # a small Qwen3 (the HF config.json of your model, as a dict or a path)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TRAINER_RANKS, ENGINE_TP = 2, 2


class FsdpRank(ferry.WeightSource):
    """One FSDP rank: serves its local shards (HF names, dim-0 chunks) where they lie."""

    def __init__(self, local_shards, rank, world_size):
        super().__init__(rank=rank, world_size=world_size, layout=f"fsdp={world_size}", model_config=CONFIG)
        self.local = local_shards  # {HF name: this rank's chunk}, updated in place by training
        self.full_shapes = {n: tuple(d.shape) for n, d in ferry.ModelLoader(CONFIG).checkpoint.items()}

    def metadata(self):
        return {n: (s, torch.bfloat16) for n, s in self.full_shapes.items()}

    def materialize(self, group):
        return {name: self.local[name] for name, _, _ in self.boxes(group)}


def run_threads(fns):
    out, errors = [None] * len(fns), []

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def main():
    gen = torch.Generator().manual_seed(0)
    full = {n: (0.02 * torch.randn(tuple(d.shape), generator=gen)).bfloat16()
            for n, d in sorted(ferry.ModelLoader(CONFIG).checkpoint.items())}
    # What fully_shard leaves on each rank: a dim-0 chunk of every parameter (views here).
    shards = [{n: t.chunk(TRAINER_RANKS, dim=0)[r] for n, t in full.items()} for r in range(TRAINER_RANKS)]
    loader = ferry.ModelLoader(CONFIG, f"tp={ENGINE_TP}")
    with ferry.StoreServer() as server:
        common = dict(backend="inproc", job="fsdp-example", timeout=20.0)
        made = run_threads(
            [lambda r=r: ferry.Producer(FsdpRank(shards[r], r, TRAINER_RANKS), server, num_consumers=ENGINE_TP,
                                        **common) for r in range(TRAINER_RANKS)] +
            [lambda r=r: ferry.Consumer(loader=loader, rank=r, store=server, num_producers=TRAINER_RANKS, **common)
             for r in range(ENGINE_TP)])
        trainers, engines = made[:TRAINER_RANKS], made[TRAINER_RANKS:]
        for step in range(1, 4):
            with torch.no_grad():  # the optimizer step: every rank updates its own shards in place
                for t in full.values():
                    t.add_(torch.full_like(t, 0.001 * step))
            reports = run_threads([lambda p=p: p.sync(step) for p in trainers] +
                                  [lambda c=c: c.sync(step) for c in engines])
            assert all(r["ok"] for r in reports), [r["text"] for r in reports]
            # Each engine rank holds what its loader makes of the full checkpoint, bit for bit.
            for r, engine in enumerate(engines):
                expect = {n: torch.zeros(tuple(d.shape), dtype=torch.bfloat16) for n, d in loader.params(r).items()}
                loader.record_plan(r).replay(full, expect)
                got = engine.params()
                for n, t in expect.items():
                    assert torch.equal(torch.as_tensor(got[n]).view(torch.bfloat16), t), (step, r, n)
            sent = sum(r["bytes_sent"] for r in reports[:TRAINER_RANKS])
            print(f"step {step}: {sent} bytes from {TRAINER_RANKS} FSDP ranks into {ENGINE_TP} tp ranks, verified")
        for x in trainers + engines:
            x.close()
    print("ok")


if __name__ == "__main__":
    main()
