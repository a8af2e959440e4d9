"""flash-attn's functions, and ``attention`` for every mask distattn has.

Layouts are flash-attn's: Q ``[batch, seqlen_q, heads, head_dim]``, K and V ``[batch,
seqlen_k, kv_heads, head_dim]`` (grouped-query attention when ``kv_heads`` divides ``heads``),
O like Q in Q's dtype. The log-sum-exp (``return_lse=True``) is float32 ``[batch, heads,
seqlen_q]`` in the **natural** log of the scaled scores' sum of exponentials; rows that keep no
key get O = 0 and LSE = -inf (flash-attn writes +inf there). The LSE is not differentiable.
"""

from numbers import Real
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ops

Out = Union[Tensor, Tuple[Tensor, Tensor]]


def _check(ndim: int, layout: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {t.device}; distattn runs on CPU and CUDA tensors")


def _check_scale(softmax_scale) -> Optional[float]:
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real):
        raise TypeError(f"softmax_scale must be a number or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


def _flash_mask(causal: bool, window_size) -> str:
    """flash-attn's (causal, window_size) as a mask spec: both bottom-right aligned."""
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        raise ValueError(f"window_size must be a pair of integers >= -1 (-1: no limit), got {window_size!r}")
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return "full"
    if left < 0 and right == 0:
        return "causal"
    bound = lambda w: "-" if w < 0 else str(w)  # noqa: E731
    return f"window:{bound(left)},{bound(right)}"


def _result(o: Tensor, lse: Tensor, return_lse: bool) -> Out:
    return (o, lse) if return_lse else o


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: str = "full", softmax_scale: Optional[float] = None, return_lse: bool = False
) -> Out:
    """Exact attention under any mask spec of ``distattn run --help``.

    ``mask`` is ``full``, ``causal``, ``window:L,R``, ``window-global:L,R,G``,
    ``docs:A,B,…``, ``docs-causal:A,B,…``, ``prefix:P``, ``prefix-docs:A/P,…``,
    ``shared-question:Q,A1,…``, ``block-causal:B``, ``block-causal-docs:B:A,…`` or
    ``blocks:BQ,BK:0110…``; it applies to every batch element and head.

    >>> import torch, distattn
    >>> q, k, v = (torch.randn(1, 300, 4, 64) for _ in range(3))
    >>> o = distattn.attention(q, k, v, mask="docs-causal:100,200")
    >>> o.shape
    torch.Size([1, 300, 4, 64])
    """
    _check(4, "[batch, seqlen, heads, head_dim]", q=q, k=k, v=v)
    if not isinstance(mask, str):
        raise TypeError(f"mask must be a spec string such as 'causal', got {type(mask).__name__}")
    scale = _check_scale(softmax_scale)
    o, lse = _ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale, None, None)
    return _result(o, lse, return_lse)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    return_lse: bool = False,
) -> Out:
    """flash-attn's ``flash_attn_func``: causal aligned bottom-right, windows ``(left, right)``
    around that diagonal (-1: no limit).

    >>> import torch, distattn
    >>> q = torch.randn(2, 128, 8, 64, dtype=torch.bfloat16)
    >>> k, v = (torch.randn(2, 128, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    >>> o, lse = distattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    >>> o.dtype, tuple(lse.shape)
    (torch.bfloat16, (2, 8, 128))
    """
    return attention(q, k, v, _flash_mask(bool(causal), window_size), softmax_scale, return_lse)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    return_lse: bool = False,
) -> Out:
    """flash-attn's ``flash_attn_varlen_func``: sequences packed as Q ``[total_q, heads,
    head_dim]``, K and V ``[total_k, kv_heads, head_dim]``, with int32 cumulative lengths
    ``[0, l0, l0 + l1, …]``; each sequence attends within itself, causal and windows aligned
    to its own bottom-right corner. The LSE is ``[heads, total_q]``. The lengths are read from
    ``cu_seqlens_*`` (``max_seqlen_*`` are accepted for compatibility), so this call waits for
    them when they are on a GPU.

    >>> import torch, distattn
    >>> cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    >>> q, k, v = (torch.randn(12, 4, 32) for _ in range(3))
    >>> distattn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).shape
    torch.Size([12, 4, 32])
    """
    _check(3, "[total_tokens, heads, head_dim]", q=q, k=k, v=v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got {getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D [sequences + 1], got shape {tuple(cu.shape)}")
    mask = _flash_mask(bool(causal), window_size)
    scale = _check_scale(softmax_scale)
    q4, k4, v4 = (t.contiguous().unsqueeze(0) for t in (q, k, v))
    o, lse = _ops.attention(q4, k4, v4, mask, scale, cu_seqlens_q, cu_seqlens_k)
    return _result(o.squeeze(0), lse.squeeze(0), return_lse)
