"""The FP8 (e4m3) forward: on the CPU (the dequantized values in f32) and, on an H100/H200, the
FP8 kernel, both against the float64 reference of the values the codes stand for; the bf16
kernel's error on the same values is printed beside the FP8 kernel's. Bad input is refused."""


import pytest
import torch

import distattn
from distattn import _ops
from f64 import attention as ref_attention
from f64 import dense_mask, lse_err, rel_err

E4M3 = torch.float8_e4m3fn


def _case(b, nq, nk, h, hkv, d=128, scaled=True, device="cpu", seed=0):
    """e4m3 Q, K, V of unit-scale values divided by per-(batch, KV head) descales in [0.5, 2],
    the descales, and the values the codes stand for (float64)."""
    g = torch.Generator().manual_seed(seed)
    descales = [torch.rand(b, hkv, generator=g) * 1.5 + 0.5 if scaled else torch.ones(b, hkv) for _ in range(3)]
    codes, values = [], []
    for (n, heads), ds in zip(((nq, h), (nk, hkv), (nk, hkv)), descales):
        per_head = ds.repeat_interleave(heads // hkv, dim=1).view(b, 1, heads, 1)
        x = (torch.randn(b, n, heads, d, generator=g) / per_head).to(E4M3)
        codes.append(x.to(device))
        values.append(x.double() * per_head.double())
    return codes, [d.to(device) if scaled else None for d in descales], values


def _errors(o, lse, values, spec):
    q, k, v = values
    ro, rlse, _ = ref_attention(q, k, v, dense_mask(spec, q.shape[1], k.shape[1]))
    return rel_err(o, ro), lse_err(lse, rlse)


CASES = [
    # (b, nq, nk, h, hkv, mask)
    (2, 257, 257, 4, 4, "full"),
    (2, 300, 300, 4, 2, "causal"),
    (2, 130, 333, 4, 1, "causal"),
    (3, 1, 500, 8, 2, "full"),
    (1, 400, 400, 4, 2, "window:64,0"),
    (1, 400, 400, 4, 1, "docs-causal:100,37,180,83"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[-1]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}")
def test_cpu_computes_the_dequantized_values_exactly(case):
    b, nq, nk, h, hkv, spec = case
    (q, k, v), ds, values = _case(b, nq, nk, h, hkv, d=64)
    o, lse = distattn.attention(q, k, v, spec, return_lse=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    eo, el = _errors(o, lse, values, spec)
    assert eo < 1e-2 and el < 1e-5, (eo, el)


def test_one_element_descales_apply_to_every_head():
    (q, k, v), _, _ = _case(2, 50, 60, 4, 2, scaled=False)
    s = torch.tensor([0.5])
    o = distattn.flash_attn_func(q, k, v, causal=True, q_descale=s, k_descale=s, v_descale=s)
    r = distattn.flash_attn_func(q.float() * 0.5, k.float() * 0.5, v.float() * 0.5, causal=True)
    assert torch.allclose(o.float(), r, atol=1e-2)


def test_fake_implementation_and_torch_compile():
    (q, k, v), ds, _ = _case(1, 40, 40, 2, 2)
    # (The schema check of opcheck compares tensors with ops torch lacks for float8 on the CPU.)
    torch.library.opcheck(_ops.forward_e4m3, (q, k, v, *ds, "causal", None), test_utils=("test_faketensor",))
    f = torch.compile(lambda q, k, v: distattn.flash_attn_func(q, k, v, causal=True, q_descale=ds[0]), fullgraph=True)
    assert torch.equal(f(q, k, v), distattn.flash_attn_func(q, k, v, causal=True, q_descale=ds[0]))


def test_bad_input_is_refused():
    (q, k, v), ds, _ = _case(2, 16, 16, 4, 2)
    with pytest.raises(TypeError, match="k must be too"):
        distattn.flash_attn_func(q, k.float(), v)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads\] = \[2, 2\]"):
        distattn.flash_attn_func(q, k, v, q_descale=torch.ones(3))
    with pytest.raises(ValueError, match="descales apply to float8_e4m3fn"):
        distattn.flash_attn_func(q.float(), k.float(), v.float(), q_descale=ds[0])
    with pytest.raises(TypeError, match="q_descale must be a torch.Tensor"):
        distattn.flash_attn_func(q, k, v, q_descale=0.5)


# ---------------------------------------------------------------- on an H100 / H200

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90a GPU"
)


@hopper
@pytest.mark.parametrize("case", CASES + [(1, 2048, 2048, 4, 2, "causal"), (1, 1100, 1100, 2, 2, "full")],
                         ids=lambda c: f"{c[-1]}-{c[1]}x{c[2]}-h{c[3]}/{c[4]}")  # fmt: skip
def test_fp8_kernel_against_float64(case):
    b, nq, nk, h, hkv, spec = case
    (q, k, v), ds, values = _case(b, nq, nk, h, hkv, device="cuda")
    o, lse = distattn.attention(q, k, v, spec, return_lse=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    eo, el = _errors(o, lse, values, spec)
    # The bf16 kernel on the same values (rounded to bf16), for the table.
    ob, lb = distattn.attention(*(x.to("cuda", torch.bfloat16) for x in values), spec, return_lse=True)
    bo, bl = _errors(ob, lb, values, spec)
    print(f"fp8 O {eo:.2e} LSE {el:.2e} | bf16 O {bo:.2e} LSE {bl:.2e}")
    assert eo < 3e-2 and el < 1e-3, (eo, el)


@hopper
def test_fp8_kernel_in_a_cuda_graph_and_refusals():
    (q, k, v), ds, _ = _case(1, 512, 512, 4, 2, device="cuda")
    run = lambda: distattn.flash_attn_func(q, k, v, causal=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])  # noqa: E731
    expected = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    (q64, k64, v64), _, _ = _case(1, 64, 64, 2, 2, d=64, device="cuda")
    with pytest.raises(ValueError, match="head dimension 64"):
        distattn.flash_attn_func(q64, k64, v64)
