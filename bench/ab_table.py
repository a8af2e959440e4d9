#!/usr/bin/env python3
"""Table of bench/gpu_ab.sh's results: ab_table.py OUTDIR REPEATS.

Per grid cell and pass: A's and B's median over the repeats of their per-run medians (CUDA
events), the spread of each side (max/min over repeats), and B/A; with Nsight Compute files,
the per-pass kernel time of each side (the median launch of each kernel, summed over the
kernels of the pass) and B/A, only where the run had one head dim and length (the Nsight Compute
launches are split by pass and mask alone). Writes OUTDIR/ab.json."""
import csv
import json
import os
import statistics
import sys


def events(out, side, repeats):
    cells = {}
    for i in range(1, repeats + 1):
        path = os.path.join(out, f"{side}-{i}.json")
        if not os.path.exists(path):
            continue
        for r in json.load(open(path)):
            key = (r["head_dim"], r["seq"], r["causal"], r["pass"])
            cells.setdefault(key, []).append(r["ms"])
    return cells


def ncu(out, side):
    """Per (causal, pass): sum over kernels of the median duration (ms). The benchmark runs the
    full mask first, then causal; each pass's launches split in two halves in launch order."""
    path = os.path.join(out, f"{side}-ncu.csv")
    if not os.path.exists(path):
        return {}
    lines = [l for l in open(path) if l.startswith('"')]
    launches = []  # (kernel, ms) in launch order
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            launches.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) / 1e6))
    by_pass = {"fwd": [], "bwd": []}
    for name, ms in launches:
        if name.startswith("rand") or name.startswith("cast"):
            continue
        by_pass["fwd" if "fwd" in name else "bwd"].append((name, ms))
    res = {}
    for p, lst in by_pass.items():
        half = len(lst) // 2
        for causal, part in ((False, lst[:half]), (True, lst[half:])):
            per_kernel = {}
            for name, ms in part:
                per_kernel.setdefault(name, []).append(ms)
            res[(causal, p)] = {k: statistics.median(v) for k, v in per_kernel.items()}
    return res


def main():
    out, repeats = sys.argv[1], int(sys.argv[2])
    a, b = events(out, "a", repeats), events(out, "b", repeats)
    na, nb = ncu(out, "a"), ncu(out, "b")
    if len({(d, seq) for d, seq, _, _ in a}) > 1:
        if na or nb:
            print("(Nsight Compute columns left out: the run had several head dims or lengths)")
        na, nb = {}, {}
    rows = []
    print(f"{'d':>4} {'seq':>6} {'causal':>6} {'pass':>4} | {'A ms':>8} {'spread':>6} | {'B ms':>8} {'spread':>6} | "
          f"{'B/A':>6} | {'A ncu':>8} {'B ncu':>8} {'B/A':>6}")
    for key in sorted(a):
        d, seq, causal, p = key
        if key not in b:
            continue
        ma, mb = statistics.median(a[key]), statistics.median(b[key])
        sa, sb = max(a[key]) / min(a[key]), max(b[key]) / min(b[key])
        ka = sum(na.get((causal, p), {}).values()) or None
        kb = sum(nb.get((causal, p), {}).values()) or None
        kr = kb / ka if ka and kb else None
        print(f"{d:>4} {seq:>6} {str(causal):>6} {p:>4} | {ma:8.3f} {sa:6.3f} | {mb:8.3f} {sb:6.3f} | {mb / ma:6.3f} | "
              f"{ka or 0:8.3f} {kb or 0:8.3f} {kr or 0:6.3f}")
        rows.append({"head_dim": d, "seq": seq, "causal": causal, "pass": p, "a_ms": a[key], "b_ms": b[key],
                     "b_over_a": mb / ma, "a_ncu_kernels_ms": na.get((causal, p)), "b_ncu_kernels_ms": nb.get((causal, p)),
                     "ncu_b_over_a": kr})
    json.dump({"rows": rows}, open(os.path.join(out, "ab.json"), "w"), indent=1)


main()
