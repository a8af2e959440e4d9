"""The tensor cores' reachable rate on this GPU, as the attention grids measure it: cuBLAS GEMMs
(bf16 by ``torch.matmul``, FP8 e4m3 by ``torch._scaled_mm``) timed by CUDA events over a
sustained loop and by Nsight Compute kernel durations of one marked call, the two ways
``prefill_bench.py`` times attention. An attention kernel's TFLOP/s over this GEMM rate is how
much of the reachable tensor-core work it does; a target over it is beyond the GPU.

    python3 bench/gemm_ceiling.py OUT                  # events -> OUT/gemm_events.json
    ncu --clock-control none --csv --metrics gpu__time_duration.sum \\
        python3 bench/gemm_ceiling.py OUT --kernel-pass > OUT/gemm_ncu.csv
    python3 bench/gemm_ceiling.py OUT --table OUT/gemm_ncu.csv   # -> OUT/gemm_table.md
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import marked_call, timed  # noqa: E402
from ncu_report import kernels_per_call  # noqa: E402

# (M, N, K): square GEMMs of the sizes cuBLAS runs fastest, and one of attention's shape of a
# 16k sequence's score product over 16 heads (as one GEMM: 16 x 16384 rows, K = d 128).
SHAPES = [(8192, 8192, 8192), (16384, 16384, 16384), (262144, 16384, 128)]


def gemms():
    """(name, flops, fn) of every GEMM the probe times."""
    out = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        f = 2.0 * m * n * k
        out.append((f"bf16-{m}x{n}x{k}", f, lambda a=a, b=b: torch.matmul(a, b.t())))
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        # _scaled_mm takes B column-major: b8.t() of a row-major [n, k] is that.
        fp8 = lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        out.append((f"e4m3-{m}x{n}x{k}", f, fp8))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--kernel-pass", action="store_true", help="one marked call each, for Nsight Compute")
    ap.add_argument("--table", metavar="NCU_CSV", help="the table from the events and the Nsight Compute report")
    ap.add_argument("--seconds", type=float, default=2.0, help="sustained loop per GEMM (events)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.table:
        ev = json.load(open(os.path.join(a.out, "gemm_events.json")))
        names = [r["name"] for r in ev["rows"]]
        lines = [
            f"Device: {ev['device']}, torch {ev['torch']}. TFLOP/s = 2·M·N·K over the Nsight Compute duration "
            "(`--clock-control none`) of one call, and over the median CUDA-event time of a sustained loop.",
            "",
            "| GEMM (M × N × K) | ms (ncu) | TFLOP/s (ncu) | ms (events) | TFLOP/s (events) |",
            "|---|---:|---:|---:|---:|",
        ]
        for r, ks in zip(ev["rows"], kernels_per_call(a.table, len(names))):
            ms = sum(ns for _, ns in ks) / 1e6
            lines.append(
                f"| {r['name']} | {ms:.3f} | {r['flops'] / ms / 1e9:.0f} | {r['ms']:.3f} | {r['flops'] / r['ms'] / 1e9:.0f} |"
            )
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(a.out, "gemm_table.md"), "w") as f:
            f.write(text + "\n")
        return
    torch.manual_seed(0)
    rows = []
    for name, f, fn in gemms():
        if a.kernel_pass:
            marked_call(fn)
        else:
            ms = timed(fn, a.seconds)
            rows.append({"name": name, "flops": f, "ms": ms})
            print(f"{name}: {ms:.3f} ms, {f / ms / 1e9:.0f} TFLOP/s (events)", flush=True)
    torch.cuda.synchronize()
    if not a.kernel_pass:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
        with open(os.path.join(a.out, "gemm_events.json"), "w") as fh:
            json.dump(meta, fh, indent=1)


if __name__ == "__main__":
    main()
