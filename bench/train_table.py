#!/usr/bin/env python3
"""Tables of bench/gpu_train.sh's runs (OUT/runs/*.json): exactness against SDPA (losses over
the steps, first-step gradients) and speed per sequence length, with ratios.

usage: train_table.py OUT
"""
import json
import pathlib
import sys

import torch


def load(out):
    runs = {}
    for f in sorted((out / "runs").glob("*.json")):
        runs[f.stem] = json.loads(f.read_text())
    return runs


def grads(path):
    g = torch.load(path)
    return torch.cat([g[k].flatten() for k in sorted(g)])


def exactness(out, runs):
    ref = runs.get("exact-sdpa")
    if ref is None:
        return ["(no exactness runs)"]
    ref_g = grads(out / "runs" / "exact-sdpa.pt")
    lines = [
        "| run | steps | max loss difference vs SDPA | relative | first-step gradient rel. error |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        if not name.startswith("exact-") or name == "exact-sdpa":
            continue
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(r["steps"], ref["steps"])]
        rel = max(d / abs(b["loss"]) for d, b in zip(diffs, ref["steps"]))
        gp = out / "runs" / f"{name}.pt"
        ge = ((grads(gp) - ref_g).norm() / ref_g.norm()).item() if gp.exists() else float("nan")
        lines.append(f"| {name[6:]} | {len(diffs)} | {max(diffs):.4f} | {rel:.2e} | {ge:.2e} |")
    lines.append(f"\nSDPA losses: first {ref['steps'][0]['loss']:.4f}, last {ref['steps'][-1]['loss']:.4f}")
    return lines


def used(r):
    """GiB in use on the device at the end of the run (runs before the field: '-')."""
    u = [x for x in r.get("device_used_gib_per_gpu") or [] if x is not None]
    return f"{max(u):.1f}" if u else "-"


def speed(runs):
    by_seq = {}
    for name, r in runs.items():
        if name.startswith("speed-"):
            by_seq.setdefault(r["seq"], []).append((name.split("-", 2)[2], r))
    lines = []
    for seq, rows in sorted(by_seq.items()):
        r0 = rows[0][1]
        lines += [
            f"\n### {seq} tokens ({r0['world']} GPU(s), {seq // r0['world']} per GPU), {r0['layers']} layers, {r0['device']}\n",
            "| setup | s/step | tokens/s | peak GiB/GPU (torch) | GiB/GPU in use at the end | attention fwd ops/step | × distattn layer | × best peer layer | × best peer selective |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        tps = {k: r["tokens_per_s"] for k, r in rows}
        base = tps.get("distattn-layer")
        peer = lambda pol: max((v for k, v in tps.items() if not k.startswith("distattn") and k.endswith(pol)), default=None)  # noqa: E731
        peer_layer, peer_sel = peer("-layer"), peer("-remat")
        for k, r in sorted(rows, key=lambda x: -x[1]["tokens_per_s"]):
            ratio = lambda b: f"{r['tokens_per_s'] / b:.2f}" if b else ""  # noqa: E731
            lines.append(
                f"| {k} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | {max(r['peak_gib_per_gpu']):.1f} | {used(r)} | "
                f"{r['attention_forwards_per_step']} | {ratio(base)} | {ratio(peer_layer)} | {ratio(peer_sel)} |"
            )
    return lines


def main():
    out = pathlib.Path(sys.argv[1])
    runs = load(out)
    print("## Exactness\n")
    print("\n".join(exactness(out, runs)))
    print("\n## Speed")
    print("\n".join(speed(runs)))


if __name__ == "__main__":
    main()
