#!/usr/bin/env python3
"""Decode attention: distattn's split-KV kernel against PyTorch's SDPA backends and a read
bandwidth probe, one GPU, bf16, d 128, one query row per request.

  decode_bench.py OUT_DIR [--quick]                   timings (CUDA events) -> OUT_DIR/decode_bench.json
  ncu --clock-control none --csv --metrics gpu__time_duration.sum \\
      python3 decode_bench.py OUT_DIR --kernel-pass > OUT_DIR/ncu.csv
  decode_bench.py OUT_DIR --table OUT_DIR/ncu.csv     the table, from both

Cases: batch 1 with 32/8 heads at 32k to 1M tokens (pages of 16, and a contiguous cache), 8/1
heads at 128k, ragged batches of 8, 16 and 64 with lengths uniform in 4k–128k, and uniform
batches for SDPA. distattn runs `flash_attn_with_kvcache` (the call: zeroing the merge counters,
the step's plan, the decode kernel); SDPA takes q [b, h, 1, d] and K/V [b, hkv, n, d] with
`enable_gqa` on each backend that accepts them (flash, efficient, cuDNN), uniform batches only
(a ragged batch would be padded). Both sides are timed the same way: CUDA events around each
call, median over at least a second after warm-up, for the Python call and for the call
captured in a CUDA graph (GPU time, as a serving loop runs it); and by Nsight Compute kernel durations
(`--kernel-pass`, caches flushed before each kernel as ncu does by default). Bandwidth = K+V
bytes read ÷ time; the probe is a bf16 sum over 4 GiB, timed the same two ways.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import distattn
from kernel_timing import marked_call, timed
from ncu_report import kernels_per_call

D, DT = 128, torch.bfloat16
GIB = 1 << 30


def cases(quick, only=None):
    g = torch.Generator().manual_seed(20261123)
    ragged = lambda b: torch.randint(4096, 131072 + 1, (b,), generator=g).tolist()  # noqa: E731
    out = [
        ("b1-32k", [32768], 32, 8, 16),
        ("b1-32k-contig", [32768], 32, 8, 0),
        ("b1-128k", [131072], 32, 8, 16),
        ("b1-128k-contig", [131072], 32, 8, 0),
        ("b1-512k", [524288], 32, 8, 16),
        ("b1-1M", [1048576], 32, 8, 16),
        ("b1-1M-contig", [1048576], 32, 8, 0),
        ("b1-128k-8/1", [131072], 8, 1, 16),
        ("b8-128k-8/1", [131072] * 8, 8, 1, 16),
        ("b8-32k-contig", [32768] * 8, 32, 8, 0),
        ("b8-ragged", ragged(8), 32, 8, 16),
        ("b16-ragged", ragged(16), 32, 8, 16),
        ("b64-ragged", ragged(64), 32, 8, 16),
    ]
    if only:
        out = [c for c in out if c[0] in only.split(",")]
    return out[:3] if quick else out


def make(lengths, h, hkv, page):
    """q, the caches, page table and lengths for distattn; contiguous K/V for SDPA (uniform)."""
    b, n = len(lengths), max(lengths)
    torch.manual_seed(0)
    q = torch.randn(b, 1, h, D, device="cuda", dtype=DT)
    if page:
        per = [-(-x // page) for x in lengths]
        pages = sum(per)
        kc = torch.randn(pages, page, hkv, D, device="cuda", dtype=DT)
        vc = torch.randn(pages, page, hkv, D, device="cuda", dtype=DT)
        perm = torch.randperm(pages, device="cuda").to(torch.int32)  # scattered pages
        table = torch.zeros(b, max(per), dtype=torch.int32, device="cuda")
        at = 0
        for i, p in enumerate(per):
            table[i, :p] = perm[at : at + p]
            at += p
    else:
        kc = torch.randn(b, n, hkv, D, device="cuda", dtype=DT)
        vc = torch.randn(b, n, hkv, D, device="cuda", dtype=DT)
        table = None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q, kc, vc, table, seqlens


def impls(lengths, h, hkv, page):
    """(name, fn) of every implementation of this case."""
    q, kc, vc, table, seqlens = make(lengths, h, hkv, page)
    out = [("distattn", lambda: distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table))]
    if len(set(lengths)) == 1 and not page:
        # SDPA's layout [b, hkv, n, d]: a copy of the same values (untimed).
        # SDPA's layout [b, hkv, n, d] (a copy of the same values, untimed), and SDPA reading
        # the [b, n, hkv, d] cache distattn reads, through strides.
        qs, ks, vs = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        nhd = (q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))
        backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION)]  # fmt: skip
        variants = [(f"sdpa-{n}", be, (qs, ks, vs)) for n, be in backends]
        variants += [(f"sdpa-{n}-nhd", be, nhd) for n, be in backends if n != "efficient"]
        for name, be, ins in variants:

            def call(be=be, ins=ins):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(*ins, enable_gqa=True)

            try:
                ref = call()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"  {name}: unavailable ({str(e).splitlines()[0][:80]})", file=sys.stderr)
                continue
            out.append((name, call))
        mine = out[0][1]()
        for name, fn in out[1:]:
            err = (fn().transpose(1, 2).float() - mine.float()).abs().max().item()
            assert err < 2e-2, f"{name} differs from distattn by {err}"
    return out


def kv_bytes(lengths, hkv):
    return 2 * sum(lengths) * hkv * D * 2


def probe():
    x = torch.randn(GIB * 4 // 2, device="cuda", dtype=DT)
    return x, (lambda: x.sum(dtype=torch.float32))


def run_timings(out_dir, quick, only):
    rows = []
    x, sum_fn = probe()
    probe_ms = timed(sum_fn)
    print(f"probe: {x.numel() * 2 / probe_ms / 1e6:.0f} GB/s", file=sys.stderr)
    del x
    for name, lengths, h, hkv, page in cases(quick, only):
        for impl, fn in impls(lengths, h, hkv, page):
            ms = timed(fn, 0.3 if quick else 1.0)
            # The same call captured in a CUDA graph (as a serving loop runs it): GPU time only.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph_ms = timed(graph.replay, 0.3 if quick else 1.0)
            gbs = kv_bytes(lengths, hkv) / graph_ms / 1e6
            rows.append({"case": name, "impl": impl, "ms": ms, "graph_ms": graph_ms, "GB/s": gbs})
            print(f"{name:16} {impl:15} {ms * 1e3:9.1f} us, graph {graph_ms * 1e3:9.1f} us {gbs:7.0f} GB/s", file=sys.stderr)
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "probe_ms": probe_ms,
           "probe_bytes": GIB * 4, "rows": rows}  # fmt: skip
    with open(os.path.join(out_dir, "decode_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


def kernel_pass(out_dir, quick, only):
    """One call of each (case, impl) after a warm-up, between two marker kernels
    (torch.cuda._sleep's spin kernel); the order goes to OUT_DIR/kernel_pass.json."""
    order = []
    x, sum_fn = probe()
    marked_call(sum_fn)
    order.append(("probe", "sum"))
    del x
    for name, lengths, h, hkv, page in cases(quick, only):
        for impl, fn in impls(lengths, h, hkv, page):
            marked_call(fn)
            order.append((name, impl))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    with open(os.path.join(out_dir, "kernel_pass.json"), "w") as f:
        json.dump(order, f)


def table(out_dir, ncu_csv):
    res = json.load(open(os.path.join(out_dir, "decode_bench.json")))
    order = json.load(open(os.path.join(out_dir, "kernel_pass.json")))
    groups = kernels_per_call(ncu_csv, len(order))
    kern = {}
    for (case, impl), ks in zip(order, groups):
        kern[(case, impl)] = {"total_us": sum(ns for _, ns in ks) / 1e3,
                              "kernels": [(n.split("(")[0][:60], ns / 1e3) for n, ns in ks]}  # fmt: skip
    probe_bytes = res["probe_bytes"]
    probe_ev = probe_bytes / res["probe_ms"] / 1e6
    probe_k = probe_bytes / kern[("probe", "sum")]["total_us"] / 1e3
    lines = [
        f"Device: {res['device']}, torch {res['torch']}. Probe (bf16 sum over 4 GiB): {probe_ev:.0f} GB/s by events, "
        f"{probe_k:.0f} GB/s by ncu.",
        "",
        "| case | impl | call us (events) | graph us (events) | GB/s | % probe | decode kernel us (ncu) | GB/s | % probe | other kernels us (ncu) | × best SDPA (call / graph / kernels by ncu) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    spec = {c[0]: c for c in cases(False)}
    by_case = {}
    for r in res["rows"]:
        by_case.setdefault(r["case"], []).append(r)
    for case, rows in by_case.items():
        _, lengths, h, hkv, page = spec[case]
        nbytes = kv_bytes(lengths, hkv)
        sd = [r for r in rows if r["impl"].startswith("sdpa")]
        best_ev = min((r["ms"] for r in sd), default=None)
        best_g = min((r["graph_ms"] for r in sd), default=None)
        best_k = min((kern[(case, r["impl"])]["total_us"] for r in sd if (case, r["impl"]) in kern), default=None)
        for r in rows:
            k = kern.get((case, r["impl"]), {"total_us": float("nan"), "kernels": []})
            main = max(k["kernels"], key=lambda t: t[1], default=("", float("nan")))
            others = ", ".join(f"{n} {us:.1f}" for n, us in k["kernels"] if (n, us) != main)
            kus = main[1] if r["impl"] == "distattn" else k["total_us"]
            ratio = ""
            if r["impl"] == "distattn" and best_ev:
                ratio = f"{best_ev / r['ms']:.2f} / {best_g / r['graph_ms']:.2f} / {best_k / k['total_us']:.2f}"
            lines.append(
                f"| {case} | {r['impl']} | {r['ms'] * 1e3:.1f} | {r['graph_ms'] * 1e3:.1f} | {nbytes / r['graph_ms'] / 1e6:.0f} | "
                f"{100 * nbytes / r['graph_ms'] / 1e6 / probe_ev:.0f}% | {kus:.1f} | {nbytes / kus / 1e3:.0f} | "
                f"{100 * nbytes / kus / 1e3 / probe_k:.0f}% | {others} | {ratio} |"
            )
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "decode_table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "decode_kernels.json"), "w") as f:
        json.dump({f"{c}/{i}": v for (c, i), v in kern.items()}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="three cases, short loops (a smoke test)")
    ap.add_argument("--kernel-pass", action="store_true", help="one marked call per case, for ncu")
    ap.add_argument("--table", metavar="NCU_CSV", help="print the table from the timings and ncu's CSV")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    if a.table:
        table(a.out_dir, a.table)
    elif a.kernel_pass:
        kernel_pass(a.out_dir, a.quick, a.cases)
    else:
        run_timings(a.out_dir, a.quick, a.cases)


if __name__ == "__main__":
    main()
