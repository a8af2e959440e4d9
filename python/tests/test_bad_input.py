"""Bad input raises ValueError or TypeError with a message that names the problem; never a
crash, a hang or a wrong answer."""

import pytest
import torch

import distattn


def qkv(b=1, n=16, m=16, h=4, hkv=2, d=32, dtype=torch.float32):
    return torch.randn(b, n, h, d, dtype=dtype), torch.randn(b, m, hkv, d, dtype=dtype), torch.randn(b, m, hkv, d, dtype=dtype)


Q, K, V = qkv()
CU = torch.tensor([0, 16], dtype=torch.int32)

CASES = [
    ("3-D q", lambda: distattn.flash_attn_func(Q[0], K, V), ValueError, "4-D"),
    ("5-D k", lambda: distattn.attention(Q, K[None], V), ValueError, "4-D"),
    ("not a tensor", lambda: distattn.flash_attn_func(Q.tolist(), K, V), TypeError, "torch.Tensor"),
    ("float64", lambda: distattn.flash_attn_func(*(t.double() for t in (Q, K, V))), TypeError, "float64"),
    ("int32", lambda: distattn.flash_attn_func(Q.int(), K.int(), V.int()), TypeError, "int32"),
    ("mixed dtypes", lambda: distattn.flash_attn_func(Q, K.half(), V), TypeError, "dtype"),
    ("head dims differ", lambda: distattn.flash_attn_func(Q, K[..., :16], V[..., :16]), ValueError, "head dim"),
    ("k and v differ", lambda: distattn.flash_attn_func(Q, K, V[:, :8]), ValueError, "v"),
    ("batches differ", lambda: distattn.flash_attn_func(Q, K.expand(2, -1, -1, -1), V.expand(2, -1, -1, -1)), ValueError, "batch"),
    ("heads not divisible", lambda: distattn.flash_attn_func(Q, *qkv(h=4, hkv=3)[1:]), ValueError, "multiple"),
    ("empty sequence", lambda: distattn.flash_attn_func(Q[:, :0], K, V), ValueError, "query length"),
    ("mask does not parse", lambda: distattn.attention(Q, K, V, mask="diagonal"), ValueError, "diagonal"),
    ("mask arguments", lambda: distattn.attention(Q, K, V, mask="window:1"), ValueError, "window"),
    ("mask does not fit", lambda: distattn.attention(Q, K, V, mask="docs:5,5"), ValueError, "add up"),
    ("mask not a string", lambda: distattn.attention(Q, K, V, mask=True), TypeError, "mask"),
    ("square mask, q_len != k_len", lambda: distattn.attention(Q, K[:, :8], V[:, :8], mask="prefix:3"), ValueError, "equal"),
    ("scale zero", lambda: distattn.flash_attn_func(Q, K, V, softmax_scale=0.0), ValueError, "scale"),
    ("scale nan", lambda: distattn.flash_attn_func(Q, K, V, softmax_scale=float("nan")), ValueError, "scale"),
    ("scale a string", lambda: distattn.flash_attn_func(Q, K, V, softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("window of one int", lambda: distattn.flash_attn_func(Q, K, V, window_size=4), ValueError, "window_size"),
    ("window below -1", lambda: distattn.flash_attn_func(Q, K, V, window_size=(-2, 0)), ValueError, "window_size"),
    ("varlen 4-D", lambda: distattn.flash_attn_varlen_func(Q, K, V, CU, CU, 16, 16), ValueError, "3-D"),
    ("cu_seqlens int64", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], CU.long(), CU, 16, 16), TypeError, "int32"),
    ("cu_seqlens 2-D", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], CU[None], CU, 16, 16), ValueError, "1-D"),
    ("cu_seqlens not from 0", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], CU + 1, CU, 16, 16), ValueError, "start at 0"),
    ("cu_seqlens decreasing", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], _cu(0, 9, 4, 16), CU, 16, 16), ValueError, "decrease"),
    ("cu_seqlens past the tokens", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], _cu(0, 20), CU, 20, 16), ValueError, "16 tokens"),
    ("sequence counts differ", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], _cu(0, 8, 16), CU, 8, 16), ValueError, "sequences"),
    ("options positional", lambda: distattn.flash_attn_func(Q, K, V, 0.0), TypeError, "positional"),
    ("dropout", lambda: distattn.flash_attn_func(Q, K, V, dropout_p=0.1), ValueError, "dropout"),
    ("varlen dropout", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 16, 16, dropout_p=0.5), ValueError, "dropout"),
    ("varlen options positional", lambda: distattn.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 16, 16, 0.1), TypeError, "positional"),
    ("kvcache lengths positional", lambda: distattn.flash_attn_with_kvcache(Q, K, V, None, None, 4), TypeError, "positional"),
    ("double backward", lambda: _double_backward(), RuntimeError, "differentiate"),
    ("one cu_seqlens", lambda: torch.ops.distattn.forward(Q, K, V, "causal", None, CU, None), ValueError, "both cu_seqlens"),
    ("packed, batch 2", lambda: _packed_twice(), ValueError, "batch of 1"),
]


