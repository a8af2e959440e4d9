"""Random cases on CPU tensors against float64: flash_attn_func (causal, windows),
flash_attn_varlen_func (ragged packed sequences, q and k lengths differing), attention (every
mask spec), f32/bf16/f16, GQA, head dims 16-256, lengths 1-300, non-contiguous inputs, rows
that keep no key. DISTATTN_SEED replays a run; each case's seed is its test id."""

import os

import pytest
import torch

from cases import check, make_case

BASE_SEED = int(os.environ.get("DISTATTN_SEED", "20261123"))
# Tolerances of the Rust tests (1e-5 against float64 on the inputs as stored) plus, for
# half-precision outputs, their rounding: the dtype's unit roundoff.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
LSE_TOL = 1e-5

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.mark.parametrize("case_id", range(200))
def test_random_case_against_float64(case_id):
    case = make_case(
        BASE_SEED + case_id, "cpu", [torch.float32, torch.bfloat16, torch.float16],
        [16, 32, 40, 64, 80, 96, 128, 192, 256], max_len=300,
    )  # fmt: skip
    check(case, TOL[case.q.dtype], LSE_TOL)


def test_reference_gradients_are_autograds():
    # The reference's gradient formula against autograd of its own forward (exact O).
    import f64

    q, k, v = (torch.randn(2, 7, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    keep = f64.window(7, 7, 2, 0)
    d_o = torch.randn(2, 7, 4, 8, dtype=torch.float64)
    o, _, grads = f64.attention(q, k, v, keep, 0.3, d_o)
    o_auto = _autograd_forward(q, k, v, keep, 0.3)
    for g, a in zip(grads, torch.autograd.grad(o_auto, (q, k, v), d_o)):
        assert torch.allclose(g, a, atol=1e-12)


def _autograd_forward(q, k, v, keep, scale):
    kk, vv = (t.repeat_interleave(2, dim=2) for t in (k, v))
    s = torch.einsum("bnhd,bmhd->bhnm", q, kk).mul(scale).masked_fill(~keep, float("-inf"))
    return torch.einsum("bhnm,bmhd->bnhd", torch.softmax(s, -1), vv)


def test_one_token_query_and_rows_that_keep_nothing():
    # Causal with more queries than keys: the first rows keep nothing (O = 0, LSE = -inf, no
    # NaN, zero gradient), as in flash-attn's bottom-right alignment.
    import distattn

    q = torch.randn(1, 9, 2, 32, requires_grad=True)
    k = torch.randn(1, 4, 2, 32, requires_grad=True)
    o, lse = distattn.flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert torch.all(o[:, :5] == 0) and torch.all(lse[:, :, :5] == float("-inf"))
    o.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[:, :5] == 0)
    one = distattn.flash_attn_func(q[:, -1:], k, k, causal=True)
    assert torch.allclose(one, o[:, -1:], atol=1e-6)
