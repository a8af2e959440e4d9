"""How the kernel benchmarks time both sides the same way: CUDA events around each call (median
after warm-up, over a sustained loop), and Nsight Compute kernel durations of one marked call
per (case, implementation).

The marked pass runs each call once to warm up, then once between two marker kernels (torch's
spin kernel); run under ``ncu --clock-control none --csv --metrics gpu__time_duration.sum``, its
report splits into the kernels of each call (`ncu_report.kernels_per_call`).
"""

import statistics
import time

import torch


def timed(fn, min_seconds=1.0):
    """Median ms per call: CUDA events around each call, after 3 warm-up calls, at least 10
    calls and `min_seconds`."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < 10 or time.perf_counter() - start < min_seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def marker():
    """The kernel that brackets a marked call in the kernel pass."""
    torch.cuda._sleep(1000)


def marked_call(fn):
    """One warm-up call, then one call between markers."""
    fn()
    torch.cuda.synchronize()
    marker()
    fn()
    marker()
