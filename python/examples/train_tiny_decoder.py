#!/usr/bin/env python3
"""Trains a tiny decoder-only transformer on the CPU for a few steps, twice from the same
weights and data: once with distattn.flash_attn_func and once with PyTorch's
scaled_dot_product_attention. The two loss curves must agree (float32) and go down.

    python python/examples/train_tiny_decoder.py [--steps 20]
"""

import argparse
import copy
import sys

import torch
import torch.nn.functional as F

import distattn

VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 2, 128, 4


def attend_distattn(q, k, v):
    # q [b, n, h, d], k and v [b, n, hkv, d]: flash-attn's layout, grouped-query heads.
    return distattn.flash_attn_func(q, k, v, causal=True)


def attend_sdpa(q, k, v):
    # SDPA takes [b, h, n, d].
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return o.transpose(1, 2)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D_MODEL // HEADS
        self.norm1, self.norm2 = torch.nn.LayerNorm(D_MODEL), torch.nn.LayerNorm(D_MODEL)
        self.qkv = torch.nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * self.hd, bias=False)
        self.proj = torch.nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(), torch.nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, attend):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * self.hd, KV_HEADS * self.hd, KV_HEADS * self.hd], dim=-1)
        y = attend(q.view(b, n, HEADS, self.hd), k.view(b, n, KV_HEADS, self.hd), v.view(b, n, KV_HEADS, self.hd))
        x = x + self.proj(y.reshape(b, n, D_MODEL))
        return x + self.mlp(self.norm2(x))


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens, attend):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, attend)
        return self.head(x)


def batches(steps):
    """A learnable task: runs that count up from a random start, mod VOCAB."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        t = (start + torch.arange(SEQ + 1)) % VOCAB
        yield t[:, :-1], t[:, 1:]


def train(model, attend, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in batches(steps):
        loss = F.cross_entropy(model(x, attend).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    model = Decoder()
    ours = train(copy.deepcopy(model), attend_distattn, steps)
    theirs = train(copy.deepcopy(model), attend_sdpa, steps)
    print("step  distattn    sdpa        |diff|")
    for i, (a, b) in enumerate(zip(ours, theirs)):
        print(f"{i:4d}  {a:.6f}  {b:.6f}  {abs(a - b):.1e}")
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    ok = worst < 1e-4 and ours[-1] < ours[0] - 1.0
    print(f"largest difference {worst:.1e}; loss {ours[0]:.3f} -> {ours[-1]:.3f}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
