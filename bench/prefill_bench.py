#!/usr/bin/env python3
"""Attention kernels on one GPU, kernel against kernel: distattn's forward, backward and FP8
forward against PyTorch SDPA's cuDNN and flash backends, timed both ways in the same run.

  prefill_bench.py OUT_DIR [--quick] [--cases a,b]     CUDA-event timings -> OUT_DIR/prefill_bench.json
      [--impls distattn,distattn-fp8] [--passes fwd]   (of these implementations and passes only)
      [--heads 8/2,32/8] [--seconds 1.0]               (other head counts; longer sustained loops)
  ncu --clock-control none --csv --metrics gpu__time_duration.sum \\
      python3 prefill_bench.py OUT_DIR --kernel-pass [--cases, --impls, --passes as above] > OUT_DIR/ncu.csv
  prefill_bench.py OUT_DIR --table OUT_DIR/ncu.csv     the tables, from both
  prefill_bench.py OUT_DIR --accuracy                  FP8 / bf16 / cuDNN errors against f64

Cases: batch 1, bf16, causal and full masks, MHA 16/16 and GQA 32/8 heads, head dims 128, 64,
256, 192 and 96, 4k to 64k tokens (named d128-16/16-causal-4k ...). Each side takes its own layout, built before timing (distattn [b, n, h,
d]; SDPA [b, h, n, d], GQA through `enable_gqa`). Forward = one attention call; backward = the
autograd backward of a retained graph (distattn: row delta, dK/dV with dQ accumulation, dQ
conversion; SDPA: whatever its backend launches). FP8 = distattn's e4m3 forward with
per-(batch, KV head) descales, V's transpose included. Both sides are timed by CUDA events
(kernel_timing.timed) and by the sum of the Nsight Compute durations of every kernel a call
launches. TFLOP/s by the FlashAttention convention: forward 4·B·H·area·d (area = kept
query-key pairs), backward 2.5× that.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import distattn
from kernel_timing import marked_call, timed
from ncu_report import kernels_per_call

DT = torch.bfloat16
SEQS = [4096, 8192, 16384, 32768, 65536]
HEADS = ((16, 16), (32, 8))


def cases(quick, only=None, heads=None):
    """(name, n, mask, h, hkv, d); heads: (H, HKV) pairs, default HEADS."""
    out = []
    for d in (128, 64, 256, 192, 96):
        for h, hkv in heads or HEADS:
            for mask in ("causal", "full"):
                for n in SEQS:
                    out.append((f"d{d}-{h}/{hkv}-{mask}-{n // 1024}k", n, mask, h, hkv, d))
    if only:
        # (Empty entries, as a trailing comma leaves, would match every case: ignored.)
        prefixes = [p for p in only.split(",") if p]
        out = [c for c in out if any(c[0].startswith(p) for p in prefixes)]
    elif quick:
        out = [c for c in out if c[1] == 16384 and c[5] == 128][:2]
    return out


def flops(n, mask, h, d):
    area = n * (n + 1) // 2 if mask == "causal" else n * n
    return 4 * h * area * d


def impls(n, mask, h, hkv, d):
    """(name, pass, fn) of every implementation and pass of this case."""
    torch.manual_seed(0)
    causal = mask == "causal"
    q = torch.randn(1, n, h, d, device="cuda", dtype=DT)
    k, v = (torch.randn(1, n, hkv, d, device="cuda", dtype=DT) for _ in range(2))
    d_o = torch.randn(1, n, h, d, device="cuda", dtype=DT)
    out = []

    def passes(name, fwd, leaves, grad_out, peer=False):
        out.append((name, "fwd", lambda: fwd(*leaves)))
        ls = [t.detach().requires_grad_() for t in leaves]
        o = fwd(*ls)

        def bwd():
            for t in ls:
                t.grad = None
            o.backward(grad_out, retain_graph=True)

        if peer:  # a backend may run the forward of a head dim but not its backward
            try:
                bwd()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"  {name} backward: unavailable ({str(e).splitlines()[0][:80]})", file=sys.stderr)
                return
        out.append((name, "bwd", bwd))

    passes("distattn", lambda q, k, v: distattn.flash_attn_func(q, k, v, causal=causal), (q, k, v), d_o)
    if d == 128:
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        ones = torch.ones(1, hkv, device="cuda")
        out.append(("distattn-fp8", "fwd",
                    lambda: distattn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones)))  # fmt: skip
    qs, ks, vs, dos = (t.transpose(1, 2).contiguous() for t in (q, k, v, d_o))
    for be_name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):

        def sdpa(q, k, v, be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != h)

        try:
            sdpa(qs, ks, vs)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print(f"  sdpa-{be_name}: unavailable ({str(e).splitlines()[0][:80]})", file=sys.stderr)
            continue
        passes(f"sdpa-{be_name}", sdpa, (qs, ks, vs), dos, peer=True)
    return out


def picked(impl, pss, only_impls, only_passes):
    """Whether --impls / --passes (comma-separated; None: all) take this implementation and pass."""
    return (not only_impls or impl in only_impls.split(",")) and (not only_passes or pss in only_passes.split(","))


def run_timings(out_dir, quick, only, only_impls=None, only_passes=None, heads=None, seconds=None):
    rows = []
    for name, n, mask, h, hkv, d in cases(quick, only, heads):
        for impl, pss, fn in impls(n, mask, h, hkv, d):
            if not picked(impl, pss, only_impls, only_passes):
                continue
            ms = timed(fn, seconds or (0.2 if quick else 0.3))
            f = flops(n, mask, h, d) * (2.5 if pss == "bwd" else 1)
            rows.append({"case": name, "impl": impl, "pass": pss, "ms": ms, "tflops": f / ms / 1e9})
            print(f"{name:24} {impl:13} {pss} {ms:9.3f} ms {f / ms / 1e9:6.0f} TFLOP/s", file=sys.stderr)
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}  # fmt: skip
    with open(os.path.join(out_dir, "prefill_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


def kernel_pass(out_dir, quick, only, only_impls=None, only_passes=None):
    order = []
    for name, n, mask, h, hkv, d in cases(quick, only):
        for impl, pss, fn in impls(n, mask, h, hkv, d):
            if not picked(impl, pss, only_impls, only_passes):
                continue
            marked_call(fn)
            order.append((name, impl, pss))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    with open(os.path.join(out_dir, "kernel_pass.json"), "w") as f:
        json.dump(order, f)


def table(out_dir, ncu_csv):
    res = json.load(open(os.path.join(out_dir, "prefill_bench.json")))
    order = [tuple(o) for o in json.load(open(os.path.join(out_dir, "kernel_pass.json")))]
    kern = {}
    for key, ks in zip(order, kernels_per_call(ncu_csv, len(order))):
        kern[key] = {"ms": sum(ns for _, ns in ks) / 1e6, "kernels": [(k.split("(")[0][:60], ns / 1e3) for k, ns in ks]}
    spec = {c[0]: c for c in cases(False)}
    by = {(r["case"], r["impl"], r["pass"]): r for r in res["rows"]}
    lines = [
        f"Device: {res['device']}, torch {res['torch']}, cuDNN {res['cudnn']}. Kernel time = sum of the Nsight "
        "Compute durations (`--clock-control none`) of every kernel of one call; events = median CUDA-event "
        "time of a sustained loop. Ratio = best SDPA backend's time / distattn's (> 1: distattn faster).",
        "",
        "| case | pass | distattn ms (ncu) | TFLOP/s | cuDNN ms | flash ms | × best (ncu) | distattn ms (events) | best SDPA ms (events) | × best (events) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fp8 = [
        "| case | FP8 fwd ms (ncu) | TFLOP/s | × our bf16 fwd (ncu) | × best SDPA fwd (ncu) | FP8 ms (events) | × our bf16 (events) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for case, (_, n, mask, h, hkv, d) in spec.items():
        for pss in ("fwd", "bwd"):
            if (case, "distattn", pss) not in by:
                continue
            f = flops(n, mask, h, d) * (2.5 if pss == "bwd" else 1)
            kk = lambda impl: kern.get((case, impl, pss), {"ms": nan})["ms"]  # noqa: E731
            ev = lambda impl: by.get((case, impl, pss), {"ms": nan})["ms"]  # noqa: E731
            peers = [p for p in ("sdpa-cudnn", "sdpa-flash") if (case, p, pss) in by]
            best_k = min((kk(p) for p in peers), default=nan)
            best_e = min((ev(p) for p in peers), default=nan)
            lines.append(
                f"| {case} | {pss} | {kk('distattn'):.3f} | {f / kk('distattn') / 1e9:.0f} | {kk('sdpa-cudnn'):.3f} | "
                f"{kk('sdpa-flash'):.3f} | {best_k / kk('distattn'):.3f} | {ev('distattn'):.3f} | {best_e:.3f} | "
                f"{best_e / ev('distattn'):.3f} |"
            )
        if (case, "distattn-fp8", "fwd") in by:
            k8 = kern.get((case, "distattn-fp8", "fwd"), {"ms": nan})["ms"]
            kb = kern.get((case, "distattn", "fwd"), {"ms": nan})["ms"]
            best = min(kern.get((case, p, "fwd"), {"ms": nan})["ms"] for p in ("sdpa-cudnn", "sdpa-flash"))
            e8, eb = by[(case, "distattn-fp8", "fwd")]["ms"], by[(case, "distattn", "fwd")]["ms"]
            fp8.append(
                f"| {case} | {k8:.3f} | {flops(n, mask, h, d) / k8 / 1e9:.0f} | {kb / k8:.2f} | {best / k8:.2f} | "
                f"{e8:.3f} | {eb / e8:.2f} |"
            )
    if len(fp8) > 2:
        lines += ["", "FP8 (e4m3) forward, V's transpose included:", ""] + fp8
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out_dir, "prefill_table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "prefill_kernels.json"), "w") as f:
        json.dump({"/".join(k): v for k, v in kern.items()}, f, indent=1)


def accuracy(out_dir, n=16384, rows=256):
    """Errors against f64 on `rows` sampled query rows (the whole f64 matrix would not fit), GQA
    32/8, d 128: FP8 inputs (unit normal rounded to e4m3, descales of 1 so that the same values
    are exact in bf16) through the FP8 kernel, the bf16 kernel and SDPA cuDNN."""
    out = []
    for mask in ("causal", "full"):
        torch.manual_seed(1)
        h, hkv, d = 32, 8, 128
        q8, k8, v8 = (torch.randn(1, n, x, d, device="cuda").to(torch.float8_e4m3fn) for x in (h, hkv, hkv))
        qb, kb, vb = (t.to(DT) for t in (q8, k8, v8))
        causal = mask == "causal"
        o8 = distattn.flash_attn_func(q8, k8, v8, causal=causal)
        ob = distattn.flash_attn_func(qb, kb, vb, causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qb, kb, vb)), is_causal=causal,
                                                enable_gqa=True).transpose(1, 2)  # fmt: skip
        idx = torch.linspace(0, n - 1, rows, device="cuda").long()
        qd, kd, vd = q8.double()[0, idx], k8.double()[0], v8.double()[0]
        kd, vd = (t.repeat_interleave(h // hkv, dim=1) for t in (kd, vd))
        s = torch.einsum("rhd,mhd->hrm", qd, kd) / math.sqrt(d)
        if causal:
            s = s.masked_fill(torch.arange(n, device="cuda")[None, None, :] > idx[None, :, None], -math.inf)
        ref = torch.einsum("hrm,mhd->rhd", torch.softmax(s, dim=-1), vd)
        err = lambda o: ((o[0, idx].double() - ref).norm() / ref.norm()).item()  # noqa: E731
        row = {"mask": mask, "n": n, "rows": rows, "fp8": err(o8), "bf16": err(ob), "sdpa_cudnn": err(oc)}
        out.append(row)
        print(json.dumps(row), file=sys.stderr)
    with open(os.path.join(out_dir, "accuracy.json"), "w") as f:
        json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="two 16k cases (a smoke test)")
    ap.add_argument("--kernel-pass", action="store_true", help="one marked call per case, for ncu")
    ap.add_argument("--table", metavar="NCU_CSV", help="print the tables from the timings and ncu's CSV")
    ap.add_argument("--accuracy", action="store_true", help="errors against f64 at 16k")
    ap.add_argument("--cases", help="comma-separated case names or prefixes, e.g. d128- (default: all)")
    ap.add_argument("--impls", help="timings (and kernel pass) of these implementations only, e.g. distattn,distattn-fp8")
    ap.add_argument("--passes", help="timings (and kernel pass) of these passes only: fwd, bwd")
    ap.add_argument("--heads", help="head counts H/HKV of the timed cases, e.g. 8/2,32/8 (default 16/16,32/8)")
    ap.add_argument("--seconds", type=float, help="sustained seconds of each timing (default 0.3)")
    a = ap.parse_args()
    heads = [tuple(int(x) for x in hh.split("/")) for hh in a.heads.split(",")] if a.heads else None
    os.makedirs(a.out_dir, exist_ok=True)
    if a.table:
        table(a.out_dir, a.table)
    elif a.kernel_pass:
        kernel_pass(a.out_dir, a.quick, a.cases, a.impls, a.passes)
    elif a.accuracy:
        accuracy(a.out_dir)
    else:
        run_timings(a.out_dir, a.quick, a.cases, a.impls, a.passes, heads, a.seconds)


if __name__ == "__main__":
    main()
