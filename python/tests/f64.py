"""An independent float64 reference: dense keep-masks written from each mask's definition (not
from distattn's code) and attention and its gradients by plain torch math."""

import math

import torch


def _ints(s):
    return [int(x) for x in s.split(",")]


def _segments(lens):
    """Segment id of every token of consecutive segments of `lens`."""
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def window(n, m, left, right):
    """flash-attn's window (-1 = no limit) around the bottom-right-aligned diagonal."""
    i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
    diag = i + m - n
    keep = torch.ones(n, m, dtype=torch.bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep


def dense_mask(spec, n, m):
    """The [n, m] keep-matrix of a mask spec string."""
    name, _, args = spec.partition(":")
    i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
    if name == "full":
        return torch.ones(n, m, dtype=torch.bool)
    if name == "causal":
        return window(n, m, -1, 0)
    if name == "window":
        left, right = (-1 if x == "-" else int(x) for x in args.split(","))
        return window(n, m, left, right)
    if name == "window-global":
        left, right, g = args.split(",")
        w = window(n, m, -1 if left == "-" else int(left), -1 if right == "-" else int(right))
        return w | (i < int(g)) | (j < int(g))
    if name in ("docs", "docs-causal"):
        seg = _segments(_ints(args))
        keep = seg[:, None] == seg[None, :]
        return keep & (j <= i) if name == "docs-causal" else keep
    if name == "prefix":
        p = int(args)
        return (j <= i) | ((i < p) & (j < p))
    if name == "shared-question":
        lens = _ints(args)
        seg = _segments(lens)
        own = (seg[:, None] == seg[None, :]) & (j <= i)
        return own | ((seg[None, :] == 0) & (seg[:, None] > 0))
    if name == "block-causal":
        b = int(args)
        return j < (i // b + 1) * b
    if name == "blocks":
        sizes, bits = args.split(":")
        bq, bk = _ints(sizes)
        nk = -(-m // bk)
        keep = torch.tensor([c == "1" for c in bits])
        return keep[(i // bq) * nk + j // bk]
    raise ValueError(f"no reference for mask {spec!r}")


def varlen_mask(cu_q, cu_k, left, right):
    """Keep-matrix of packed sequences, each with its own bottom-right-aligned window."""
    cu_q, cu_k = list(cu_q), list(cu_k)
    keep = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        (qa, qb), (ka, kb) = (cu_q[b], cu_q[b + 1]), (cu_k[b], cu_k[b + 1])
        if qb > qa and kb > ka:
            keep[qa:qb, ka:kb] = window(qb - qa, kb - ka, left, right)
    return keep


def attention(q, k, v, keep, scale=None, d_o=None, o_stored=None):
    """O, LSE (natural log; -inf where a row keeps nothing) and, given d_o, dQ, dK, dV, in
    float64 from q [b, n, h, d], k and v [b, m, hkv, d] as stored.

    The gradients are those of the exact computation whose backward, as flash-attn's, takes
    the row sums D = rowsum(dO * O) from O as stored (`o_stored`, in the output's dtype); an
    O rounded to bf16 shifts dS = P (dP - D) by an amount that rows' conditioning amplifies,
    which is the definition's, not the kernels' error. Without `o_stored`, D uses the exact O.
    """
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    group = h // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", q, kk) * scale
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that keep nothing: P = 0
    o = torch.einsum("bhnm,bmhd->bnhd", p, vv)
    if d_o is None:
        return o, lse, None
    d_o = d_o.double().cpu()
    o_d = o if o_stored is None else o_stored.detach().double().cpu()
    dp = torch.einsum("bnhd,bmhd->bhnm", d_o, vv)
    ds = p * (dp - (d_o * o_d).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhnm,bmhd->bnhd", ds, kk) * scale
    fold = lambda t: t.unflatten(2, (hkv, group)).sum(3)  # noqa: E731  (sum a KV head's query heads)
    dk = fold(torch.einsum("bhnm,bnhd->bmhd", ds, q) * scale)
    dv = fold(torch.einsum("bhnm,bnhd->bmhd", p, d_o))
    return o, lse, (dq, dk, dv)


def rel_err(x, r):
    """||x - r|| / max(||r||, 0.1 sqrt(n)) (the Rust tests' measure); inf on any non-finite x."""
    x = x.detach().double().cpu()
    r = r.double().cpu()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - r).norm() / max(r.norm().item(), 0.1 * math.sqrt(r.numel()))).item()


def lse_err(x, r):
    """-inf exactly where the reference is -inf, rel_err over the rest."""
    x, r = x.detach().double().cpu(), r.double().cpu()
    empty = r == -math.inf
    if not torch.equal(x[empty], r[empty]):
        return math.inf
    return rel_err(x[~empty], r[~empty]) if (~empty).any() else 0.0
