"""Integrate with your stack: a vLLM-style inference worker (docs/python.md, "Integrate
with your stack").

RL frameworks reach vLLM's workers through a worker extension (``worker_extension_cls``,
called by ``collective_rpc``): ``init_weight_transfer`` once, then ``update_weights``
after every training step. With ferry the extension needs no loader written for it: it
records the model's own ``load_weights`` once (``ferry.record_load``), and every sync
writes the new weights straight into the model's parameters, already fused (``qkv_proj``,
``gate_up_proj``) and sharded for this rank. ``commit="shadow"`` keeps the model serving
the old weights while the new ones land, and makes them live between two forward passes
(the ``before_commit``/``after_commit`` hooks take the lock the forward pass holds).

Run as is: one trainer rank (an HF state dict) and a tp=2 engine, each rank a thread;
a serving thread per engine rank runs "forward passes" throughout; three steps, each
checked bit for bit against the module's own ``load_weights`` and against mixed reads."""
import threading

import torch

import ferry

H, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS, TP = 64, 4, 2, 16, 128, 256, 2, 2


# --- the engine's model, vLLM style (what your engine already has) -------------------------

def sharded_loader(dim):
    """A weight_loader taking this rank's slice of a checkpoint tensor along `dim`."""
    def load(param, w, rank, tp):
        n = param.shape[dim]
        param.data.copy_(w.narrow(dim, rank * n, n))
    return load


