#!/usr/bin/env python3
"""Trains a Llama-style decoder on long sequences: one GPU, or one sequence split over the GPUs
of a torchrun group (context parallel), with a choice of attention and checkpoint policy.

Model: RMSNorm, RoPE, grouped-query attention, SwiGLU; by default the per-layer shapes of an 8B
Llama (hidden 4096, 32 query / 8 KV heads, head dim 128, FFN 14336) with a configurable layer
count, bf16 weights, AdamW. Data: synthetic token streams (a learnable rule with noise) or a
``.npy`` file of token ids. Gradients are summed over the context-parallel group.

Attention (``--attn``):
  distattn   distattn.flash_attn_func on one GPU; ContextParallel(--strategy) on several
  sdpa       torch's scaled_dot_product_attention (one process; --sdpa-backend)
  torch-cp   PyTorch's own context parallelism (torch.distributed.tensor.experimental) + SDPA
Checkpoint policy (``--policy``): none, layer (a checkpoint around each decoder layer, as
transformers does) or remat (the same, but the attention ops' outputs are saved, so backward
does not run the attention forward again; with SDPA this is PyTorch's selective checkpointing
of the SDPA op).

Prints per step: loss, seconds, tokens/s; then peak memory per GPU and the attention forward
ops one step runs. ``--json FILE`` writes it all (rank 0).

    torchrun --nproc-per-node 4 python/examples/train_llama.py --seq 131072 --layers 8 --policy remat
    python python/examples/train_llama.py --tiny --device cpu --steps 5      # anywhere, in seconds
"""

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distattn
import distattn.checkpoint as ck
import distattn.distributed as dd


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=["distattn", "sdpa", "torch-cp"], default="distattn")
    p.add_argument("--strategy", default="zigzag", help="distattn's context-parallel strategy (several processes)")
    p.add_argument("--sdpa-backend", choices=["cudnn", "flash", "efficient", "math", "auto"], default="cudnn")
    p.add_argument("--policy", choices=ck.POLICIES, default="remat")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=65536, help="tokens of the whole sequence (all ranks)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", help=".npy file of token ids (default: synthetic)")
    p.add_argument("--tiny", action="store_true", help="a small model and sequence (tests, CPUs)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--grads", help="save the first step's gradients here (rank 0; small models)")
    p.add_argument("--mlp-chunk", type=int, default=0, help="run the FFN on chunks of this many tokens, each recomputed in backward (0: whole); bounds the FFN's activations, whatever the sequence")
    a = p.parse_args()
    if a.tiny:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab = 2, 64, 4, 2, 128, 97
        a.seq = min(a.seq, 256)
    if a.device == "cpu" and a.dtype == "bf16" and a.attn != "distattn":
        a.dtype = "f32"
    return a


# ---------------------------------------------------------------- the model


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(positions, head_dim, base=500000.0):
    """cos and sin ``[n, head_dim]`` of the tokens' global positions."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    ang = positions.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x ``[b, n, h, d]``."""
    x1, x2 = x.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos[:, None] + rot.float() * sin[:, None]).to(x.dtype)


class Attention(torch.nn.Module):
    def __init__(self, a, attend):
        super().__init__()
        self.h, self.hkv, self.d = a.heads, a.kv_heads, a.hidden // a.heads
        self.wq = torch.nn.Linear(a.hidden, self.h * self.d, bias=False)
        self.wk = torch.nn.Linear(a.hidden, self.hkv * self.d, bias=False)
        self.wv = torch.nn.Linear(a.hidden, self.hkv * self.d, bias=False)
        self.wo = torch.nn.Linear(self.h * self.d, a.hidden, bias=False)
        self.attend = attend

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q = apply_rope(self.wq(x).view(b, n, self.h, self.d), cos, sin)
        k = apply_rope(self.wk(x).view(b, n, self.hkv, self.d), cos, sin)
        v = self.wv(x).view(b, n, self.hkv, self.d)
        return self.wo(self.attend(q, k, v).reshape(b, n, -1))


