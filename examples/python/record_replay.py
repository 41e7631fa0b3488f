"""README, "Inference engine": record your own torch loader once per rank layout, replay
it on every load. The README's code as written, then a check that the replay loaded what
the loader itself loads on real tensors."""
import torch, ferry

def load_weights(params, weights, rank, tp):          # your loader, plain torch
    for name, w in weights:
        p = params[name]
        if name.endswith("o_proj.weight"):              # row parallel
            p.data.copy_(w.narrow(1, rank * p.shape[1], p.shape[1]))
        elif name.endswith("q_proj.weight"):            # column parallel
            p.data.copy_(w[rank * p.shape[0]:(rank + 1) * p.shape[0]])
        else:
            p.data.copy_(w)

ckpt_shapes  = {"l0.q_proj.weight": (64, 64), "l0.o_proj.weight": (64, 64), "norm.weight": (64,)}
param_shapes = {"l0.q_proj.weight": (32, 64), "l0.o_proj.weight": (64, 32), "norm.weight": (64,)}
rank, tp = 1, 2

with ferry.record() as plan:                             # same code, recording tensors
    load_weights({n: ferry.param(n, s, torch.bfloat16) for n, s in param_shapes.items()},
                 [(n, ferry.source(n, s, torch.bfloat16)) for n, s in ckpt_shapes.items()], rank, tp)
plan.check_coverage()
blob = plan.to_bytes()                                   # ferry.Plan.from_bytes(blob); plan.hash()

checkpoint = {n: torch.randn(s).bfloat16() for n, s in ckpt_shapes.items()}
params = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in param_shapes.items()}
plan.replay(checkpoint, params)                          # in place, zero-copy, GIL released

# Not in the README: the same loader on real tensors gives the same params, bit for bit,
# and so does the plan decoded from its bytes.
direct = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in param_shapes.items()}
load_weights(direct, list(checkpoint.items()), rank, tp)
again = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in param_shapes.items()}
ferry.Plan.from_bytes(blob).replay(checkpoint, again)
for n in param_shapes:
    assert torch.equal(params[n], direct[n]), n
    assert torch.equal(again[n], direct[n]), n
print(f"ferry {ferry.__version__}: replayed plan {plan.hash()} matches the loader on {len(params)} params")
print("ok")
