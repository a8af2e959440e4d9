"""Nsight Compute reports of the kernel benchmarks' marked passes, read without torch.

A report is the CSV of ``ncu --clock-control none --csv --metrics gpu__time_duration.sum`` (or
that CSV gzipped); the marked pass (`kernel_timing.marked_call`) brackets each timed call
between two marker kernels (torch's spin kernel), so the report splits into the kernels of
each call.
"""

import csv
import gzip

# Nanoseconds per unit of a duration as ncu prints it.
NS_PER_UNIT = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9}


def ncu_durations(path):
    """(kernel name, ns) of every kernel of an ncu --csv report, in launch order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [line for line in f if line.startswith('"')]
    out = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            scale = NS_PER_UNIT[r.get("Metric Unit") or "ns"]
            out.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale))
    return out


def kernels_per_call(ncu_csv, n_calls):
    """The (kernel name, ns) lists of the first `n_calls` marked calls of a report."""
    segments = [[]]
    for name, ns in ncu_durations(ncu_csv):
        if "spin_kernel" in name:
            segments.append([])
        else:
            segments[-1].append((name, ns))
    return segments[1::2][:n_calls]