class ParallelModel(torch.nn.Module):
    """A Qwen3-like decoder's parameters as a vLLM worker at tp rank `rank` holds them."""

    STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        q, kv = HEADS // TP * HEAD_DIM, KV_HEADS // TP * HEAD_DIM
        shapes = {"model.embed_tokens.weight": (VOCAB // TP, H), "model.norm.weight": (H,),
                  "lm_head.weight": (VOCAB // TP, H)}
        for i in range(LAYERS):
            n = f"model.layers.{i}."
            shapes.update({n + "input_layernorm.weight": (H,), n + "post_attention_layernorm.weight": (H,),
                           n + "self_attn.qkv_proj.weight": (q + 2 * kv, H),
                           n + "self_attn.o_proj.weight": (H, HEADS // TP * HEAD_DIM),
                           n + "mlp.gate_up_proj.weight": (2 * INTER // TP, H),
                           n + "mlp.down_proj.weight": (H, INTER // TP)})
        for name, shape in shapes.items():  # (submodules as the dotted names say)
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16),
                                                               requires_grad=False))

    def load_weights(self, weights):
        """vLLM's load_weights: stacked params by shard id, the rest by their own loader."""
        q, kv = HEADS // TP * HEAD_DIM, KV_HEADS // TP * HEAD_DIM
        params = dict(self.named_parameters())
        for name, w in weights:
            for fused, part, shard in self.STACKED:
                if f".{part}." not in name:
                    continue
                param = params[name.replace(part, fused)]
                if shard in ("q", "k", "v"):
                    rows, at = {"q": (q, 0), "k": (kv, q), "v": (kv, q + kv)}[shard]
                else:
                    rows, at = INTER // TP, shard * INTER // TP
                param.data[at:at + rows].copy_(w.narrow(0, self.rank * rows, rows))
                break
            else:
                param = params[name]
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    sharded_loader(1)(param, w, self.rank, TP)        # row parallel
                elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    sharded_loader(0)(param, w, self.rank, TP)        # vocab parallel
                else:
                    param.data.copy_(w)                               # replicated


def hf_shapes():
    out = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(LAYERS):
        n = f"model.layers.{i}."
        out.update({n + "input_layernorm.weight": (H,), n + "post_attention_layernorm.weight": (H,),
                    n + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
                    n + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
                    n + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
                    n + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
                    n + "mlp.gate_proj.weight": (INTER, H), n + "mlp.up_proj.weight": (INTER, H),
                    n + "mlp.down_proj.weight": (H, INTER)})
    return {name: (shape, torch.bfloat16) for name, shape in out.items()}


# --- the worker extension: what ferry adds to the worker ------------------------------------

class FerryWorkerExtension:
    """Mixed into the worker (vLLM: ``worker_extension_cls``); the RL framework calls
    ``init_weight_transfer`` once and ``update_weights`` each step, on every worker."""

    def init_weight_transfer(self, store, rank, num_producers, job, **engine_kw):
        self.serving_lock = threading.Lock()  # held by every forward pass (execute_model)
        plan = ferry.record_load(self.model, hf_shapes())  # the model's own load_weights, recorded
        self.ferry = ferry.Consumer(plan=plan, params=self.model, rank=rank, store=store, num_consumers=TP,
                                    num_producers=num_producers, job=job, commit="shadow",
                                    before_commit=lambda v: self.serving_lock.acquire(),
                                    after_commit=lambda v: self.serving_lock.release(), **engine_kw)

    def update_weights(self, version):
        return self.ferry.sync(version)  # the old weights serve until the commit


class Worker(FerryWorkerExtension):
    def __init__(self, rank):
        self.model = ParallelModel(rank)

    def execute_model(self):
        """A forward pass: reads every weight under the serving lock."""
        with self.serving_lock:
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}


# --- a trainer rank: the full HF state dict (see fsdp_trainer.py / megatron_moe_trainer.py) ---

class Trainer(ferry.WeightSource):
    def __init__(self):
        super().__init__(rank=0, world_size=1)
        self.state = {}

    def metadata(self):
        return hf_shapes()

    def materialize(self, group):
        return {name: self.state[name] for name, _, _ in self.boxes(group)}


def state_at(step):
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=gen).bfloat16() for n, (s, _) in sorted(hf_shapes().items())}


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
    trainer = Trainer()
    workers = [Worker(r) for r in range(TP)]
    # What each version looks like on each rank: the module's own load_weights.
    expected = {}
    for step in range(4):
        for r in range(TP):
            ref = ParallelModel(r)
            if step:
                ref.load_weights(state_at(step).items())
            expected[step, r] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with ferry.StoreServer() as server:
        common = dict(backend="inproc", job="vllm-worker", timeout=20.0)
        run_threads([lambda: setattr(trainer, "producer", ferry.Producer(trainer, server, num_consumers=TP, **common))] +
                    [lambda w=w, r=r: w.init_weight_transfer(server, r, 1, **common) for r, w in enumerate(workers)])
        stop, mixed, passes = threading.Event(), [0] * TP, [0] * TP

        def serve(r):  # a forward pass sees one version, whole, whenever it runs
            for _ in range(20000):
                if stop.is_set():
                    return
                seen = workers[r].execute_model()
                if not any(all(torch.equal(seen[n], t) for n, t in expected[s, r].items()) for s in range(4)):
                    mixed[r] += 1
                passes[r] += 1

        servers = [threading.Thread(target=serve, args=(r,)) for r in range(TP)]
        for t in servers:
            t.start()
        try:
            for step in range(1, 4):
                trainer.state = state_at(step)  # the training step's new weights
                reports = run_threads([lambda: trainer.producer.sync(step)] +
                                      [lambda w=w: w.update_weights(step) for w in workers])
                assert all(r["ok"] for r in reports), [r["text"] for r in reports]
                for r, w in enumerate(workers):
                    for n, p in w.model.named_parameters():
                        assert torch.equal(p.detach(), expected[step, r][n]), (step, r, n)
                pause = max(r["commit_seconds"] for r in reports[1:])
                print(f"step {step}: {reports[0]['bytes_sent']} bytes into {TP} workers, "
                      f"live after a {pause * 1e3:.2f} ms pause, equal to load_weights")
        finally:
            stop.set()
            for t in servers:
                t.join(60)
        assert mixed == [0] * TP, f"forward passes that saw a mix of versions: {mixed} of {passes}"
        print(f"{sum(passes)} forward passes during the syncs, none saw a mix of versions")
        trainer.producer.close()
        for w in workers:
            w.ferry.close()
    print("ok")


if __name__ == "__main__":
    main()
