"""``flash_attn_with_kvcache`` against a float64 reference written here from the definition
(each request's keys gathered through its page table, dense softmax): ragged batches in shuffled
pages of 1, 16 and 64 tokens and contiguous caches, GQA 32/8, 8/1 and 32/32, 1 and 4 query
rows, causal or not, appends that cross pages; bad input raises; on a GPU (skipped without one)
the same cases, and CUDA-graph capture of a step."""

import os

import pytest
import torch

import distattn

BASE_SEED = int(os.environ.get("DISTATTN_SEED", "20261123"))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(q, k_cache, v_cache, page_table, lengths, scale, causal):
    """O and natural-log LSE in float64 (LSE -inf, O 0 for a row without keys)."""
    b, s, h, d = q.shape
    hkv, ps = k_cache.shape[2], k_cache.shape[1]
    o = torch.zeros(b, s, h, d, dtype=torch.float64)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        pos = torch.arange(n)
        pages = page_table[i].long()[pos // ps]
        k = k_cache.double()[pages, pos % ps]  # [n, hkv, d]
        v = v_cache.double()[pages, pos % ps]
        k, v = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
        scores = torch.einsum("shd,nhd->hsn", q[i].double(), k) * scale
        keep = torch.ones(s, n, dtype=torch.bool)
        if causal:
            keep = pos[None, :] <= (n - s + torch.arange(s))[:, None]
        scores = scores.masked_fill(~keep, float("-inf"))
        seen = keep.any(dim=1)
        lse_i = torch.logsumexp(scores, dim=-1)  # [h, s]
        p = torch.exp(scores - lse_i[..., None]).nan_to_num(0.0)
        o[i] = torch.einsum("hsn,nhd->shd", p, v) * seen[:, None, None]
        lse[i] = torch.where(seen[None, :], lse_i, torch.tensor(float("-inf"), dtype=torch.float64))
    return o, lse


def paged_case(gen, b, s, h, hkv, d, page_size, lengths, new, dtype, device):
    """Caches with each request's pages drawn from a shuffled pool; q; new K/V (or None)."""
    per = [max(1, -(-(n + new) // page_size)) for n in lengths]
    pool = torch.randperm(sum(per) + 2, generator=gen)
    table = torch.full((b, max(per)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per):
        table[i, :n] = pool[at : at + n]
        at += n
    pages = sum(per) + 2
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    kc, vc = rnd(pages, page_size, hkv, d), rnd(pages, page_size, hkv, d)
    knew, vnew = (rnd(b, new, hkv, d), rnd(b, new, hkv, d)) if new else (None, None)
    return rnd(b, s, h, d), kc, vc, knew, vnew, table.to(device)


def tolerance(dtype, device):
    if device == "cuda":
        return 1e-2, 1e-3
    return (2e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-5)


def rel(x, r):
    return float((x.double().cpu() - r).norm() / r.norm().clamp_min(1e-1 * r.numel() ** 0.5))


def check_case(case_id, device, dtype, h, hkv, s, page_size, causal, new):
    gen = torch.Generator().manual_seed(BASE_SEED + case_id)
    dims = [32, 64, 128] if device == "cpu" else [64, 128, 192, 256]  # (the CUDA kernels' head dims)
    b, d = int(torch.randint(1, 5, (1,), generator=gen)), dims[case_id % len(dims)]
    lengths = torch.randint(0, 400, (b,), generator=gen).tolist()
    q, kc, vc, knew, vnew, table = paged_case(gen, b, s, h, hkv, d, page_size, lengths, new, dtype, device)
    kc0, vc0 = kc.clone(), vc.clone()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    o, lse = distattn.flash_attn_with_kvcache(
        q, kc, vc, knew, vnew, cache_seqlens=seqlens, page_table=table, causal=causal, return_lse=True
    )
    # The append, done by hand on the untouched copies, then the reference over them.
    for i, n in enumerate(lengths):
        for j in range(new):
            pos = n + j
            page = int(table[i, pos // page_size])
            kc0[page, pos % page_size], vc0[page, pos % page_size] = knew[i, j], vnew[i, j]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "the caches after the append"
    total = [n + new for n in lengths]
    ro, rl = reference(q.cpu(), kc0.cpu(), vc0.cpu(), table.cpu(), total, d**-0.5, causal)
    tol, lse_tol = tolerance(dtype, device)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (b, h, s)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(rl)), "rows without keys"
    fin = torch.isfinite(rl)
    assert rel(o, ro) < tol, (case_id, rel(o, ro))
    assert rel(lse.cpu()[fin], rl[fin]) < lse_tol, (case_id, rel(lse.cpu()[fin], rl[fin]))


CASES = [
    (h, hkv, s, page_size, causal, new)
    for (h, hkv) in [(32, 8), (8, 1), (32, 32)]
    for s in (1, 4)
    for page_size in (1, 16, 64)
    for (causal, new) in [(False, 0), (True, s)]
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case_id", range(len(CASES)))
def test_paged_against_float64(case_id, device):
    dtype = [torch.float32, torch.bfloat16, torch.float16][case_id % 3] if device == "cpu" else torch.bfloat16
    check_case(case_id, device, dtype, *CASES[case_id])


@pytest.mark.parametrize("device", DEVICES)
def test_contiguous_cache_default_lengths(device):
    gen = torch.Generator().manual_seed(BASE_SEED)
    dtype = torch.bfloat16
    q = torch.randn(3, 2, 8, 64, generator=gen).to(dtype).to(device)
    kc = torch.randn(4, 100, 2, 64, generator=gen).to(dtype).to(device)  # more rows than requests
    vc = torch.randn(4, 100, 2, 64, generator=gen).to(dtype).to(device)
    o = distattn.flash_attn_with_kvcache(q, kc, vc, causal=False)
    table = torch.arange(3, dtype=torch.int32).view(3, 1)
    ro, _ = reference(q.cpu(), kc.cpu(), vc.cpu(), table, [100] * 3, 64**-0.5, False)
    assert rel(o, ro) < 1e-2
    # An int cache_seqlens and flash-attn 2's block_table name.
    o2 = distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=100, block_table=table.to(device), causal=False)
    assert torch.equal(o, o2)


def test_causal_is_off_by_default_as_in_flash_attn():
    gen = torch.Generator().manual_seed(BASE_SEED)
    q, kc, vc = torch.randn(1, 4, 4, 32, generator=gen), torch.randn(1, 10, 2, 32, generator=gen), torch.randn(1, 10, 2, 32, generator=gen)
    default = distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10)
    assert torch.equal(default, distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, causal=False))
    assert not torch.equal(default, distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, causal=True))


def test_export_leaves_eager_calls_working():
    # Tracing (export, make_fx) runs the op on fake tensors: nothing it makes may be kept for
    # the eager calls after it (a contiguous cache's page table was, and broke them).
    class Step(torch.nn.Module):
        def forward(self, q, kc, vc, lens):
            return distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    gen = torch.Generator().manual_seed(BASE_SEED)
    q, kc, vc = torch.randn(3, 1, 4, 32, generator=gen), torch.randn(3, 20, 2, 32, generator=gen), torch.randn(3, 20, 2, 32, generator=gen)
    lens = torch.tensor([5, 20, 1], dtype=torch.int32)
    exported = torch.export.export(Step(), (q, kc, vc, lens))
    eager = Step()(q, kc, vc, lens)
    assert torch.equal(exported.module()(q, kc, vc, lens), eager)
    table = torch.arange(3, dtype=torch.int32).view(3, 1)
    ro, _ = reference(q, kc, vc, table, [5, 20, 1], 32**-0.5, False)
    assert rel(eager, ro) < 1e-5


def test_bad_input_raises():
    q = torch.randn(2, 1, 8, 64)
    kc, vc = torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    f = distattn.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="more than its 2 pages"):
        f(q, kc, vc, cache_seqlens=33, page_table=table)
    with pytest.raises(ValueError, match="page table"):
        f(q, kc, vc, cache_seqlens=20, page_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32))
    with pytest.raises(ValueError, match="query rows"):
        f(torch.randn(2, 17, 8, 64), kc, vc, cache_seqlens=20, page_table=table)
    with pytest.raises(ValueError, match="multiple of"):
        f(torch.randn(2, 1, 7, 64), kc, vc, cache_seqlens=20, page_table=table)
    with pytest.raises(ValueError, match="both k and v"):
        f(q, kc, vc, k=torch.randn(2, 1, 2, 64), cache_seqlens=1, page_table=table)
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        f(q, kc, vc, k=torch.randn(2, 1, 2, 64), v=torch.randn(2, 1, 2, 64), page_table=table)
    with pytest.raises(TypeError, match="v_cache is bfloat16, q is float32"):
        f(q, kc, vc.bfloat16(), cache_seqlens=1, page_table=table)
    with pytest.raises(ValueError, match="contiguous"):
        f(q, kc.transpose(1, 2), vc.transpose(1, 2), cache_seqlens=1, page_table=table)
    with pytest.raises(ValueError, match="negative"):
        f(q, kc, vc, cache_seqlens=torch.tensor([-1, 2]), page_table=table)
    with pytest.raises(ValueError, match="head dim"):
        f(torch.randn(2, 1, 8, 32), kc, vc, cache_seqlens=1, page_table=table)
    with pytest.raises(ValueError, match="overlaps k_cache"):
        f(q, kc, kc, k=torch.randn(2, 1, 2, 64), v=torch.randn(2, 1, 2, 64), cache_seqlens=3, page_table=table)
    both = torch.randn(5, 16, 2, 64)
    with pytest.raises(ValueError, match="overlaps k_cache"):
        f(q, both[:4], both[1:], cache_seqlens=3, page_table=table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_of_a_step():
    gen = torch.Generator().manual_seed(BASE_SEED)
    q, kc, vc, _, _, table = paged_case(gen, 4, 1, 32, 8, 128, 16, [3000, 10, 700, 1], 0, torch.bfloat16, "cuda")
    seqlens = torch.tensor([3000, 10, 700, 1], dtype=torch.int32, device="cuda")
    f = lambda: distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table)  # noqa: E731
    eager = f()  # loads the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f()
    q.copy_(torch.randn(q.shape, generator=gen).to(q))
    # Lengths change (within each request's pages): the graph replays, nothing re-captured.
    seqlens.copy_(torch.tensor([2000, 16, 1, 12], dtype=torch.int32))
    graph.replay()
    assert torch.equal(out, f()) and not torch.equal(out, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_plan_for_every_layer():
    gen = torch.Generator().manual_seed(BASE_SEED)
    lengths = [3000, 10, 700, 1]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    layers = [paged_case(gen, 4, 2, 32, 8, 128, 16, lengths, 2, torch.bfloat16, "cuda") for _ in range(3)]
    table = layers[0][5]
    plan = distattn.plan_kvcache(layers[0][0], layers[0][1], layers[0][2], seqlens, table, seqlen_new=2)
    for q, kc, vc, knew, vnew, _ in layers:
        kc2, vc2 = kc.clone(), vc.clone()
        planned = distattn.flash_attn_with_kvcache(
            q, kc, vc, knew, vnew, cache_seqlens=seqlens, page_table=table, plan=plan, return_lse=True
        )
        fresh = distattn.flash_attn_with_kvcache(
            q, kc2, vc2, knew, vnew, cache_seqlens=seqlens, page_table=table, return_lse=True
        )
        assert torch.equal(planned[0], fresh[0]) and torch.equal(planned[1], fresh[1])
        assert torch.equal(kc, kc2)
    with pytest.raises(ValueError, match="plan was made for"):
        q, kc, vc = layers[0][:3]
        distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, plan=plan)  # no new k/v


def test_plan_on_the_cpu_is_none():
    q, kc, vc = torch.randn(1, 1, 4, 32), torch.randn(1, 50, 2, 32), torch.randn(1, 50, 2, 32)
    assert distattn.plan_kvcache(q, kc, vc, cache_seqlens=50) is None
    with pytest.raises(ValueError, match="seqlen_new"):
        distattn.plan_kvcache(q, kc, vc, cache_seqlens=50, seqlen_new=-1)
