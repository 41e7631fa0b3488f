"""README, "Trainer -> inference sync", made concrete and run on one machine: two trainer
ranks (Megatron tp=2) and two inference ranks (tp=2), each a thread with its own
in-process transport, meeting through an embedded store server; two versions synced and
every inference rank checked against its recorded plan replayed on the full checkpoint.
In a real job each rank is its own process (backend="ucx", the default), rank 0 of the
trainer runs the StoreServer, and `model` is the trainer's own model."""
import os
import secrets
import threading

import torch

import ferry

CONFIG = {  # a small Llama (an HF config.json as a dict or a path)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
TOKEN = os.environ.get("FERRY_TOKEN") or secrets.token_hex(16)  # 16+ bytes; never a literal in real code


class ToyModel:
    """Stands in for the trainer's model: the full HF tensors of one version."""

    def __init__(self, version):
        gen = torch.Generator().manual_seed(version)
        shapes = {n: tuple(d.shape) for n, d in ferry.ModelLoader(CONFIG).checkpoint.items()}
        self.tensors = {n: torch.randn(s, generator=gen).bfloat16() for n, s in sorted(shapes.items())}

    def hf_shapes(self):
        return {n: tuple(t.shape) for n, t in self.tensors.items()}

    def hf_shard(self, name, start, size):
        t = self.tensors[name]
        for dim, (s, n) in enumerate(zip(start, size)):
            t = t.narrow(dim, s, n)
        return t.contiguous()


class MySource(ferry.WeightSource):                      # one per trainer rank
    def __init__(self, model, rank):
        super().__init__(rank=rank, world_size=2, layout="tp=2")   # Megatron TP=2: holdings computed
        self.model = model
    def metadata(self):                                  # every HF tensor: full shape, dtype
        return {n: (s, torch.bfloat16) for n, s in self.model.hf_shapes().items()}
    def materialize(self, group):                        # this rank's boxes of one layer group
        return {n: self.model.hf_shard(n, start, size) for n, start, size in self.boxes(group)}


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
    server = ferry.StoreServer(host="127.0.0.1", port=0, token=TOKEN)
    loader = ferry.ModelLoader(CONFIG, "tp=2")
    sources = [MySource(ToyModel(1), r) for r in range(2)]
    params = [{n: torch.empty(d.shape, dtype=getattr(torch, d.dtype)) for n, d in loader.params(i).items()}
              for i in range(2)]
    common = dict(token=TOKEN, backend="inproc", job="example", timeout=30.0)
    made = on_threads([lambda s=s: ferry.Producer(s, server.url, num_consumers=2, **common) for s in sources] +
                      [lambda i=i: ferry.Consumer(loader=loader, rank=i, store=server.url, params=params[i],
                                                  num_producers=2, **common) for i in range(2)])
    producers, consumers = made[:2], made[2:]
    for step in (1, 2):
        model = ToyModel(step)                           # the optimizer step
        for s in sources:
            s.model = model
        reports = on_threads([lambda p=p: p.sync(version=step) for p in producers] +
                             [lambda c=c: c.sync(version=step) for c in consumers])
        assert all(r["ok"] for r in reports), [r["text"] for r in reports]
        for i in range(2):                               # params now hold that version, bit for bit
            expected = {n: torch.empty_like(t) for n, t in params[i].items()}
            loader.record_plan(i).replay(model.tensors, expected)
            for n, t in params[i].items():
                assert torch.equal(t, expected[n]), (step, i, n)
        print(f"version {step}: {sum(r['bytes'] for r in reports[2:])} bytes to 2 inference ranks, verified")
    for x in producers + consumers:
        x.close()
    server.stop()
    print("ok")


if __name__ == "__main__":
    main()
