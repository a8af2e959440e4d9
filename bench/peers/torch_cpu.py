#!/usr/bin/env python3
"""PyTorch CPU peer: times torch.nn.functional.scaled_dot_product_attention forward and
backward and writes JSON rows (one object per line) to OUT_DIR/torch_cpu.jsonl.

Usage: torch_cpu.py OUT_DIR [--seq 2048,4096] [--heads 4] [--dim 64,128] [--dtype f32,bf16]
                            [--causal both|yes|no] [--pass fwd,bwd] [--reps 5] [--batch 1]
                            [--distattn PATH/TO/cpu_bench]

With --distattn, the distattn-cpu example binary runs as a server (`cpu_bench --serve`) and
every timed repetition alternates torch and distattn (ABBA order) on the same shapes, so
load from other processes on a shared machine falls on both alike; distattn rows go to
OUT_DIR/distattn_cpu.jsonl.

FLOPs: forward 4*B*H*area*d (area = kept (q, k) pairs: N^2 full, N(N+1)/2 causal),
backward 2.5x forward. Backward time is one autograd backward of the SDPA output (the
forward is run outside the timed region).
"""
import argparse
import json
import os
import statistics
import subprocess
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
    ap.add_argument("--distattn", default=None, help="path of the cpu_bench example binary")
    a = ap.parse_args()
    server = None
    if a.distattn:
        server = subprocess.Popen([a.distattn, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd):
        server.stdin.write(cmd + "\n")
        server.stdin.flush()
        reply = server.stdout.readline().strip()
        if not reply or reply.startswith("error"):
            raise RuntimeError(f"distattn server: {cmd!r} -> {reply!r}")
        return reply

    os.makedirs(a.out_dir, exist_ok=True)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    out_path = os.path.join(a.out_dir, "torch_cpu.jsonl")
    ours_path = os.path.join(a.out_dir, "distattn_cpu.jsonl")
    torch.manual_seed(0)
    with open(out_path, "a") as out, open(ours_path, "a") as ours_out:
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
                        if server:
                            ask(f"case {n} {a.heads} {d} {int(causal)} {dt} {a.batch}")
                        for p in a.passes.split(","):

                            def torch_rep():
                                if p == "fwd":
                                    with torch.no_grad():
                                        t = time.perf_counter()
                                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                        return time.perf_counter() - t
                                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                t = time.perf_counter()
                                o.backward(do)
                                dt_ = time.perf_counter() - t
                                q.grad = k.grad = v.grad = None
                                return dt_

                            times, ours = [], []
                            for rep in range(a.reps + 1):
                                if server and rep % 2 == 1:
                                    ours.append(float(ask(p)))
                                    times.append(torch_rep())
                                else:
                                    times.append(torch_rep())
                                    if server:
                                        ours.append(float(ask(p)))
                            flops = fwd_flops if p == "fwd" else 2.5 * fwd_flops
                            for name, ts, f in (("torch-cpu-sdpa", times, out), ("distattn-cpu", ours, ours_out)):
                                if not ts:
                                    continue
                                ts = ts[1:]  # warm-up
                                med = statistics.median(ts)
                                row = {
                                    "impl": name, "pass": p, "causal": causal, "batch": a.batch,
                                    "seq": n, "heads": a.heads, "head_dim": d, "dtype": dt,
                                    "tflops": flops / med / 1e12, "tflops_best": flops / min(ts) / 1e12,
                                    "ms": med * 1e3, "threads": torch.get_num_threads(),
                                    "torch": torch.__version__, "interleaved": server is not None,
                                }
                                line = json.dumps(row)
                                print(line, flush=True)
                                f.write(line + "\n")
                                f.flush()
    if server:
        server.stdin.write("quit\n")
        server.stdin.flush()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
