"""distattn.checkpoint: the three policies give the same loss and gradients, and `remat` runs
one attention forward per layer and step where `layer` runs two (distattn's ops and, with
save_sdpa, PyTorch's SDPA)."""

import pytest
import torch
import torch.nn.functional as F

import distattn
import distattn.checkpoint as ck


class Layer(torch.nn.Module):
    def __init__(self, dim, heads, use_sdpa):
        super().__init__()
        self.heads, self.use_sdpa = heads, use_sdpa
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)  # [b, n, h, d]
        if self.use_sdpa:
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
        else:
            o = distattn.attention(q, k, v, mask="causal")
        return x + self.out(torch.tanh(o.flatten(-2)))


def _step(policy, use_sdpa, layers=3):
    torch.manual_seed(0)
    model = torch.nn.ModuleList(Layer(32, 4, use_sdpa) for _ in range(layers))
    x = torch.randn(2, 57, 32, requires_grad=True)
    with ck.count_attention_forwards() as count:
        h = x
        for layer in model:
            h = ck.checkpoint(layer, h, policy=policy, save_sdpa=True)
        loss = h.square().mean()
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return loss.item(), grads, count.forwards


@pytest.mark.parametrize("use_sdpa", [False, True])
def test_policies_agree_and_remat_halves_attention_forwards(use_sdpa):
    results = {p: _step(p, use_sdpa) for p in ck.POLICIES}
    loss0, grads0, _ = results["none"]
    for policy, (loss, grads, _) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-5), policy
        for g, g0 in zip(grads, grads0):
            assert torch.allclose(g, g0, rtol=1e-4, atol=1e-6), policy
    assert results["none"][2] == 3
    assert results["layer"][2] == 6
    assert results["remat"][2] == 3


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="policy"):
        ck.checkpoint(lambda x: x, torch.zeros(1), policy="sometimes")
