"""Integrate with your stack: an SGLang-style engine with speculative decoding and LoRA
(docs/python.md, "Integrate with your stack"; docs/targets.md).

An SGLang engine serves a target model, a draft model for speculative decoding (EAGLE,
MTP) and LoRA adapters. RL updates all three, each at its own pace, and each goes stale
in its own way: a draft left behind the policy drops the acceptance length to about 1.0
with no error (sglang#31674); an adapter the trainer never re-exported looks like a
healthy sync (verl#7495). With ferry each is a *target* of one job:

  * the policy (the job itself) and the draft (``target="draft"``), each a Producer on
    the trainer and a Consumer per engine rank, with its own versions;
  * the adapter in ``ferry.AdapterSlots``: only its weights move, into a slot no request
    holds, switched on every rank at once under a versioned name ("math@3"), the old one
    serving if any rank fails;
  * ``checksums=True``: every report says ``unchanged`` when a target's weights did not
    change, on the trainer and on the engine.

Run as is: one trainer rank and a tp=2 engine, every rank a thread; four steps. The
policy moves every step; the draft at steps 1 and 3, and at step 4 with its weights
unchanged (reported); the adapter every step, unchanged at step 2 (kept as "math@1")."""
import threading

import numpy as np
import torch

import ferry

POLICY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16"}
DRAFT = dict(POLICY, num_hidden_layers=1)  # a one-layer draft (EAGLE-style) of the same vocabulary
TP, LORA_RANK = 2, 8


class HFRank(ferry.WeightSource):
    """A trainer rank serving one target's full HF tensors (one rank: it holds them all)."""

    def __init__(self, shapes, dtype):
        super().__init__(rank=0, world_size=1)
        self.shapes, self.dtype, self.state = shapes, dtype, {}

    def metadata(self):
        return {n: (s, self.dtype) for n, s in self.shapes.items()}

    def materialize(self, group):
        return {name: self.state[name] for name, _, _ in self.boxes(group)}