class Layer(torch.nn.Module):
    def __init__(self, a, attend):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(a.hidden), RMSNorm(a.hidden)
        self.attn = Attention(a, attend)
        self.gate = torch.nn.Linear(a.hidden, a.ffn, bias=False)
        self.up = torch.nn.Linear(a.hidden, a.ffn, bias=False)
        self.down = torch.nn.Linear(a.ffn, a.hidden, bias=False)
        self.mlp_chunk = a.mlp_chunk

    def mlp(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        if 0 < self.mlp_chunk < h.shape[1]:
            # The FFN's intermediates (3 x ffn per token) dominate a long sequence's memory;
            # chunk by chunk, recomputed in backward, only one chunk's exist at a time.
            chunks = [torch.utils.checkpoint.checkpoint(self.mlp, c, use_reentrant=False) for c in h.split(self.mlp_chunk, 1)]
            return x + torch.cat(chunks, 1)
        return x + self.mlp(h)


class Decoder(torch.nn.Module):
    def __init__(self, a, attend):
        super().__init__()
        self.embed = torch.nn.Embedding(a.vocab, a.hidden)
        self.layers = torch.nn.ModuleList(Layer(a, attend) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.head = torch.nn.Linear(a.hidden, a.vocab, bias=False)
        self.policy, self.save_sdpa = a.policy, a.attn != "distattn"
        for m in self.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids, positions, labels, total_tokens):
        cos, sin = rope(positions, self.layers[0].attn.d)
        x = self.embed(ids)
        for layer in self.layers:
            x = ck.checkpoint(layer, x, cos, sin, policy=self.policy, save_sdpa=self.save_sdpa)
        return chunked_loss(self.norm(x), self.head.weight, labels) / total_tokens


def chunked_loss(h, weight, labels, chunk=8192):
    """Summed cross-entropy of ``h @ weight.T`` against ``labels`` (-100: ignored), a chunk of
    tokens at a time and recomputed in backward, so the logits of a long sequence never exist
    at once."""

    def part(hc, lc):
        return F.cross_entropy((hc @ weight.t()).float().flatten(0, 1), lc.flatten(), ignore_index=-100, reduction="sum")

    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[1], chunk):
        total = total + torch.utils.checkpoint.checkpoint(part, h[:, s : s + chunk], labels[:, s : s + chunk], use_reentrant=False)
    return total


# ---------------------------------------------------------------- attention backends


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
        "auto": None,
    }[name]


def sdpa_attend(expand_kv):
    def attend(q, k, v):
        if expand_kv:  # PyTorch's context parallelism takes K/V with every query head
            rep = q.shape[2] // k.shape[2]
            k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=not expand_kv
        )
        return o.transpose(1, 2)

    return attend


# ---------------------------------------------------------------- data


def token_stream(a, step):
    """The whole sequence of a step, ``[1, seq + 1]`` (the same on every rank): a file's tokens,
    or a synthetic stream: a random motif of 97 tokens repeated, 10% of tokens replaced by noise
    (copying it is what induction heads learn; the loss falls as they form)."""
    if a.data:
        import numpy as np

        toks = np.load(a.data, mmap_mode="r")
        start = (step * a.seq) % max(1, len(toks) - a.seq - 1)
        return torch.from_numpy(np.asarray(toks[start : start + a.seq + 1], dtype=np.int64))[None] % a.vocab
    g = torch.Generator().manual_seed(a.seed * 1000003 + step)
    motif = torch.randint(0, a.vocab, (97,), generator=g)
    noise = torch.randint(0, a.vocab, (a.seq + 1,), generator=g)
    keep = torch.rand(a.seq + 1, generator=g) < 0.9
    return torch.where(keep, motif[torch.arange(a.seq + 1) % 97], noise)[None]


# ---------------------------------------------------------------- the run


