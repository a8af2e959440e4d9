#!/usr/bin/env python3
"""Markdown table of a kernels JSON (bench/gpu_kernels.sh output): kernels_table.py FILE.json"""
import json
import sys

d = json.load(open(sys.argv[1]))
by = {}
for r in d["rows"]:
    by.setdefault((r["head_dim"], r["pass"], r["causal"], r["batch"], r["seq"]), {})[r["impl"]] = r["tflops"]
print(f"{d['device']}, {d['date']}, commit {d['commit']}, torch {d.get('torch', '?')}, cuDNN {d.get('cudnn', '?')}")
for hd in sorted({k[0] for k in by}, reverse=True):
    print(f"\n**head dim {hd}, {2048 // hd} heads, bf16** (TFLOP/s, FlashAttention FLOP convention; ratio = distattn / peer)\n")
    print("| pass | causal | batch × seq | distattn | torch flash (FA2) | torch cuDNN | × flash | × cuDNN |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for p in ["fwd", "bwd"]:
        for c in [False, True]:
            for k in sorted([k for k in by if k[0] == hd and k[1] == p and k[2] == c], key=lambda k: k[4]):
                v = by[k]
                a, f, cu = v.get("distattn"), v.get("torch-flash"), v.get("torch-cudnn")
                fmt = lambda x: f"{x:.0f}" if x else "-"
                rat = lambda x, y: f"{x / y:.2f}" if x and y else "-"
                print(f"| {p} | {'yes' if c else 'no'} | {k[3]} × {k[4]} | {fmt(a)} | {fmt(f)} | {fmt(cu)} | {rat(a, f)} | {rat(a, cu)} |")
