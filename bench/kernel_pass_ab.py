#!/usr/bin/env python3
"""Table of two sides' kernel passes (bench/gpu_kernel_ab.sh): kernel_pass_ab.py OUTDIR A B.

Reads OUTDIR/A-r1, A-r2, ... and OUTDIR/B-r1, ... (each a `prefill_bench.py --kernel-pass` run
under Nsight Compute: kernel_pass.json and ncu.csv or ncu.csv.gz) and prints, per (case,
implementation, pass), each side's kernel time (the sum of the durations of every kernel of the
call, ms) averaged over its rounds, B / A, B / A per round, and the kernels A ran; writes the
table to OUTDIR/A-vs-B.md. Needs no torch."""

import json
import os
import re
import statistics
import sys

from ncu_report import kernels_per_call


def rounds(out, side):
    """The side's round folders, in round order."""
    found = []
    for name in os.listdir(out):
        m = re.fullmatch(re.escape(side) + r"-r(\d+)", name)
        if m:
            found.append((int(m.group(1)), os.path.join(out, name)))
    return [path for _, path in sorted(found)]


def kernel_times(run):
    """{(case, impl, pass): (ms, kernel names)} of one kernel-pass run."""
    order = [tuple(o) for o in json.load(open(os.path.join(run, "kernel_pass.json")))]
    csv_path = next(p for p in (os.path.join(run, f) for f in ("ncu.csv", "ncu.csv.gz")) if os.path.exists(p))
    calls = kernels_per_call(csv_path, len(order))
    if len(calls) != len(order):
        sys.exit(f"{run}: {len(order)} calls listed, {len(calls)} marked in the report")
    return {key: (sum(ns for _, ns in ks) / 1e6, sorted({k.split("(")[0] for k, _ in ks})) for key, ks in zip(order, calls)}


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    out, a, b = sys.argv[1:]
    runs = {side: [kernel_times(r) for r in rounds(out, side)] for side in (a, b)}
    for side, rs in runs.items():
        if not rs:
            sys.exit(f"no {side}-r<N> folders in {out}")
    keys = [k for k in runs[a][0] if all(k in r for rs in runs.values() for r in rs)]
    lines = [
        f"| case | impl | pass | {a} (ms) | {b} (ms) | {b} / {a} | per round | kernels ({a}) |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for k in keys:
        ta = statistics.mean(r[k][0] for r in runs[a])
        tb = statistics.mean(r[k][0] for r in runs[b])
        per = " / ".join(f"{rb[k][0] / ra[k][0]:.3f}" for ra, rb in zip(runs[a], runs[b]))
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {ta:.4f} | {tb:.4f} | {tb / ta:.3f} | {per} | {', '.join(runs[a][0][k][1])} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, f"{a}-vs-{b}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
