#!/usr/bin/env python3
"""Decode steps through distattn's Python serving API, a KV cache spread over the GPUs of one
machine (``distattn.distributed.KVCacheGroup.step``): what a PyTorch serving loop pays per
token, planning and transfers included.

    kvcache_py.py --world 2 --contexts 262144,1048576 --steps 20 --out FILE [--placement contiguous] [--layers L]

Per context: one request homed on rank 0 is prefilled with that many tokens in one step
(its time reported apart), then decodes ``--steps`` tokens one at a time, each through ``--layers``
caches (one per layer, the later ones sharing the first's communicator and step plans, as a
model keeps them; default 1); each step is timed like
``torch_cp.py`` times its peers (a barrier, then the wall clock of the call until the GPU is
done, slowest rank) and the median is reported, with the cache bytes a step reads per second.
32/8 heads, d 128, bf16, strategy ``auto``. Rows: impl distattn-py, context, placement, world,
ms (median, one token through every layer), ms_per_layer, steps_ms, gb_per_s, prompt_s (the
prompt's step of every layer, wall clock on rank 0), layers, strategy (the planner's pick of the
last step).
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

H, HKV, D = 32, 8, 128


def worker(rank, args, port, out_q):
    cuda = torch.cuda.is_available()  # CPU ranks over gloo check the script itself
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=300), device_id=dev if cuda else None)
    from distattn.distributed import KVCacheGroup

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(rank)
    rows = []
    for ci, ctx in enumerate(int(c) for c in args.contexts.split(",")):
        # contiguous / zigzag: chunks of requests of up to the context and the decoded tokens.
        placement = args.placement if ":" in args.placement else f"{args.placement}:{ctx + args.steps}"
        caches = [KVCacheGroup(placement=placement)]
        caches += [KVCacheGroup(share_with=caches[0]) for _ in range(args.layers - 1)]
        for cache in caches:
            cache.add(ci, home=0)
        mk = lambda n, h: torch.randn(1, n, h, D, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
        n = ctx if rank == 0 else 0
        q, k, v = mk(n, H), mk(n, HKV), mk(n, HKV)
        sync()
        t0 = time.perf_counter()
        for cache in caches:
            cache.step([(ci, ctx)], q, k, v)  # the prompt
        sync()
        prompt_s = time.perf_counter() - t0
        if rank == 0:
            print(f"[kvcache] {ctx:>9} tokens on {args.world} ranks ({args.placement}): prompt in {prompt_s:.2f} s "
                  f"({cache.last_strategy}), decoding {args.steps} steps", flush=True)
        ms = []
        for _ in range(args.steps):
            n = 1 if rank == 0 else 0
            q, k, v = mk(n, H), mk(n, HKV), mk(n, HKV)
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for cache in caches:
                cache.step([(ci, 1)], q, k, v)
            sync()
            t = torch.tensor([time.perf_counter() - t0], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms.append(t.item() * 1e3)
        med = sorted(ms[1:])[len(ms[1:]) // 2]
        bytes_read = args.layers * 2 * ctx * HKV * D * 2  # K and V of every layer, bf16
        row = {"impl": "distattn-py", "context": ctx, "placement": args.placement, "world": args.world, "heads": H,
               "kv_heads": HKV, "head_dim": D, "batch": 1, "ms": med, "ms_per_layer": med / args.layers, "layers": args.layers, "steps_ms": ms, "gb_per_s": bytes_read / med / 1e6,
               "prompt_s": prompt_s, "strategy": cache.last_strategy}
        rows.append(row)
        if rank == 0:
            print(f"[kvcache] {ctx:>9} tokens on {args.world} ranks ({args.placement}): {med:.3f} ms a step "
                  f"through {args.layers} layer(s), {med / args.layers:.3f} a layer ({row['gb_per_s']:.0f} GB/s of cache), "
                  f"{cache.last_strategy}", flush=True)
        del caches, cache
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        out_q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=torch.cuda.device_count() or 2)
    ap.add_argument("--contexts", default="262144,1048576")
    ap.add_argument("--steps", type=int, default=20)
    # The prompt is one step: over small pages its plan has a run per page (seconds of host time
    # at 1M tokens in 16-token pages); decode steps are one run a rank whatever the placement.
    ap.add_argument("--placement", default="contiguous", help="pages:N, contiguous[:N] or zigzag[:N] (without N: the context + steps)")
    ap.add_argument("--layers", type=int, default=1, help="caches a token goes through, one per layer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.placement.partition(":")[0] not in ("pages", "contiguous", "zigzag") or args.placement == "pages":
        ap.error(f"--placement: pages:N, contiguous[:N] or zigzag[:N], got {args.placement!r}")
    if args.layers < 1:
        ap.error(f"--layers: at least 1, got {args.layers}")
    port = 29400 + os.getpid() % 500
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, port, q), nprocs=args.world, join=True)
    out = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "rows": q.get()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
