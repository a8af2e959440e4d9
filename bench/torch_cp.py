#!/usr/bin/env python3
"""PyTorch peers of the distattn multi-GPU benchmark, same shapes, same machine.

* torch-cp: PyTorch's context parallel (torch.distributed.tensor.experimental.context_parallel)
  with each rotate method (set_rotate_method: "allgather", "alltoall") and SDPA backend (flash,
  cuDNN); causal load balancing is PyTorch's default.
* torch-ulysses: all-to-all from sequence to head sharding, SDPA (flash or cuDNN: configs
  ulysses-flash, ulysses-cudnn) on the full sequence, all-to-all back (autograd through both);
  the yunchang / DeepSpeed-Ulysses layout.
* Packed documents (a mask spec of `distattn-multigpu-bench doc-lens`, passed with --doc-lens):
  the same all-to-alls around torch's varlen_attn (config ulysses-varlen, FlashAttention-2
  kernels) or a compiled flex_attention with a document block mask built once (ulysses-flex).
  SDPA and PyTorch's context parallel take no document masks, so their configs skip them.
* distattn-STRATEGY (impl distattn-py): distattn's own Python package in the same harness,
  `distattn.distributed.ContextParallel(strategy=STRATEGY, mask=...)` on each rank's shards
  (the package must be importable), for every mask: the path a PyTorch training loop takes,
  timed like the peers; its memory adds distattn's workspace (held in the device's memory pool,
  outside torch's statistics) to torch's peak.

usage: torch_cp.py --world 4 --seqs 32768,131072 --passes fwd,fwdbwd --heads 32 --kv-heads 8
                   --out FILE [--iters 3] [--probe-seqs 524288] [--configs ...] [--masks causal,full]
                   [--doc-lens F.json,...] (each mask of these files is also run)
       torch_cp.py --world 4 --a2a-mb 8,24,48,96,192 --iters 20 --out FILE
       torch_cp.py --check-docs
(the second: the machine's all-to-all rate through PyTorch's NCCL, rows impl torch-a2a with
mb_per_rank, ms, send_gb_per_s; what distattn-multigpu-bench `links` measures for distattn)
Rows: impl, pass, causal, batch, seq, heads, head_dim, dtype, tflops, gpus, strategy, mask,
kv_heads, tflops_per_gpu, ms, mem_gb_per_gpu, gqa (native / expanded K,V heads).
"""
import argparse
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def cp_api():
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:  # newer layouts
        from torch.distributed.tensor.experimental._context_parallel._attention import set_rotate_method
    return context_parallel, set_rotate_method


def set_load_balance(on):
    """PyTorch's CP balances causal work only, and refuses full masks while balancing ("Load
    balancing requires is_causal=True", seen on every config, Ulysses included, once CP ran)."""
    try:
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    _cp_options.enable_load_balance = on


WARM = 1  # warm-up iterations of the job at hand (0 for the longest-sequence probe)
# Warm-up: about WARM_S seconds of the job's work at a nominal WARM_RATE_PER_GPU, at least one
# run: the rule of distattn-multigpu-bench, so both sides are timed after the same warm-up (the
# first tens of milliseconds of load run at clocks the power cap then takes back).
WARM_S, WARM_RATE_PER_GPU = 0.3, 500e12


def warm_runs(job_flops, gpus):
    return min(max(math.ceil(WARM_S * WARM_RATE_PER_GPU * gpus / job_flops), 1), 1000)


BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def area(seq, causal, lens=None):
    """Kept query-key pairs: of the whole sequence, or inside each document of `lens`."""
    if lens is not None:
        return sum(area(n, causal) for n in lens)
    return seq * (seq + 1) / 2 if causal else seq * seq


def flops(seq, heads, d, fwdbwd, causal, lens=None):
    f = 4.0 * area(seq, causal, lens) * d * heads
    return f * (3.5 if fwdbwd else 1.0)


