"""torch.compile(fullgraph=True) traces models that call distattn (through the custom ops'
fake implementations), and the compiled forward and backward equal eager ones; the ops pass
torch.library.opcheck."""

import pytest
import torch

import distattn


class Block(torch.nn.Module):
    def __init__(self, d_model=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d_model // heads
        self.q = torch.nn.Linear(d_model, d_model)
        self.kv = torch.nn.Linear(d_model, 2 * kv_heads * self.hd)
        self.out = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).unbind(2)
        y = distattn.flash_attn_func(q, k, v, causal=True)
        y = y + distattn.attention(q, k, v, mask=f"docs-causal:20,{n - 20}", softmax_scale=0.2)
        return self.out(y.reshape(b, n, -1))


def test_compiled_forward_and_backward_equal_eager():
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, fullgraph=True)
    # A second and third length retrace with dynamic shapes.
    for n in (48, 40, 56):
        x = torch.randn(2, n, 64)
        model.zero_grad()
        eager_out = model(x)
        eager_out.square().mean().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(x)
        out.square().mean().backward()
        assert torch.allclose(out, eager_out, atol=1e-6), n
        for p, g in zip(model.parameters(), eager_grads):
            assert torch.allclose(p.grad, g, atol=1e-6), n


def test_compiled_varlen_and_lse():
    q, k, v = (torch.randn(30, 4, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)

    def f(q, k, v):
        return distattn.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True, return_lse=True)

    (o, lse), (eo, e_lse) = torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v)
    assert torch.allclose(o, eo, atol=1e-6) and torch.allclose(lse, e_lse, atol=1e-6)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    eager_grads = torch.autograd.grad(eo, (q, k, v), d_o)
    for g, e in zip(grads, eager_grads):
        assert torch.allclose(g, e, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_opcheck(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(1, 24, 4, 64, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 20, 2, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.distattn.forward.default, (q, k, v, "causal", None, None, None))
    o, lse = torch.ops.distattn.forward(q, k, v, "causal", None, None, None)
    # The backward op has no double backward: it is checked on inputs that need no gradient.
    args = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), "causal", None, None, None)
    torch.library.opcheck(torch.ops.distattn.backward.default, args)
