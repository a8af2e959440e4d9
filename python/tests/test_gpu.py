"""CUDA tensors (skipped without a GPU): random cases against float64 at the CUDA kernels'
tolerances, torch's current stream, and CUDA-graph capture of a forward and backward (the
ops never wait on the host)."""

import os

import pytest
import torch

import distattn
from cases import check, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BASE_SEED = int(os.environ.get("DISTATTN_SEED", "20261123"))
# The CUDA kernel tests' tolerances (crates/distattn-cuda/tests/gpu_kernels.rs).
TOL, LSE_TOL = 1e-2, 1e-3


@pytest.mark.parametrize("case_id", range(60))
def test_random_case_against_float64(case_id):
    case = make_case(BASE_SEED + case_id, "cuda", [torch.bfloat16, torch.float16], [64, 96, 128], max_len=1000)
    check(case, TOL, LSE_TOL)


@pytest.mark.parametrize("case_id", range(12))
def test_large_head_dims_against_float64(case_id):
    # d 192 and 256: the backward's dK/dV in two column halves (flash_bwd_dkdv).
    case = make_case(BASE_SEED + case_id, "cuda", [torch.bfloat16, torch.float16], [192, 256], max_len=600)
    check(case, TOL, LSE_TOL)


def _inputs(b=2, n=512, h=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return [make(b, n, h, d).requires_grad_() for _ in range(3)], make(b, n, h, d)


def _eager_grads(q, k, v, d_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    distattn.flash_attn_func(q, k, v, causal=True).backward(d_o)
    return q.grad, k.grad, v.grad


def test_runs_on_the_current_stream():
    (q, k, v), d_o = _inputs()
    expected = _eager_grads(q, k, v, d_o)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Queue work ahead on the side stream: a kernel launched on another stream would read
        # q before this scaling lands.
        torch.cuda._sleep(10_000_000)
        q2 = q.detach() * 1.0
        q2.requires_grad_()
        distattn.flash_attn_func(q2, k, v, causal=True).backward(d_o)
    torch.cuda.current_stream().wait_stream(side)
    for got, want in zip((q2.grad, k.grad, v.grad), expected):
        assert torch.equal(got, want)


def test_cuda_graph_captures_forward_and_backward():
    (q, k, v), d_o = _inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads the kernels and the mask's tile plans
        for _ in range(2):
            distattn.flash_attn_func(q, k, v, causal=True).backward(d_o)
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        distattn.flash_attn_func(q, k, v, causal=True).backward(d_o)
    for seed in (1, 2):
        (q_new, k_new, v_new), d_o_new = _inputs(seed=seed)
        with torch.no_grad():
            for dst, src in zip((q, k, v, d_o), (q_new, k_new, v_new, d_o_new)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip((q.grad, k.grad, v.grad), _eager_grads(q, k, v, d_o)):
            assert torch.equal(got, want)
