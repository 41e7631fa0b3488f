"""torch's fp32 -> bf16 conversion on the size bench_plan_replay's BM_ConvertF32ToBf16
converts (64 Mi elements, 256 MiB read), single thread and all threads, in GB/s of bytes
read: the figure ferry's host conversion is compared with (issue 29).

    python3 bench/convert_vs_torch.py      # after build/bench/bench_plan_replay, same machine
"""
import time

import torch

N = 64 << 20
ALL_THREADS = torch.get_num_threads()  # before rate() sets it


def rate(threads, reps=5):
    torch.set_num_threads(threads)
    src = (torch.arange(N, dtype=torch.float32) % 9973) * 0.37 - 1000.0
    out = torch.empty(N, dtype=torch.bfloat16)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        out.copy_(src)  # what .to(torch.bfloat16) does, into memory already faulted in
        best.append(time.perf_counter() - t)
    best.sort()
    return N * 4 / best[len(best) // 2] / 1e9


for threads in sorted({1, ALL_THREADS}):
    print(f"torch fp32->bf16, {threads} thread(s): {rate(threads):.2f} GB/s (median of 5)")