def main():
    a = parse()
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.attn == "sdpa" and world > 1:
        sys.exit("--attn sdpa runs on one process; use distattn or torch-cp on several")

    cp = None
    if a.attn == "distattn" and world > 1:
        cp = dd.ContextParallel(strategy=a.strategy, mask="causal", num_heads=a.heads, num_kv_heads=a.kv_heads)
        attend = partial(cp.attention, seq_len=a.seq)  # the whole length known: no collective to find it
    elif a.attn == "distattn":
        attend = lambda q, k, v: distattn.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    else:
        attend = sdpa_attend(expand_kv=a.attn == "torch-cp")

    torch.manual_seed(a.seed)
    model = Decoder(a, attend).to(device=dev, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, **({"fused": True} if a.device == "cuda" else {}))
    mesh = None
    if a.attn == "torch-cp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(a.device, (world,))
    backends = sdpa_backend(a.sdpa_backend) if a.attn != "distattn" else None

    def step(s, count=False):
        full = token_stream(a, s).to(dev)
        ids, labels = full[:, :-1].contiguous(), full[:, 1:].contiguous()
        positions = torch.arange(a.seq, device=dev)
        if cp is not None:
            ids, labels, positions = cp.shard(ids, 1), cp.shard(labels, 1), cp.position_ids(a.seq, dev)
        counter = ck.count_attention_forwards() if count else None
        ctxs = []
        if backends is not None:
            from torch.nn.attention import sdpa_kernel

            ctxs.append(sdpa_kernel(backends))
        if mesh is not None:
            from torch.distributed.tensor.experimental import context_parallel

            pos = positions[None].clone()
            ctxs.append(context_parallel(mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, labels, pos}))
        if counter is not None:
            ctxs.append(counter)
        for c in ctxs:
            c.__enter__()
        try:
            p = pos[0] if mesh is not None else positions
            loss = model(ids, p, labels, a.seq)
            loss.backward()
        finally:
            for c in reversed(ctxs):
                c.__exit__(None, None, None)
        if world > 1:
            for prm in model.parameters():
                if prm.grad is not None:
                    dist.all_reduce(prm.grad)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        return loss.item(), (counter.forwards if counter is not None else None)

    rows = []
    forwards = None
    for s in range(a.steps):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, counted = step(s, count=(s == 0))
        if s == 0:
            forwards = counted
            if a.grads and rank == 0:
                torch.save({n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}, a.grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rows.append({"step": s, "loss": loss, "seconds": dt, "tokens_per_s": a.seq / dt})
        if rank == 0:
            print(f"step {s:3d}  loss {loss:.4f}  {dt:.3f} s  {a.seq / dt:,.0f} tokens/s", flush=True)
    if cp is not None:
        cp.synchronize()  # GPU calls return once queued: a failed last call is raised here
    timed = rows[2:] if len(rows) > 3 else rows[1:] or rows  # steps 0-1 warm up (and count ops)
    sec = sorted(r["seconds"] for r in timed)[len(timed) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
    # What the GPU has in use at the end: torch's cache, distattn's workspace (kept in the
    # device's memory pool, which torch's statistics miss), communicators and the context.
    used = (lambda f, t: (t - f) / 2**30)(*torch.cuda.mem_get_info()) if a.device == "cuda" else None
    peaks, useds = [peak], [used]
    if world > 1 and peak is not None:
        t = torch.tensor([peak, used], device=dev)
        got = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(got, t)
        peaks, useds = [float(x[0]) for x in got], [float(x[1]) for x in got]
    summary = {
        "attn": a.attn, "strategy": a.strategy if cp is not None else None, "policy": a.policy,
        "sdpa_backend": a.sdpa_backend if a.attn != "distattn" else None, "world": world, "seq": a.seq,
        "tokens_per_gpu": a.seq // world, "layers": a.layers, "hidden": a.hidden, "heads": a.heads,
        "kv_heads": a.kv_heads, "ffn": a.ffn, "vocab": a.vocab, "dtype": a.dtype, "mlp_chunk": a.mlp_chunk,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "median_step_s": sec, "tokens_per_s": a.seq / sec, "peak_gib_per_gpu": peaks, "device_used_gib_per_gpu": useds,
        "attention_forwards_per_step": forwards, "steps": rows,
    }  # fmt: skip
    if rank == 0:
        mem = f"{max(peaks):.1f} GiB peak per GPU ({max(useds):.1f} GiB in use on the device)" if peak is not None else "CPU"
        print(
            f"{a.attn}{'/' + a.strategy if cp is not None else ''} {a.policy}: {world} x {a.seq // world} tokens, "
            f"{sec:.3f} s/step, {a.seq / sec:,.0f} tokens/s, {mem}, {forwards} attention forwards per step"
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
