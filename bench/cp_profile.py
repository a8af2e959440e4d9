#!/usr/bin/env python3
"""Where a Python context-parallel training step's time goes: one process per GPU runs
``distattn.distributed.ContextParallel`` (32/8 heads, d 128, bf16) forward and backward and
reports, per rank, the medians of when each call returned to the host (``*_return``) and when
the device was done (``fwd``, ``bwd``), then writes rank 0's torch.profiler trace (CPU ops and
every CUDA kernel and copy, distattn's own streams included) and its op tables.

    cp_profile.py OUT_DIR [--world 4] [--seqs 32768] [--strategy zigzag] [--mask causal]

Writes OUT_DIR/cp_profile-SEQ.json (rank 0's medians, ms) and OUT_DIR/trace-SEQ.json. The
profiler slows the run several-fold (its NCCL kernels above all): read the trace for what runs
and in which order, the medians for time."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile


def worker(rank, world, port, seq, args):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    import distattn.distributed as dd

    cp = dd.ContextParallel(strategy=args.strategy, mask=args.mask, num_heads=32, num_kv_heads=8)
    n = len(cp.position_ids(seq))
    g = torch.Generator(device="cuda").manual_seed(rank)
    mk = lambda h, grad: torch.randn(1, n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)  # noqa: E731
    q, k, v, do = mk(32, True), mk(8, True), mk(8, True), mk(32, False)
    res = {}
    for it in range(12):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o = cp.attention(q, k, v, seq_len=seq)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        o.backward(do)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        if it >= 2:
            for key, val in (("fwd_return", t1 - t0), ("fwd", t2 - t0), ("bwd_return", t3 - t2), ("bwd", t4 - t2)):
                res.setdefault(key, []).append(val * 1e3)
        q.grad = k.grad = v.grad = None
    med = {key: sorted(v)[len(v) // 2] for key, v in res.items()}
    print(f"[cp_profile] rank {rank} seq {seq}: " + " ".join(f"{key} {m:.3f} ms" for key, m in med.items()), flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            dist.barrier()
            o = cp.attention(q, k, v, seq_len=seq)
            o.backward(do)
            torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(os.path.join(args.out, f"trace-{seq}.json"))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
        row = {"strategy": args.strategy, "mask": args.mask, "seq": seq, "world": world, "ms": med,
               "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
        with open(os.path.join(args.out, f"cp_profile-{seq}.json"), "w") as f:
            json.dump(row, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--seqs", default="32768")
    ap.add_argument("--strategy", default="zigzag")
    ap.add_argument("--mask", default="causal")
    args = ap.parse_args()
    if not torch.cuda.is_available() or args.world < 1 or args.world > torch.cuda.device_count():
        ap.error(f"--world {args.world}: needs that many CUDA devices ({torch.cuda.device_count()} here)")
    os.makedirs(args.out, exist_ok=True)
    for seq in (int(s) for s in args.seqs.split(",")):
        mp.spawn(worker, args=(args.world, 29500 + os.getpid() % 400, seq, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