def checkpoint(shapes, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return {n: (0.02 * torch.randn(s, generator=gen)).to(dtype) for n, s in sorted(shapes.items())}


def lora_shapes():
    """PEFT names of a rank-8 LoRA on every q_proj and v_proj of the policy."""
    H, out = POLICY["hidden_size"], {}
    for i in range(POLICY["num_hidden_layers"]):
        for proj, rows in (("q_proj", 4 * 32), ("v_proj", 2 * 32)):
            base = f"base_model.model.model.layers.{i}.self_attn.{proj}."
            out[base + "lora_A.weight"] = (LORA_RANK, H)
            out[base + "lora_B.weight"] = (rows, LORA_RANK)
    return out


def lora_plan(rank):
    """The engine's LoRA loader at tp rank `rank` (column parallel: lora_A whole, lora_B by rows), recorded."""
    with ferry.record() as plan:
        for name, shape in lora_shapes().items():
            src = ferry.source(name, shape, "float32")
            if "lora_B" in name:
                rows = shape[0] // TP
                ferry.param(name, (rows, shape[1]), "float32").copy_(src[rank * rows:(rank + 1) * rows])
            else:
                ferry.param(name, shape, "float32").copy_(src)
    return plan


class EngineRank:
    """One tp rank of the engine: the policy, the draft and the adapter slots."""

    def __init__(self, rank, server, **common):
        self.policy = ferry.Consumer(POLICY, f"tp={TP}", rank=rank, store=server, **common)
        self.draft = ferry.Consumer(DRAFT, f"tp={TP}", rank=rank, store=server, target="draft", **common)
        self.adapters = ferry.AdapterSlots(lora_plan(rank), rank=rank, store=server, adapter="math",
                                           num_consumers=TP, **common)

    def update(self, target, version):  # what the framework calls per target
        return {"policy": self.policy, "draft": self.draft, "lora": self.adapters}[target].sync(version)


def check_adapter(engine, r, step):
    """What a request sees: the serving adapter, whole (version 2 never served: kept as 1)."""
    with engine.adapters.acquire() as lease:
        want = checkpoint(lora_shapes(), 100 + lease.version, torch.float32)
        for n, view in lease.params().items():  # (each view holds the slot too, until it is gone)
            w = want[n].numpy()
            if "lora_B" in n:
                w = w[r * view.shape[0]:(r + 1) * view.shape[0]]
            assert np.array_equal(view, w), (step, r, n)


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
    shapes = {n: tuple(d.shape) for n, d in ferry.ModelLoader(POLICY).checkpoint.items()}
    draft_shapes = {n: tuple(d.shape) for n, d in ferry.ModelLoader(DRAFT).checkpoint.items()}
    policy_src, draft_src = HFRank(shapes, torch.bfloat16), HFRank(draft_shapes, torch.bfloat16)
    lora_src = HFRank(lora_shapes(), torch.float32)
    with ferry.StoreServer() as server:
        common = dict(backend="inproc", job="sglang", timeout=20.0, checksums=True)
        made = run_threads(
            [lambda: ferry.Producer(policy_src, server, num_consumers=TP, **common),
             lambda: ferry.Producer(draft_src, server, num_consumers=TP, target="draft", **common),
             lambda: ferry.Producer(lora_src, server, num_consumers=TP, target="lora-math", **common)] +
            [lambda r=r: EngineRank(r, server, **common) for r in range(TP)])
        (policy, draft, lora), engines = made[:3], made[3:]
        draft_version = 0
        # step: (draft weights or None: not synced this step, adapter weights)
        plan = {1: (1, 1), 2: (None, 1), 3: (3, 3), 4: (3, 4)}
        for step, (draft_weights, lora_weights) in plan.items():
            policy_src.state = checkpoint(shapes, step)
            lora_src.state = checkpoint(lora_shapes(), 100 + lora_weights, torch.float32)
            jobs = [lambda: policy.sync(step)] + [lambda e=e: e.update("policy", step) for e in engines]
            jobs += [lambda: lora.sync(step)] + [lambda e=e: e.update("lora", step) for e in engines]
            if draft_weights is not None:
                draft_version += 1
                draft_src.state = checkpoint(draft_shapes, 1000 + draft_weights)
                jobs += [lambda v=draft_version: draft.sync(v)] + \
                        [lambda e=e, v=draft_version: e.update("draft", v) for e in engines]
            out = run_threads(jobs)
            reports = out[:2 + TP] + [o["report"] for o in out[2 + TP:2 + 2 * TP]] + out[2 + 2 * TP:]
            assert all(r["ok"] for r in reports), [r["text"] for r in reports]
            switched = out[2 + TP:2 + 2 * TP]
            assert len({s["serving"] for s in switched}) == 1  # every rank serves one adapter version
            policy_bytes, lora_bytes = out[0]["bytes_sent"], out[1 + TP]["bytes_sent"]
            line = (f"step {step}: policy {step} ({policy_bytes} bytes); adapter {switched[0]['decision']} -> "
                    f"{switched[0]['serving']} ({lora_bytes} bytes, {lora_bytes / policy_bytes:.3f} of the policy's)")
            if draft_weights is not None:
                trainer_said = out[2 + 2 * TP]["unchanged"]
                line += f"; draft version {draft_version}" + (" (unchanged: the trainer is told)" if trainer_said else "")
                assert bool(trainer_said) == (draft_version == 3), out[2 + 2 * TP]
            print(line)
            # The engine's three targets hold what they should, bit for bit.
            for r, e in enumerate(engines):
                loader = ferry.ModelLoader(POLICY, f"tp={TP}")
                expect = {n: torch.zeros(tuple(d.shape), dtype=torch.bfloat16) for n, d in loader.params(r).items()}
                loader.record_plan(r).replay(policy_src.state, expect)
                got = e.policy.params()
                assert all(torch.equal(torch.as_tensor(got[n]).view(torch.bfloat16), t) for n, t in expect.items())
                check_adapter(e, r, step)
        assert engines[0].adapters.acquire().name == "math@4"
        versions = ferry.committed_versions(server, TP, job="sglang", target="draft")
        assert versions == [3, 3], versions
        print(f"draft versions on the engine ranks: {versions}; policy: "
              f"{ferry.committed_versions(server, TP, job='sglang')}")
        for e in engines:
            e.policy.close(), e.draft.close(), e.adapters.close()
        for p in (policy, draft, lora):
            p.close()
    print("ok")


if __name__ == "__main__":
    main()
