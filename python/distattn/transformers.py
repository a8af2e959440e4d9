"""distattn as an attention implementation of Hugging Face ``transformers``.

>>> import distattn.transformers                                   # doctest: +SKIP
>>> distattn.transformers.register()                               # doctest: +SKIP
>>> model = LlamaForCausalLM(config)                               # doctest: +SKIP
>>> model.config._attn_implementation = "distattn"                 # doctest: +SKIP

(or ``from_pretrained(..., attn_implementation="distattn")``).

Context-parallel: every rank runs the model on its shard of the tokens, with their positions,
inside ``context_parallel(cp)``; each attention layer then runs ``cp.attention`` over the whole
sequence::

    cp = distattn.distributed.ContextParallel(strategy="zigzag", mask="causal")
    with distattn.transformers.context_parallel(cp):
        out = model(cp.shard(input_ids, 1), position_ids=cp.position_ids(n)[None])

The layers' masks are causal (or full for non-causal modules) over the whole sequence; padding
masks and packed sequences found from position ids are not supported here and raise (use
``distattn.flash_attn_varlen_func`` or a documents mask with ``distattn.attention``).
"""

import threading
from contextlib import contextmanager
from typing import Optional

from torch import Tensor

from .interface import flash_attn_func

__all__ = ["register", "context_parallel", "attention_forward"]

_state = threading.local()


def _current_cp():
    return getattr(_state, "cp", None)


@contextmanager
def context_parallel(cp):
    """Runs the attention layers of models using distattn through ``cp`` (a
    ``distattn.distributed.ContextParallel``) while the block is active."""
    previous = _current_cp()
    _state.cp = cp
    try:
        yield cp
    finally:
        _state.cp = previous


def register(name: str = "distattn") -> None:
    """Registers distattn with transformers' ``AttentionInterface`` (and its mask interface)
    under ``name``, so models take ``attn_implementation=name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask)


def _mask(batch_size=None, q_length=None, kv_length=None, mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask hook: distattn builds its masks itself, so no dense mask is made; a
    mask distattn would not apply is an error rather than silently dropped."""
    from transformers.masking_utils import causal_mask_function

    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "distattn's transformers attention takes no padding mask; pack the sequences and use "
            "distattn.flash_attn_varlen_func, or pass attention_mask=None"
        )
    if _current_cp() is None and mask_function is not causal_mask_function:
        raise ValueError(
            "distattn's transformers attention applies causal masks only (this model asks for another mask, "
            "or position_ids restart as in packed sequences)"
        )
    return None


def attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """transformers' attention signature: query ``[b, h, n, d]``, key and value
    ``[b, h_kv, n, d]``; returns the output ``[b, n, h, d]`` and no weights."""
    if dropout and module.training:
        raise ValueError("distattn computes exact attention without dropout; set the model's attention_dropout to 0")
    if attention_mask is not None:
        raise ValueError("distattn's transformers attention takes no dense attention mask (see distattn.transformers)")
    # Options of the model's attention that distattn does not apply: refused, not dropped.
    for option, what in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(option) is not None:
            raise ValueError(f"distattn's transformers attention has no {what} ({option}={kwargs[option]!r})")
    if kwargs.get("sliding_window") is not None:
        # (The mask hook refuses the window's mask first where transformers builds one; under
        # context parallelism it cannot tell it from the shards' packed-sequence mask.)
        raise ValueError(
            f"distattn's transformers attention applies causal masks only; this model asks for a sliding "
            f"window of {kwargs['sliding_window']}"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    cp = _current_cp()
    if cp is None:
        return flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal), None
    want = "causal" if causal else "full"
    if cp.mask != want:
        raise ValueError(f"the model's attention is {want}, the context-parallel group's mask {cp.mask!r}")
    return cp.attention(q, k, v, softmax_scale=scaling), None