def _packed_twice():
    # The same packed call with a batch of 1 (accepted) and then of 2: the second is refused
    # whatever the calls before it.
    torch.ops.distattn.forward(Q, K, V, "causal", None, CU, CU)
    q, k, v = (t.expand(2, -1, -1, -1).contiguous() for t in (Q, K, V))
    torch.ops.distattn.forward(q, k, v, "causal", None, CU, CU)


def _double_backward():
    # A gradient penalty needs attention's second derivative, which is not implemented: an
    # error, not a silently dropped term.
    q, k, v = (t.clone().requires_grad_() for t in (Q, K, V))
    (g,) = torch.autograd.grad(distattn.flash_attn_func(q, k, v, causal=True).square().sum(), q, create_graph=True)
    g.square().sum().backward()


def _cu(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize("what,call,error,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(what, call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment.lower() in str(info.value).lower(), f"{what}: {info.value}"


def test_dropout_zero_is_accepted():
    assert torch.equal(distattn.flash_attn_func(Q, K, V, dropout_p=0.0), distattn.flash_attn_func(Q, K, V))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_devices_differ_and_cuda_float32():
    with pytest.raises(ValueError, match="cuda"):
        distattn.flash_attn_func(Q.cuda(), K, V)
    with pytest.raises(TypeError, match="f32"):
        distattn.flash_attn_func(Q.cuda(), K.cuda(), V.cuda())


def test_unsupported_device():
    with pytest.raises(ValueError, match="meta"):
        distattn.flash_attn_func(Q.to("meta"), K.to("meta"), V.to("meta"))


def test_a_failed_call_leaves_the_library_usable():
    with pytest.raises(ValueError):
        distattn.attention(Q, K, V, mask="docs:1")
    assert torch.isfinite(distattn.attention(Q, K, V, mask="causal")).all()


def test_backward_workspace_contract():
    # A CPU backward takes no workspace; a GPU one takes delta, and the f32 dQ sums only where
    # backward_dq_workspace asks for them: never the sums without delta.
    from distattn import _native
    from distattn._ops import _desc

    assert _native.backward_dq_workspace(_desc(Q)) is False
    o, d_o, dq = (torch.zeros_like(Q) for _ in range(3))
    dk, dv = torch.zeros_like(K), torch.zeros_like(V)
    lse = torch.zeros(Q.shape[0], Q.shape[2], Q.shape[1])
    dq_acc = torch.zeros_like(Q)
    descs = [_desc(t) for t in (Q, K, V, o, lse, d_o, dq, dk, dv)]
    with pytest.raises(ValueError, match="without delta"):
        _native.backward(*descs, None, _desc(dq_acc), "full", None, None, 0)
