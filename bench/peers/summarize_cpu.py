#!/usr/bin/env python3
"""GFLOP/s per case (median of the interleaved reps; best rep in brackets), ours vs torch, as markdown."""
import json
import os
import statistics
import sys
from collections import defaultdict

out = sys.argv[1]
vals = defaultdict(list)
for name in ("distattn_cpu.jsonl", "torch_cpu.jsonl"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    for line in open(path):
        r = json.loads(line)
        key = (r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seq"], r["heads"], r["batch"])
        vals[(key, r["impl"].startswith("distattn"))].append((r["tflops"] * 1e3, r.get("tflops_best", r["tflops"]) * 1e3))
keys = sorted({k for k, _ in vals}, key=lambda k: (k[0] != "fwd", k[1], k[2], k[3], k[4]))
print("| pass | dtype | d | causal | seq | heads | distattn GFLOP/s median [best] | torch GFLOP/s median [best] | ratio median [best] |")
print("|---|---|---|---|---|---|---|---|---|")
for k in keys:
    ours, theirs = vals.get((k, True), []), vals.get((k, False), [])
    nan = float("nan")
    mo = statistics.median(x[0] for x in ours) if ours else nan
    bo = max(x[1] for x in ours) if ours else nan
    mt = statistics.median(x[0] for x in theirs) if theirs else nan
    bt = max(x[1] for x in theirs) if theirs else nan
    print(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | {k[4]} | {k[5]} | {mo:.1f} [{bo:.1f}] | {mt:.1f} [{bt:.1f}] | {mo / mt:.2f}x [{bo / bt:.2f}x] |")
