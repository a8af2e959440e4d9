"""Random cases for every entry point, each checked against the float64 reference: forward
O and LSE and backward dQ, dK, dV on fresh random inputs."""

import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import distattn
import f64


@dataclass
class Case:
    name: str
    q: torch.Tensor  # as the call takes it (maybe non-contiguous or packed)
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor  # [n, m] over the call's (packed) tokens
    call: Callable  # (q, k, v) -> (o, lse), the call's own layouts
    batched: Callable  # (o, lse) -> ([b, n, h, d], [b, h, n])
    scale: Optional[float]


def _tensor(shape, dtype, device, rng, transposed):
    """Standard normal values; `transposed` makes a non-contiguous view of the same shape."""
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    if transposed and len(shape) == 4:
        b, n, h, d = shape
        return torch.randn(b, h, n, d, generator=gen).to(dtype).to(device).transpose(1, 2)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


def _parts(rng, n, smallest=1):
    """Random positive lengths adding up to n."""
    cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 4)))) if n > 1 else []
    lens = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    return lens if min(lens) >= smallest else [n]


def _spec(rng, n, m):
    """A random mask spec for an n x m score matrix (square specs only when n == m)."""
    bound = lambda: "-" if rng.random() < 0.3 else str(rng.randint(0, max(n, m)))  # noqa: E731
    choices = ["causal", "full", "window", "blocks"]
    if n == m:
        choices += ["docs", "docs-causal", "prefix", "shared-question", "block-causal", "window-global"]
    name = rng.choice(choices)
    if name in ("causal", "full"):
        return name
    if name == "window":
        return f"window:{bound()},{bound()}"
    if name == "window-global":
        return f"window-global:{bound()},{bound()},{rng.randint(0, n)}"
    if name in ("docs", "docs-causal"):
        return f"{name}:{','.join(map(str, _parts(rng, n)))}"
    if name == "prefix":
        return f"prefix:{rng.randint(1, n)}"
    if name == "shared-question" and n >= 2:
        q = rng.randint(1, n - 1)
        return f"shared-question:{q},{','.join(map(str, _parts(rng, n - q)))}"
    if name == "block-causal":
        return f"block-causal:{rng.randint(1, 64)}"
    bq, bk = rng.randint(1, 64), rng.randint(1, 64)
    bits = "".join(rng.choice("01") for _ in range(-(-n // bq) * -(-m // bk)))
    return f"blocks:{bq},{bk}:{bits}"


def _window(rng, n, m):
    side = lambda: rng.choice([-1, -1, 0, 1, rng.randint(0, max(n, m))])  # noqa: E731
    return (side(), side())


def make_case(seed, device, dtypes, head_dims, max_len, kinds=("flash", "varlen", "attention")):
    rng = random.Random(seed)
    dtype, d, kind = rng.choice(dtypes), rng.choice(head_dims), rng.choice(kinds)
    # Large head dims get shorter sequences: the float64 reference dominates the run time.
    max_len = max_len if d <= 96 else max_len // 2
    hkv = rng.choice([1, 1, 2, 4])
    h = hkv * rng.choice([1, 2, 4])
    scale = rng.choice([None, None, rng.uniform(0.5, 2.0) / d**0.5])
    transposed = rng.random() < 0.3
    tensor = lambda shape: _tensor(shape, dtype, device, rng, transposed)  # noqa: E731
    if kind == "varlen":
        nseq = rng.randint(1, 4)
        q_lens = [rng.choice([1, rng.randint(0, max_len // 2)]) for _ in range(nseq)]
        k_lens = [rng.choice([ql, rng.randint(0, max_len // 2)]) for ql in q_lens]
        q_lens[0], k_lens[0] = max(q_lens[0], 1), max(k_lens[0], 1)
        cu_q = [0] + [sum(q_lens[: i + 1]) for i in range(nseq)]
        cu_k = [0] + [sum(k_lens[: i + 1]) for i in range(nseq)]
        causal, win = rng.random() < 0.5, _window(rng, max_len, max_len)
        left, right = win[0], 0 if causal else win[1]
        q, k, v = tensor([cu_q[-1], h, d]), tensor([cu_k[-1], hkv, d]), tensor([cu_k[-1], hkv, d])
        cq, ck = (torch.tensor(c, dtype=torch.int32, device=device) for c in (cu_q, cu_k))

        def call(q, k, v):
            return distattn.flash_attn_varlen_func(
                q, k, v, cq, ck, max(q_lens), max(k_lens), softmax_scale=scale, causal=causal,
                window_size=win, return_lse=True,
            )  # fmt: skip

        name = f"varlen cu_q={cu_q} cu_k={cu_k} causal={causal} window={win}"
        keep = f64.varlen_mask(cu_q, cu_k, left, right)
        return Case(name, q, k, v, keep, call, lambda o, lse: (o[None], None if lse is None else lse[None]), scale)
    b = rng.randint(1, 3)
    n = rng.choice([1, rng.randint(1, max_len)])
    m = rng.choice([n, rng.randint(1, max_len)])
    q, k, v = tensor([b, n, h, d]), tensor([b, m, hkv, d]), tensor([b, m, hkv, d])
    if kind == "flash":
        causal, win = rng.random() < 0.5, _window(rng, n, m)
        keep = f64.window(n, m, win[0], 0 if causal else win[1])
        name = f"flash causal={causal} window={win}"

        def call(q, k, v):
            return distattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=win, return_lse=True)
    else:
        spec = _spec(rng, n, m)
        keep, name = f64.dense_mask(spec, n, m), f"attention mask={spec}"

        def call(q, k, v):
            return distattn.attention(q, k, v, mask=spec, softmax_scale=scale, return_lse=True)

    return Case(name, q, k, v, keep, call, lambda o, lse: (o, lse), scale)


def check(case, tol, lse_tol):
    """Runs the case forward and backward and asserts its errors against float64."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    o, lse = case.call(q, k, v)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == torch.float32
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(o.dtype).to(o.device)
    bo, blse = case.batched(o, lse)
    bq, bk, bv = (case.batched(t, None)[0] for t in (q, k, v))
    bd_o = case.batched(d_o, None)[0].cpu()
    ro, rlse, grads = f64.attention(bq, bk, bv, case.keep, case.scale, bd_o, bo.cpu())
    errs = {"o": f64.rel_err(bo, ro), "lse": f64.lse_err(blse, rlse)}
    o.backward(d_o)
    for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), grads):
        assert got.dtype == q.dtype and got.shape == (q if name == "dq" else k).shape
        errs[name] = f64.rel_err(case.batched(got, None)[0], ref)
    bad = {n: e for n, e in errs.items() if e > (lse_tol if n == "lse" else tol)}
    desc = f"{case.name} q{tuple(case.q.shape)} k{tuple(case.k.shape)} {case.q.dtype} scale={case.scale}"
    assert not bad, f"{desc}: errors {errs} over tolerance {tol} (lse {lse_tol})"
    return errs
