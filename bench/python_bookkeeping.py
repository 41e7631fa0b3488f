"""Python bookkeeping of a trainer rank per sync (ferry.WeightSource): holdings, groups and
boxes(group) for every group, on a model's HF metadata and a Megatron layout.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_bookkeeping.py \
        [--config configs/kimi-k2-instruct.json] [--layout tp=8,pp=16,ep=64] [--rank 0] [--syncs 3] [--fp8]

Prints the tensor count, the one-time setup (metadata, the layout's holdings) and the
seconds per sync of what a trainer's materialize() calls: boxes(g) for every group g
and group_of(name) for every box it returns.
"""
import argparse
import os
import time

import ferry

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class MetadataOnly(ferry.WeightSource):
    def __init__(self, decls, rank, world, layout, config):
        super().__init__(rank=rank, world_size=world, layout=layout, model_config=config)
        self.decls = decls

    def metadata(self):
        return self.decls  # {name: TensorDecl}

    def materialize(self, group):
        raise NotImplementedError


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "kimi-k2-instruct.json"))
    ap.add_argument("--layout", default="tp=8,pp=16,ep=64")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--fp8", action="store_true",
                    help="keep the config's FP8 quantization (adds a weight_scale_inv per weight); default: "
                         "the bf16 checkpoint a trainer holds")
    a = ap.parse_args()

    import json
    with open(a.config) as f:
        config = json.load(f)
    if not a.fp8:
        config.pop("quantization_config", None)
    decls = ferry.ModelLoader(config).checkpoint
    t0 = time.perf_counter()
    # The layout's world size: what the C++ helper derives (dp from tp*dp % (ep*etp)).
    probe = ferry._ferry._LayoutHoldings([], a.layout, 0, 0)
    src = MetadataOnly(decls, a.rank, probe.world_size, a.layout, config)
    src._metadata()
    t_meta = time.perf_counter() - t0
    t0 = time.perf_counter()
    held = src._ferry_holdings(a.rank)  # what Producer() asks once, at create
    t_hold = time.perf_counter() - t0
    per_sync = []
    boxes = 0
    for _ in range(a.syncs):
        t0 = time.perf_counter()
        groups = src.groups()
        boxes = 0
        for g in range(len(groups)):
            for name, _, _ in src.boxes(g):
                assert src.group_of(name) == g
                boxes += 1
        per_sync.append(time.perf_counter() - t0)
    assert boxes == len(held)
    print(f"{len(decls)} tensors, layout {a.layout} ({probe.world_size} ranks), rank {a.rank}: "
          f"{len(held)} boxes in {len(src.groups())} groups")
    print(f"setup (once): metadata {t_meta:.3f} s, holdings {t_hold:.3f} s")
    print(f"per sync: groups + boxes(g) for every group + group_of per box: "
          f"{min(per_sync):.4f} s (min of {a.syncs}), first {per_sync[0]:.4f} s")
    print(f"bookkeeping of the first sync in all (setup + first): {t_meta + t_hold + per_sync[0]:.3f} s")


if __name__ == "__main__":
    main()
