#!/usr/bin/env python3
"""distattn from PyTorch against PyTorch's SDPA (cuDNN and flash backends), one GPU.

  python_bench.py OUT_DIR [--rust-rows ROWS.json] [--quick] [--impls distattn,sdpa-cudnn,sdpa-flash]

Times forward and forward+backward of `distattn.flash_attn_func` and of
`scaled_dot_product_attention` pinned to each backend, all with the same timer around the Python
call: CUDA events around each call, after a warm-up, repeated for at least a second; the median
is reported. Every impl gets its best configuration: SDPA takes contiguous [b, h, n, d]
tensors (its native layout), distattn [b, n, h, d] (flash-attn's); grouped-query attention uses
SDPA's `enable_gqa`, or K/V expanded beforehand (untimed) where a backend lacks it. Gradients
come from `torch.autograd.grad` (no accumulation into .grad). TFLOP/s by the FlashAttention
convention: forward 4·b·h·area·d with area the kept query-key pairs, backward 2.5× forward.

Each impl is also timed with calls issued back to back (events around 10 calls), where launch
latency hides behind the GPU as in a training loop; "host us" is the host time of one call
while the GPU is busy. With --rust-rows (the JSON of `distattn-cuda-bench bench --sustain 1`,
the same two timings, run on the same GPU in the same call), the table adds the Rust
benchmark's times for the same shape and the Python layer's overhead over them.
Writes OUT_DIR/python_bench.json and prints a Markdown table.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import distattn


def timed(fn, min_seconds=1.0, batch=1):
    """Median milliseconds per call of `fn()`: CUDA events around each call (batch=1) or around
    `batch` calls issued back to back, the time a training loop sees once launch latency hides
    behind the GPU; after 3 warm-up calls, at least 10 single calls / 3 batches and
    `min_seconds` (the timing of `distattn-cuda-bench --sustain`)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    min_reps = 10 if batch == 1 else 3
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def host_us(fn, n=20):
    """Host microseconds per call while the GPU is busy: what the Python layer costs when its
    launches are not hidden behind earlier work."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def sdpa_call(backend, causal, gqa):
    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return attn


def case(b, n, h, hkv, d, causal, quick, only):
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    # Unit-variance uniform values, as distattn-cuda-bench draws them: kernel times depend a
    # little on the data (power draw, softmax rescales), so both benches time the same kind.
    rand = lambda *shape: ((torch.rand(*shape, device=dev) * 2 - 1) * 3**0.5).to(dt)  # noqa: E731
    q, k, v = rand(b, n, h, d).requires_grad_(), rand(b, n, hkv, d).requires_grad_(), rand(b, n, hkv, d).requires_grad_()
    g = rand(b, n, h, d)
    area = n * (n + 1) // 2 if causal else n * n
    fwd_flop = 4 * b * h * area * d
    impls = {"distattn": (lambda: distattn.flash_attn_func(q, k, v, causal=causal), (q, k, v), g)}
    # SDPA in its own layout, made contiguous beforehand.
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    gt = g.transpose(1, 2).contiguous()
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        if only and name not in only:
            continue
        call = sdpa_call(backend, causal, h != hkv)
        try:
            call(qt, kt, vt).backward(gt)
            impls[name] = (lambda call=call: call(qt, kt, vt), (qt, kt, vt), gt)
        except RuntimeError:
            # No native GQA on this backend: expand K/V once, outside the timed region.
            ke, ve = (t.detach().repeat_interleave(h // hkv, 1).requires_grad_() for t in (kt, vt))
            call = sdpa_call(backend, causal, False)
            try:
                call(qt, ke, ve).backward(gt)
            except RuntimeError as e:
                print(f"{name}: skipped ({str(e).splitlines()[0]})")
                continue
            impls[f"{name} (K/V expanded)"] = (lambda call=call, ke=ke, ve=ve: call(qt, ke, ve), (qt, ke, ve), gt)
    secs = 0.3 if quick else 1.0
    rows = []
    for name, (fwd, inputs, grad) in impls.items():
        fwd_bwd = lambda fwd=fwd, inputs=inputs, grad=grad: torch.autograd.grad(fwd(), inputs, grad)  # noqa: E731
        with torch.no_grad():
            fwd_times = timed(fwd, secs), timed(fwd, secs, batch=10), host_us(fwd)
        fwd_bwd_times = timed(fwd_bwd, secs), timed(fwd_bwd, secs, batch=10), host_us(fwd_bwd)
        for pas, (ms, b2b, us), flop in (("fwd", fwd_times, fwd_flop), ("fwd+bwd", fwd_bwd_times, 3.5 * fwd_flop)):
            rows.append(dict(impl=name, pass_=pas, batch=b, seq=n, heads=h, kv_heads=hkv, head_dim=d,
                             causal=causal, ms=ms, ms_back_to_back=b2b, tflops=flop / ms / 1e9, host_us=us))
    return rows


def rust_ms(rust_rows, r, key):
    """The Rust benchmark's fwd / fwd+bwd time (`key`: ms or ms_back_to_back) for row `r`'s
    shape, if it ran it."""
    if r["heads"] != r["kv_heads"]:
        return None
    found = {}
    for x in rust_rows:
        if (x["seq"], x["heads"], x["head_dim"], x["causal"], x["batch"]) == (r["seq"], r["heads"], r["head_dim"], r["causal"], r["batch"]):
            found[x["pass"]] = x.get(key)
    if found.get("fwd") is None:
        return None
    if r["pass_"] == "fwd":
        return found["fwd"]
    return found["fwd"] + found["bwd"] if found.get("bwd") is not None else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--rust-rows", help="JSON rows of distattn-cuda-bench bench on this GPU")
    ap.add_argument("--quick", action="store_true", help="short timing loops (a smoke test)")
    ap.add_argument("--impls", help="comma-separated subset of distattn,sdpa-cudnn,sdpa-flash")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rust_rows = []
    if a.rust_rows:
        with open(a.rust_rows) as f:
            data = json.load(f)
        rust_rows = data["rows"] if isinstance(data, dict) else data
    shapes = [(1, 16384, 16, 16, 128), (1, 16384, 32, 32, 64), (1, 16384, 32, 8, 128)]
    rows = []
    for b, n, h, hkv, d in shapes:
        for causal in (True, False):
            rows += case(b, n, h, hkv, d, causal, a.quick, a.impls.split(",") if a.impls else None)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"distattn {distattn.__version__}; bf16, median ms (CUDA events around the Python call)\n")
    print("| shape | mask | pass | impl | ms | TFLOP/s | vs best SDPA | back-to-back ms | vs best SDPA | host us "
          "| Rust ms | overhead | Rust back-to-back ms | overhead |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    same = ("seq", "heads", "kv_heads", "head_dim", "causal", "pass_")
    for r in rows:
        peers = [x for x in rows if x["impl"].startswith("sdpa") and all(x[f] == r[f] for f in same)]
        cells = [f"{r['heads']}/{r['kv_heads']} heads, d {r['head_dim']}, {r['seq'] // 1024}k",
                 "causal" if r["causal"] else "full", r["pass_"], r["impl"]]
        for key in ("ms", "ms_back_to_back"):
            best = min((x[key] for x in peers), default=None)
            r[f"{key}_vs_best_sdpa"] = best / r[key] if best else None
            cells += [f"{r[key]:.3f}"] + ([f"{r['tflops']:.0f}"] if key == "ms" else []) + [f"{best / r[key]:.3f}x" if best else "-"]
        cells.append(f"{r['host_us']:.0f}")
        for key in ("ms", "ms_back_to_back"):
            rust = rust_ms(rust_rows, r, key) if r["impl"] == "distattn" else None
            r[f"rust_{key}"] = rust
            r[f"python_overhead_{key}"] = r[key] / rust - 1 if rust else None
            cells += [f"{rust:.3f}", f"{100 * (r[key] / rust - 1):+.1f}%"] if rust else ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                cudnn=torch.backends.cudnn.version(), distattn=distattn.__version__)
    with open(os.path.join(a.out_dir, "python_bench.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