def timed(fn, iters, warm=None):
    warm = WARM if warm is None else warm
    ts = []
    for i in range(warm + iters):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= warm:
            ts.append(t.item() * 1e3)
    ts.sort()
    return ts[len(ts) // 2], ts


def pass_step(attn, q, k, v, do, fwdbwd):
    """One timed call of `attn(q, k, v)`: without gradients, or with its backward from dO."""
    def step():
        if fwdbwd:
            attn(*(t.detach().requires_grad_() for t in (q, k, v))).backward(do)
        else:
            with torch.no_grad():
                attn(q, k, v)
    return step


def describe(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def failure(e, rank):
    """A config's error row (the traceback on rank 0 with TORCH_CP_TRACE set)."""
    if rank == 0 and os.environ.get("TORCH_CP_TRACE"):
        traceback.print_exc()
    torch.cuda.synchronize()
    return {"error": describe(e)}


class _A2A(torch.autograd.Function):
    """all_to_all_single over dim 0 chunks; backward is the same exchange."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, g):
        # Gradients may arrive non-contiguous (permuted views); empty_like would keep their
        # strides and all_to_all_single needs contiguous buffers ("Tensors must be contiguous",
        # seen on the 2026-11-22 H200 run).
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g)
        return out


def scatter_heads(x, P):
    """[B, S/P, H, D] sequence shards -> [P (seq chunk), B, S/P, H/P, D]: every rank's tokens of
    this rank's heads (the all-to-all)."""
    B, s, H, D = x.shape
    return _A2A.apply(x.reshape(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous())


def gather_heads(y):
    """[P (head group), B, S/P, h, D] (contiguous) -> [B, S/P, P·h, D]: back to sequence shards."""
    P, B, s, h, D = y.shape
    return _A2A.apply(y).permute(1, 2, 0, 3, 4).reshape(B, s, P * h, D)


def seq_to_head(x, P):
    # [B, S/P, H, D] -> [B, H/P, S, D] (SDPA's layout)
    y = scatter_heads(x, P)
    _, B, s, h, D = y.shape
    return y.permute(1, 3, 0, 2, 4).reshape(B, h, P * s, D)


def head_to_seq(o, P):
    # [B, H/P, S, D] -> [B, S/P, H, D]
    B, h, S, D = o.shape
    return gather_heads(o.reshape(B, h, P, S // P, D).permute(2, 0, 3, 1, 4).contiguous())


def sdpa(q, k, v, gqa, causal):
    if gqa == "native":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    if k.shape[1] != q.shape[1]:
        r = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_ulysses(args, seq, fwdbwd, P, rank, backend, causal):
    B, H, Hkv, D = 1, args.heads, args.kv_heads, 128
    s = seq // P
    g = torch.Generator(device="cuda").manual_seed(rank)
    mk = lambda h: torch.randn(B, s, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(H), mk(Hkv), mk(Hkv), mk(H)
    res = {}
    for gqa in ("native", "expanded"):
        attn = lambda q, k, v, gqa=gqa: head_to_seq(sdpa(*(seq_to_head(t, P) for t in (q, k, v)), gqa, causal), P)  # noqa: E731
        step = pass_step(attn, q, k, v, do, fwdbwd)

        def pinned():
            with sdpa_kernel([BACKENDS[backend]]):  # forward and backward on this backend
                step()
        try:
            ms, ts = timed(pinned, args.iters)
            res = {"ms": ms, "iters_ms": ts, "gqa": gqa}
            break
        except Exception as e:  # noqa: BLE001
            res = failure(e, rank)
    return res


def seq_to_tokens(x, P):
    # [1, S/P, H, D] -> [S, H/P, D] (varlen's packed layout)
    y = scatter_heads(x, P)
    return y.reshape(-1, *y.shape[3:])


def tokens_to_seq(o, P):
    # [S, h, D] -> [1, S/P, P·h, D]
    S, h, D = o.shape
    return gather_heads(o.reshape(P, 1, S // P, h, D))


def doc_attention(kind, lens, causal, seq):
    """f(q, k, v) on [S, H, D] tokens with attention inside each document of `lens`."""
    if kind == "varlen":
        import inspect
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        kw = {"enable_gqa": True} if "enable_gqa" in params else {}
        if causal:  # the keyword changed between releases
            kw.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
        cu = torch.tensor([0] + lens, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return lambda q, k, v: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **kw)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

    def keep(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        return same & (qi >= ki) if causal else same
    bm = torch.compile(create_block_mask)(keep, None, None, seq, seq, device="cuda")  # compiled: no S² entries
    flex = torch.compile(flex_attention, dynamic=False)
    # flex takes [B, H, S, D]
    return lambda q, k, v: flex(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=bm, enable_gqa=True)[0].transpose(0, 1)


def run_ulysses_docs(args, seq, fwdbwd, P, rank, kind, lens, causal):
    H, Hkv, D = args.heads, args.kv_heads, 128
    s = seq // P
    g = torch.Generator(device="cuda").manual_seed(rank)
    mk = lambda h: torch.randn(1, s, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(H), mk(Hkv), mk(Hkv), mk(H)
    try:
        inner = doc_attention(kind, lens, causal, seq)
        attn = lambda q, k, v: tokens_to_seq(inner(seq_to_tokens(q, P), seq_to_tokens(k, P), seq_to_tokens(v, P)), P)  # noqa: E731
        ms, ts = timed(pass_step(attn, q, k, v, do, fwdbwd), args.iters)
        return {"ms": ms, "iters_ms": ts, "gqa": "native"}
    except Exception as e:  # noqa: BLE001
        return failure(e, rank)


DOC_KINDS = ("varlen", "flex")


def check_doc_peers():
    """The document peers against SDPA's math backend with the dense mask, on one GPU, forward
    and gradients (1.5k tokens, 8/2 heads, lengths that split tiles): exit status 1 where an
    error passes 1% of the reference's largest magnitude (bf16 outputs round at 0.4%)."""
    lens, H, Hkv, D = [300, 1000, 1, 235], 8, 2, 128
    S, ok = sum(lens), True
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(S, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, Hkv, Hkv, H))
    for causal in (False, True):
        keep = doc[:, None] == doc[None, :]
        if causal:
            keep &= torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
        x = [t.detach().double().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in x), attn_mask=keep, enable_gqa=True).transpose(0, 1)
        ref.backward(do.double())
        for kind in DOC_KINDS:
            try:
                y = [t.detach().requires_grad_() for t in (q, k, v)]
                o = doc_attention(kind, lens, causal, S)(*y)
                o.backward(do)
                errs = [((a.double() - b).abs().max() / b.abs().max()).item()
                        for a, b in zip([o] + [t.grad for t in y], [ref] + [t.grad for t in x])]
                good = max(errs) < 1e-2
                print(f"[check] {kind:6s} causal={causal}: max error / max |f64| O {errs[0]:.1e}, dQ {errs[1]:.1e}, "
                      f"dK {errs[2]:.1e}, dV {errs[3]:.1e} {'ok' if good else 'FAIL'}", flush=True)
            except Exception as e:  # noqa: BLE001
                good = False
                print(f"[check] {kind:6s} causal={causal}: {describe(e)}", flush=True)
            ok &= good
    return 0 if ok else 1


def run_distattn(args, seq, fwdbwd, P, rank, strategy, mask):
    import distattn.distributed as dd
    H, Hkv, D = args.heads, args.kv_heads, 128
    try:
        cp = dd.ContextParallel(strategy=strategy, mask=mask, num_heads=H, num_kv_heads=Hkv)
        n = len(cp.position_ids(seq))
        g = torch.Generator(device="cuda").manual_seed(rank)
        mk = lambda h: torch.randn(1, n, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, v, do = mk(H), mk(Hkv), mk(Hkv), mk(H)
        step = pass_step(lambda q, k, v: cp.attention(q, k, v, seq_len=seq), q, k, v, do, fwdbwd)
        # distattn's workspace comes from the device's memory pool, which torch's statistics
        # miss: it is what the device lost beyond torch's reserve over the timed calls, after a
        # first call has set up the communicator and kernels (0 where the pool is trimmed at
        # every synchronisation, as before release_cached_memory existed).
        step()
        release = getattr(dd, "release_cached_memory", None)  # absent from older builds
        if release:
            release()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0, reserved0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        ms, ts = timed(step, args.iters)
        torch.cuda.synchronize()
        held = (free0 - torch.cuda.mem_get_info()[0]) - (torch.cuda.memory_reserved() - reserved0)
        return {"ms": ms, "iters_ms": ts, "gqa": "native", "workspace_gb": max(held, 0) / 1e9}
    except Exception as e:  # noqa: BLE001
        return failure(e, rank)


def run_cp(args, seq, fwdbwd, P, rank, rotate, backend, mesh, causal):
    context_parallel, set_rotate_method = cp_api()
    B, H, Hkv, D = 1, args.heads, args.kv_heads, 128
    g = torch.Generator(device="cuda").manual_seed(0)  # same full tensors on every rank
    res = {}
    for gqa in ("native", "expanded"):
        q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        hk = Hkv if gqa == "native" else H
        k = torch.randn(B, hk, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, hk, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        try:
            set_rotate_method(rotate)
            with sdpa_kernel([BACKENDS[backend]]):
                with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, do}):
                    attn = lambda q, k, v, gqa=gqa: sdpa(q, k, v, gqa, causal)  # noqa: E731
                    ms, ts = timed(pass_step(attn, q, k, v, do, fwdbwd), args.iters)
            res = {"ms": ms, "iters_ms": ts, "gqa": gqa}
            break
        except Exception as e:  # noqa: BLE001
            res = failure(e, rank)
        finally:
            del q, k, v, do
            torch.cuda.empty_cache()
    return res


def write(path, rows):
    out = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def worker(rank, args, port, out_q):
    P = args.world
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    rows = (a2a_rows if args.a2a_mb else peer_rows)(args, rank, P)
    if rank == 0:
        out_q.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def a2a_rows(args, rank, P):
    """all_to_all_single per size of --a2a-mb (MB each rank holds, 1/P of it staying local):
    median ms by CUDA events over --iters after 3 warm-ups, slowest rank, and GB/s each rank
    sends ((P-1)/P of its bytes over that time)."""
    rows = []
    for mb in (int(m) for m in args.a2a_mb.split(",")):
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
        row = {"impl": "torch-a2a", "gpus": P, "mb_per_rank": mb, "ms": t.item(),
               "send_gb_per_s": n * (P - 1) / P / t.item() / 1e6}
        rows.append(row)
        if rank == 0:
            print(f"[a2a] {mb:>5} MB per rank: {row['ms']:.3f} ms, {row['send_gb_per_s']:.0f} GB/s sent per rank", flush=True)
    return rows


def peer_rows(args, rank, P):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (P,))
    rows = []
    configs = args.configs.split(",")
    seqs = [int(s) for s in args.seqs.split(",") if s]
    passes = args.passes.split(",")
    docs = {}  # mask spec -> (causal inside, {seq: lens})
    for f in (f for f in args.doc_lens.split(",") if f):
        d = json.load(open(f))
        docs[d["mask"]] = (d["causal"], {int(n): lens for n, lens in d["lens"].items()})
    masks = [m for m in args.masks.split(",") if m] + list(docs)
    # Document masks run on the document configs only, causal and full on the others.
    fits = lambda c, m: c.startswith("distattn-") or (c.split("-")[1] in DOC_KINDS) == (m in docs)
    jobs = [(seq, p, c, m) for m in masks for seq in seqs for p in passes for c in configs if fits(c, m)]
    jobs += [(int(s), "fwdbwd", configs[0], "causal") for s in args.probe_seqs.split(",") if s]
    global WARM
    n_main = len(jobs) - len([s for s in args.probe_seqs.split(",") if s])
    for ji, (seq, p, c, mask) in enumerate(jobs):
        fwdbwd, causal = p == "fwdbwd", mask == "causal"
        lens = docs[mask][1][seq] if mask in docs else None
        set_load_balance(causal)
        probe = ji >= n_main
        if probe:  # one cold iteration
            WARM, args.iters = 0, 1
        else:
            job_causal = docs[mask][0] if lens is not None else causal
            WARM = warm_runs(flops(seq, args.heads, 128, fwdbwd, job_causal, lens), P)
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        rot, be = c.split("-", 1)
        if rot == "distattn":
            r = run_distattn(args, seq, fwdbwd, P, rank, be, mask)
            imp = "distattn-py"
            causal = docs[mask][0] if lens is not None else causal
        elif lens is not None:
            causal = docs[mask][0]
            r = run_ulysses_docs(args, seq, fwdbwd, P, rank, be, lens, causal)
            imp = "torch-ulysses"
        elif rot == "ulysses":
            r = run_ulysses(args, seq, fwdbwd, P, rank, be, causal)
            imp = "torch-ulysses"
        else:
            r = run_cp(args, seq, fwdbwd, P, rank, rot, be, mesh, causal)
            imp = "torch-cp"
        mem = torch.cuda.max_memory_allocated() / 1e9 + r.get("workspace_gb", 0.0)
        memt = torch.tensor([mem], device="cuda")
        dist.all_reduce(memt, op=dist.ReduceOp.MAX)
        row = {"impl": imp, "pass": "fwd+bwd" if fwdbwd else "fwd", "causal": causal, "batch": 1, "seq": seq,
               "heads": args.heads, "head_dim": 128, "dtype": "bf16", "gpus": P, "strategy": c, "mask": mask,
               "kv_heads": args.kv_heads, "mem_gb_per_gpu": memt.item(), "probe": probe}
        if "ms" in r:
            tf = flops(seq, args.heads, 128, fwdbwd, causal, lens) / r["ms"] / 1e9
            row.update({"tflops": tf, "tflops_per_gpu": tf / P, "ms": r["ms"], "iters_ms": r["iters_ms"], "gqa": r["gqa"]})
        else:
            row.update({"tflops": None, "tflops_per_gpu": None, "error": r.get("error")})
        if rank == 0:
            msg = f"{row['tflops_per_gpu']:.1f} TFLOP/s/GPU {row['ms']:.2f} ms gqa={row['gqa']}" if "ms" in r else f"ERROR {row['error']}"
            print(f"[torch] {imp:14s} {c:16s} {mask:6s} seq {seq:>7} {row['pass']:8s} {msg} mem {row['mem_gb_per_gpu']:.1f} GB ({time.time() - t0:.0f} s)", flush=True)
            rows.append(row)
            write(args.out, rows)  # partial results survive a later failure
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--configs", default="allgather-flash,alltoall-flash,allgather-cudnn,alltoall-cudnn,ulysses-flash,ulysses-cudnn,"
                    "ulysses-varlen,ulysses-flex")
    ap.add_argument("--probe-seqs", default="")
    ap.add_argument("--masks", default="causal", help="causal and/or full, ','-separated")
    ap.add_argument("--doc-lens", default="", help="','-separated JSON files of `distattn-multigpu-bench doc-lens`")
    ap.add_argument("--a2a-mb", default="", help="instead: all_to_all_single rates at these MB a rank")
    ap.add_argument("--check-docs", action="store_true", help="instead: check the document peers on one GPU")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.check_docs:
        return check_doc_peers()
    if not args.out:
        ap.error("--out is required")
    port = 29400 + os.getpid() % 500
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, port, q), nprocs=args.world, join=True)
    write(args.out, q.get())


if __name__ == "__main__":
    sys.exit(main())
