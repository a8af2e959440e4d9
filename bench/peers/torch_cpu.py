#!/usr/bin/env python3
"""PyTorch CPU peer: times torch.nn.functional.scaled_dot_product_attention forward and
backward and writes JSON rows (one object per line) to OUT_DIR/torch_cpu.jsonl.

Usage: torch_cpu.py OUT_DIR [--seq 2048,4096] [--heads 4] [--dim 64,128] [--dtype f32,bf16]
                            [--causal both|yes|no] [--pass fwd,bwd] [--reps 5] [--batch 1]

FLOPs: forward 4*B*H*area*d (area = kept (q, k) pairs: N^2 full, N(N+1)/2 causal),
backward 2.5x forward. Backward time is one autograd backward of the SDPA output (the
forward is run outside the timed region).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seq", default="2048,4096,8192")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", default="64,128")
    ap.add_argument("--dtype", default="f32,bf16")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--pass", dest="passes", default="fwd,bwd")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    out_path = os.path.join(a.out_dir, "torch_cpu.jsonl")
    torch.manual_seed(0)
    with open(out_path, "a") as out:
        for n in [int(x) for x in a.seq.split(",")]:
            for d in [int(x) for x in a.dim.split(",")]:
                for causal in causals:
                    for dt in a.dtype.split(","):
                        # SDPA takes [batch, heads, seq, dim].
                        shape = (a.batch, a.heads, n, d)
                        q, k, v = (torch.randn(shape, dtype=dtypes[dt], requires_grad=True) for _ in range(3))
                        do = torch.randn(shape, dtype=dtypes[dt])
                        area = n * (n + 1) // 2 if causal else n * n
                        fwd_flops = 4.0 * a.batch * a.heads * area * d
                        for p in a.passes.split(","):
                            times = []
                            for _ in range(a.reps + 1):
                                if p == "fwd":
                                    with torch.no_grad():
                                        t = time.perf_counter()
                                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                        times.append(time.perf_counter() - t)
                                else:
                                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                    t = time.perf_counter()
                                    o.backward(do)
                                    times.append(time.perf_counter() - t)
                                    q.grad = k.grad = v.grad = None
                            times = times[1:]
                            flops = fwd_flops if p == "fwd" else 2.5 * fwd_flops
                            med = statistics.median(times)
                            row = {
                                "impl": "torch-cpu-sdpa", "pass": p, "causal": causal, "batch": a.batch,
                                "seq": n, "heads": a.heads, "head_dim": d, "dtype": dt,
                                "tflops": flops / med / 1e12, "tflops_best": flops / min(times) / 1e12,
                                "ms": med * 1e3, "threads": torch.get_num_threads(),
                                "torch": torch.__version__,
                            }
                            line = json.dumps(row)
                            print(line, flush=True)
                            out.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
