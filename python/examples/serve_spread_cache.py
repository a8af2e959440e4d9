#!/usr/bin/env python3
"""Greedy generation with each request's KV cache spread over the ranks of a torchrun group
(``distattn.distributed.KVCacheGroup``, DistAttention): a request lives on a home rank, which
holds its queries and outputs; its keys and values are dealt out to every rank by the
placement, and each step's attention runs where they live (the queries travel, partial
outputs merge by log-sum-exp). A tiny decoder with random weights prefills a few prompts of
different lengths and decodes some tokens; rank 0 then checks the generated tokens and the
last logits against one process attending over the whole sequences with
``distattn.flash_attn_func``, and prints OK.

    torchrun --nproc-per-node 2 python/examples/serve_spread_cache.py     # CPU (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node 4 python/examples/serve_spread_cache.py --placement zigzag:256

One ``KVCacheGroup`` holds one layer's cache, so the model keeps one per layer; the later layers'
share the first one's communicator and step plans (``share_with``).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

import distattn
from distattn.distributed import KVCacheGroup

VOCAB, D_MODEL, HEADS, KV_HEADS, LAYERS, MAX_POS = 97, 64, 4, 2, 2, 512
HD = D_MODEL // HEADS


class TinyDecoder(torch.nn.Module):
    """Token and position embeddings, pre-norm layers of grouped-query attention and an MLP.
    ``attend(layer, q, k, v)`` is the attention of the new rows against their request's past."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.tok, self.pos = torch.nn.Embedding(VOCAB, D_MODEL), torch.nn.Embedding(MAX_POS, D_MODEL)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(D_MODEL) for _ in range(2 * LAYERS + 1))
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(D_MODEL, (HEADS + 2 * KV_HEADS) * HD) for _ in range(LAYERS))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(D_MODEL, D_MODEL) for _ in range(LAYERS))
        self.mlp = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(D_MODEL, 4 * D_MODEL), torch.nn.GELU(), torch.nn.Linear(4 * D_MODEL, D_MODEL)
            )
            for _ in range(LAYERS)
        )
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    @torch.no_grad()
    def forward(self, tokens, positions, attend):
        """Logits of ``tokens`` [rows] at ``positions`` [rows]."""
        x = self.tok(tokens) + self.pos(positions)
        for i in range(LAYERS):
            q, k, v = self.qkv[i](self.norms[2 * i](x)).split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], -1)
            o = attend(i, q.view(1, -1, HEADS, HD), k.view(1, -1, KV_HEADS, HD), v.view(1, -1, KV_HEADS, HD))
            x = x + self.proj[i](o.reshape(-1, D_MODEL))
            x = x + self.mlp[i](self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def generate(model, prompts, homes, new_tokens, placement, device):
    """Every rank runs every step; each passes the rows of the requests homed on it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first = KVCacheGroup(placement=placement)
    caches = [first] + [KVCacheGroup(share_with=first) for _ in range(LAYERS - 1)]
    for rid, home in homes.items():
        for c in caches:
            c.add(rid, home)
    seqs = {rid: list(p) for rid, p in prompts.items()}
    mine = [rid for rid in prompts if homes[rid] == rank]
    last_logits = {}
    for step in range(new_tokens):
        # The prompt first (its last row gives the first new token), then one token per request.
        batch = [(rid, len(seqs[rid]) if step == 0 else 1) for rid in prompts]
        rows = {rid: range(len(seqs[rid]) - n, len(seqs[rid])) for rid, n in batch}
        tokens = torch.tensor([seqs[rid][i] for rid in mine for i in rows[rid]], dtype=torch.long, device=device)
        positions = torch.tensor([i for rid in mine for i in rows[rid]], dtype=torch.long, device=device)
        logits = model(tokens, positions, lambda i, q, k, v: caches[i].step(batch, q, k, v))
        at = 0
        for rid in mine:
            at += len(rows[rid])
            last_logits[rid] = logits[at - 1]
            seqs[rid].append(int(logits[at - 1].argmax()))
    return {rid: seqs[rid] for rid in mine}, last_logits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placement", default="pages:16", help="pages:N, contiguous:CAPACITY or zigzag:CAPACITY")
    ap.add_argument("--new-tokens", type=int, default=6, help="tokens generated per request (at least 1)")
    args = ap.parse_args()
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TinyDecoder().to(device)
    g = torch.Generator().manual_seed(1)
    lengths = {"a": 150, "b": 9, "c": 64, "d": 1}
    prompts = {rid: torch.randint(VOCAB, (n,), generator=g).tolist() for rid, n in lengths.items()}
    homes = {rid: i % world for i, rid in enumerate(prompts)}
    seqs, logits = generate(model, prompts, homes, args.new_tokens, args.placement, device)
    everyone = [None] * world
    dist.all_gather_object(everyone, (seqs, {rid: x.cpu() for rid, x in logits.items()}))
    if rank == 0:
        ok = True
        for part_seqs, part_logits in everyone:
            for rid, seq in part_seqs.items():
                # The reference: the whole sequence but its last token, attended in one call.
                whole = torch.tensor(seq[:-1], device=device)
                pos = torch.arange(len(whole), device=device)
                ref = model(whole, pos, lambda i, q, k, v: distattn.flash_attn_func(q, k, v, causal=True))
                want = [int(t) for t in ref[len(prompts[rid]) - 1 :].argmax(-1)]
                err = ((part_logits[rid] - ref[-1].cpu()).abs().max() / ref[-1].abs().max()).item()
                same = want == seq[len(prompts[rid]) :]
                ok &= same and err < 1e-4
                print(
                    f"request {rid} (home rank {homes[rid]}, prompt {len(prompts[rid])}): generated "
                    f"{seq[len(prompts[rid]):]}, {'same as' if same else 'DIFFERENT from'} one process; "
                    f"last logits rel err {err:.1e}"
                )
        print(f"{world} ranks, placement {args.placement}: {'OK' if ok else 'MISMATCH'}")
    dist.destroy_process_group()
    return 0 if rank != 0 or ok else 1


if __name__ == "__main__":
    sys.exit(main())
