"""Rematerialization-aware activation checkpointing (DistFlashAttn), for any model.

With a checkpoint around each decoder layer, backward recomputes the layer's forward, the
attention forward included — and, context-parallel, its communication — although the
attention backward needs only its inputs, O and the LSE. ``checkpoint(fn, *args,
policy="remat")`` checkpoints ``fn`` but saves the outputs of the attention ops (distattn's, and
with ``save_sdpa=True`` PyTorch's SDPA ops), so the recomputation skips them: one attention
forward per layer and step instead of two.

It is PyTorch's selective activation checkpointing (``torch.utils.checkpoint`` with
``use_reentrant=False`` and ``create_selective_checkpoint_contexts``) with a policy that must
save the attention ops' outputs and recomputes everything else; ``remat_policy`` and
``ATTENTION_OPS`` are the pieces for wiring it into other checkpoint wrappers.

>>> import torch, distattn, distattn.checkpoint as ck
>>> def layer(x):
...     q = k = v = x.unflatten(-1, (2, 8))
...     return distattn.attention(q, k, v, mask="causal").flatten(-2) + x
>>> x = torch.randn(1, 64, 16, requires_grad=True)
>>> with ck.count_attention_forwards() as count:
...     ck.checkpoint(layer, x, policy="remat").sum().backward()
>>> count.forwards   # "layer" would count 2: the forward and its recomputation
1
"""

from functools import partial
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import _ops, distributed  # noqa: F401  (registers the ops)

__all__ = ["checkpoint", "remat_policy", "ATTENTION_OPS", "SDPA_OPS", "count_attention_forwards", "POLICIES"]

#: distattn's attention forward ops (one device, and context-parallel).
ATTENTION_OPS = (torch.ops.distattn.forward.default, torch.ops.distattn.cp_forward.default)

#: PyTorch's scaled_dot_product_attention forward ops, one per backend.
SDPA_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)

#: The policies ``checkpoint`` takes.
POLICIES = ("none", "layer", "remat")


def remat_policy(ctx, op, *args, save_sdpa: bool = False, **kwargs):
    """Selective-checkpoint policy: must save the attention ops' outputs (O, LSE), prefer to
    recompute everything else."""
    if op in ATTENTION_OPS or (save_sdpa and op in SDPA_OPS):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint(fn: Callable, *args, policy: str = "remat", save_sdpa: bool = False, **kwargs):
    """``fn(*args, **kwargs)`` under a checkpoint policy: ``"none"`` (no checkpoint: every
    activation kept), ``"layer"`` (PyTorch's checkpoint: everything recomputed in backward)
    or ``"remat"`` (everything recomputed but the attention ops, whose outputs are saved)."""
    if policy == "none":
        return fn(*args, **kwargs)
    if policy == "layer":
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if policy == "remat":
        context_fn = partial(create_selective_checkpoint_contexts, partial(remat_policy, save_sdpa=save_sdpa))
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    raise ValueError(f"unknown checkpoint policy {policy!r}; expected one of {POLICIES}")


class count_attention_forwards(TorchDispatchMode):
    """Counts the attention forward ops run while it is active (distattn's and SDPA's), the
    recomputations of backward included: ``with count_attention_forwards() as c: …;
    c.forwards``. Ops a selective checkpoint replays from its saved outputs do not run, so
    they are not counted."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_OPS or func in SDPA_OPS:
            self.forwards += 1
        return func(*args, **(kwargs or {}))
