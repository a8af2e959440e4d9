"""A transformers Llama built from a tiny config (random weights, nothing downloaded) with
attn_implementation="distattn" gives SDPA's logits and gradients, on one process and
context-parallel over 2 gloo processes."""

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import distattn.transformers as dt  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_distributed import _run  # noqa: E402

dt.register()


def _model(impl):
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _ids(n=75):
    return torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(3))


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_llama_with_distattn_equals_sdpa():
    ids = _ids()
    outs = {}
    for impl in ("sdpa", "distattn"):
        m = _model(impl)
        logits = m(ids).logits
        logits.square().mean().backward()
        outs[impl] = (logits.detach(), _grads(m))
    (l0, g0), (l1, g1) = outs["sdpa"], outs["distattn"]
    assert (l1 - l0).norm() / l0.norm() < 1e-5
    assert (g1 - g0).norm() / g0.norm() < 1e-4


def test_padding_mask_is_an_error():
    m = _model("distattn")
    ids = _ids(10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        m(ids, attention_mask=mask)


def _cp_case(rank, world, strategy):
    import distattn.distributed as dd

    ids = _ids()
    n = ids.shape[1]
    m = _model("distattn")
    cp = dd.ContextParallel(strategy=strategy, mask="causal", num_heads=4, num_kv_heads=2)
    pos = cp.position_ids(n)
    with dt.context_parallel(cp):
        logits = m(cp.shard(ids, 1), position_ids=pos[None].expand(2, -1)).logits
    # The whole sequence's loss is the sum of the ranks' parts: gradients summed over ranks.
    (logits.square().sum() / (2 * n * 97)).backward()
    g = _grads(m)
    torch.distributed.all_reduce(g)
    return pos, logits.detach(), g


@pytest.mark.parametrize("strategy", ["zigzag", "ulysses"])
def test_context_parallel_llama_equals_one_process_sdpa(strategy):
    ids = _ids()
    m = _model("sdpa")
    logits = m(ids).logits
    logits.square().mean().backward()
    ref_l, ref_g = logits.detach(), _grads(m)
    for ok, value in _run(2, _cp_case, strategy):
        assert ok, value
        pos, l, g = value
        assert (l - ref_l[:, pos]).norm() / ref_l[:, pos].norm() < 1e-5
        assert (g - ref_g).norm() / ref_g.norm() < 1e-4


def _cp_window_case(rank, world):
    import distattn.distributed as dd

    cfg = transformers.MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=8, attn_implementation="distattn",
    )  # fmt: skip
    m = transformers.MistralForCausalLM(cfg).float()
    ids = _ids(32)
    cp = dd.ContextParallel(strategy="zigzag", mask="causal")
    pos = cp.position_ids(32)
    with dt.context_parallel(cp), pytest.raises(ValueError, match="sliding window of 8"):
        m(cp.shard(ids, 1), position_ids=pos[None].expand(2, -1))
    return True


def test_a_sliding_window_under_context_parallel_is_an_error():
    # Without the check the window was dropped: plain causal attention, silently.
    for ok, value in _run(1, _cp_window_case):
        assert ok, value


@pytest.mark.parametrize("option", ["softcap", "s_aux", "sliding_window"])
def test_options_distattn_does_not_apply_are_errors(option):
    # Logit soft-capping (Gemma 2), attention sinks (gpt-oss) and windows: refused, not dropped.
    module = torch.nn.Module()
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    value = {"softcap": 30.0, "s_aux": torch.zeros(4), "sliding_window": 4}[option]
    with pytest.raises(ValueError, match=option.replace("_w", " w")):
        dt.attention_forward(module, q, k, v, None, scaling=0.25, **{option: value})
    dt.attention_forward(module, q, k, v, None, scaling=0.25, **{option: None})  # absent: runs
