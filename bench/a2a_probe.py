#!/usr/bin/env python3
"""All-to-all bandwidth of the machine through PyTorch's NCCL, the link rate the Ulysses
strategies are measured against (run it in the same call as `bench/multigpu.sh`).

usage: a2a_probe.py OUT.json [--world P] [--mb 8,24,48,96,192] [--iters 20]
Per size (MB each rank holds, 1/P of it staying local): median ms of all_to_all_single by CUDA
events over --iters after 3 warm-ups, and GB/s each rank sends ((P-1)/P of its bytes over the
median time).
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, args, port, out_q):
    P = args.world
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=60), device_id=torch.device("cuda", rank))
    rows = []
    for mb in (int(m) for m in args.mb.split(",")):
        n = mb * (1 << 20) // P * P
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        ms = []
        for i in range(3 + args.iters):
            dist.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dist.all_to_all_single(y, x)
            b.record()
            b.synchronize()
            if i >= 3:
                ms.append(a.elapsed_time(b))
        t = torch.tensor([sorted(ms)[len(ms) // 2]], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med = t.item()
        rows.append({"mb_per_rank": mb, "ms": med, "send_gb_per_s": n * (P - 1) / P / med / 1e6})
        if rank == 0:
            print(f"[a2a] {mb:>5} MB per rank: {med:.3f} ms, {rows[-1]['send_gb_per_s']:.0f} GB/s sent per rank", flush=True)
    if rank == 0:
        out_q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--mb", default="8,24,48,96,192")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    port = 29900 + os.getpid() % 90
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, port, q), nprocs=args.world, join=True)
    out = {"device": torch.cuda.get_device_name(0), "gpus": args.world, "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": q.get()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
