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


def _descale(name: str, t: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """An FP8 input's descale as float32 ``[batch, kv_heads]`` (a one-element tensor applies to
    every batch element and head)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    b, hkv = q.shape[0], k.shape[2]
    if t.numel() == 1:
        t = t.reshape(1, 1).expand(b, hkv)
    if tuple(t.shape) != (b, hkv):
        raise ValueError(f"{name} must be [batch, kv_heads] = [{b}, {hkv}] (or one element), got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device}, the inputs on {q.device}")
    return t.to(torch.float32).contiguous()


def _attention_e4m3(q, k, v, mask, softmax_scale, return_lse, descales) -> Out:
    for name, t in (("k", k), ("v", v)):
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"q is float8_e4m3fn, so {name} must be too, got {t.dtype}")
    ds = tuple(_descale(n, t, q, k) for n, t in zip(("q_descale", "k_descale", "v_descale"), descales))
    o, lse = _ops.attention_e4m3(q.contiguous(), k.contiguous(), v.contiguous(), *ds, mask, softmax_scale)
    return _result(o, lse, return_lse)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: str = "full",
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Out:
    """Exact attention under any mask spec of ``distattn run --help``.

    ``mask`` is ``full``, ``causal``, ``window:L,R``, ``window-global:L,R,G``,
    ``docs:A,B,…``, ``docs-causal:A,B,…``, ``prefix:P``, ``prefix-docs:A/P,…``,
    ``shared-question:Q,A1,…``, ``block-causal:B``, ``block-causal-docs:B:A,…`` or
    ``blocks:BQ,BK:0110…``; it applies to every batch element and head.

    FP8: q, k and v may be ``torch.float8_e4m3fn`` (inference; not differentiable), each with
    an optional float32 descale ``[batch, kv_heads]`` (FlashAttention-3's convention: the real
    value is the stored one times its descale); O is bfloat16. On an H100/H200 GPU with head dim
    128 the FP8 kernel runs (P is rounded to e4m3 for P·V); on the CPU, the exact attention of
    the dequantized values in float32; other GPUs raise.

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
    descales = (q_descale, k_descale, v_descale)
    if q.dtype == torch.float8_e4m3fn:
        return _attention_e4m3(q, k, v, mask, scale, return_lse, descales)
    if any(t is not None for t in descales):
        raise ValueError(f"descales apply to float8_e4m3fn inputs; q is {q.dtype}")
    o, lse = _ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask, scale, None, None)
    return _result(o, lse, return_lse)


def _check_dropout(dropout_p) -> None:
    if dropout_p != 0:
        raise ValueError(f"distattn computes exact attention without dropout; dropout_p must be 0, got {dropout_p!r}")


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Out:
    """flash-attn's ``flash_attn_func``: causal aligned bottom-right, windows ``(left, right)``
    around that diagonal (-1: no limit). FP8 inputs with descales as in FlashAttention-3 (see
    ``attention``). The options are keyword-only: flash-attn 2 and 3 order them differently
    (``dropout_p`` first in 2, ``softmax_scale`` in 3), so a positional one would be misread;
    ``dropout_p`` is accepted as 0 only (attention here is exact).

    >>> import torch, distattn
    >>> q = torch.randn(2, 128, 8, 64, dtype=torch.bfloat16)
    >>> k, v = (torch.randn(2, 128, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    >>> o, lse = distattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    >>> o.dtype, tuple(lse.shape)
    (torch.bfloat16, (2, 8, 128))
    """
    _check_dropout(dropout_p)
    mask = _flash_mask(bool(causal), window_size)
    return attention(q, k, v, mask, softmax_scale, return_lse, q_descale, k_descale, v_descale)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dropout_p: float = 0.0,
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
    them when they are on a GPU. The options are keyword-only, as in ``flash_attn_func``.

    >>> import torch, distattn
    >>> cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    >>> q, k, v = (torch.randn(12, 4, 32) for _ in range(3))
    >>> distattn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True).shape
    torch.Size([12, 4, 32])
    """
    _check(3, "[total_tokens, heads, head_dim]", q=q, k=k, v=v)
    _check_dropout(dropout_p)
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


def _kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table, block_table):
    """The inputs of a decode call checked, with a contiguous cache's page table and default
    lengths filled in, the table and lengths as contiguous int32."""
    if block_table is not None:
        if page_table is not None:
            raise ValueError("give page_table or block_table (its flash-attn 2 name), not both")
        page_table = block_table
    _check(4, "[batch, seqlen, heads, head_dim]", q=q, k_cache=k_cache, v_cache=v_cache)
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new tokens), or neither")
    if k is not None:
        _check(4, "[batch, seqlen_new, kv_heads, head_dim]", k=k, v=v)
    b, dev = q.shape[0], q.device
    if page_table is None:
        if k_cache.shape[0] < b:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} requests, q has {b}")
        page_table = _contiguous_table(b, dev)
    elif not isinstance(page_table, Tensor) or page_table.dim() != 2:
        raise ValueError("page_table must be an int32 tensor [batch, max_pages]")
    capacity = page_table.shape[1] * k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k and v needs cache_seqlens (where each request's new tokens go)")
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dtype.is_floating_point:
        raise TypeError("cache_seqlens must be an int or an integer tensor [batch]")
    page_table = page_table.to(dtype=torch.int32).contiguous()
    cache_seqlens = cache_seqlens.to(dtype=torch.int32).contiguous()
    return q, k_cache, v_cache, k, v, page_table, cache_seqlens


_contiguous_tables = {}


def _contiguous_table(batch: int, device) -> Tensor:
    """The page table of a contiguous cache, ``[[0], [1], ...]``, made once per device: not
    kept from a traced call (a fake tensor) or one a CUDA graph captures (filled only when the
    graph replays); those make their own."""
    t = _contiguous_tables.get((batch, device))
    if t is None:
        t = torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not (_ops.through_dispatcher() or capturing):
            _contiguous_tables[(batch, device)] = t
    return t


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[None, int, Tensor] = None,
    page_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    block_table: Optional[Tensor] = None,
    plan: Optional["KVCachePlan"] = None,
) -> Out:
    """Decode attention over a KV cache, as flash-attn's function of that name.

    ``q`` is ``[batch, seqlen_q, heads, head_dim]`` with 1 to 16 query rows per request (plain
    decode, speculative or chunked steps). The cache is contiguous, ``k_cache`` / ``v_cache``
    ``[batch_cache >= batch, seqlen_cache, kv_heads, head_dim]`` (request ``b`` in row ``b``),
    or paged, ``[num_pages, page_size, kv_heads, head_dim]`` with ``page_table`` (flash-attn 2's
    ``block_table``) int32 ``[batch, max_pages]``. ``cache_seqlens`` (int or int32
    ``[batch]``; default: the whole cache) counts each request's cached tokens. New ``k`` /
    ``v`` ``[batch, seqlen_new, kv_heads, head_dim]`` are written into the caches in place at
    positions ``cache_seqlens[b]...`` before attending; ``cache_seqlens`` is not changed (add
    ``seqlen_new`` to it for the next step). With ``causal`` (off by default, as in flash-attn;
    it matters for more than one query row), query row ``i`` sits at position
    ``cache_seqlens[b] + seqlen_new - seqlen_q + i`` and sees the keys up to it; without, every
    row sees every cached key. The arguments after ``v`` are keyword-only (flash-attn 3 puts
    others in those places).

    On a GPU the requests' work is split evenly over every SM (one request of 1M tokens or a
    ragged batch of 64 alike), without reading the lengths on the host: the call can be
    captured in a CUDA graph. Each call plans its split (one small kernel); ``plan`` (from
    :func:`plan_kvcache`) reuses one step's plan in every layer of that step instead. There the
    lengths and the page table are read on the GPU and not
    checked: lengths past a page-table row are clamped to it, and every entry a length reaches
    must name a page of the cache (as in flash-attn); on the CPU both are checked. Returns O like ``q`` and, with ``return_lse``, the float32 LSE
    ``[batch, heads, seqlen_q]`` in natural log (-inf for a row that sees no key, with O = 0).

    >>> import torch, distattn
    >>> k_cache = torch.randn(2, 64, 2, 32)  # 2 requests, room for 64 tokens, 2 KV heads
    >>> v_cache = torch.randn(2, 64, 2, 32)
    >>> q = torch.randn(2, 1, 8, 32)  # one new token per request, 8 query heads
    >>> k_new, v_new = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    >>> lens = torch.tensor([10, 40], dtype=torch.int32)
    >>> o = distattn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens)
    >>> o.shape
    torch.Size([2, 1, 8, 32])
    >>> bool(torch.equal(k_cache[1, 40], k_new[1, 0]))  # appended in place
    True
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    q, k_cache, v_cache, k, v, page_table, cache_seqlens = _kvcache_inputs(
        q, k_cache, v_cache, k, v, cache_seqlens, page_table, block_table
    )
    if plan is not None:
        plan._check(q, k_cache, page_table, 0 if k is None else k.shape[1])
        if torch.compiler.is_compiling():
            raise RuntimeError("plan= is for eager calls and CUDA graphs; under torch.compile leave it out")
        scale = _check_scale(softmax_scale)
        o, lse = _ops._decode_run(q, k_cache, v_cache, page_table, cache_seqlens, k, v, scale, causal, plan.workspace)
        return _result(o, lse, return_lse)
    o, lse = _ops.decode_call(q, k_cache, v_cache, page_table, cache_seqlens, k, v, _check_scale(softmax_scale), causal)
    return _result(o, lse, return_lse)


class KVCachePlan:
    """The split of one decode step over the GPU, made by :func:`plan_kvcache` and reused by
    every layer's :func:`flash_attn_with_kvcache` call of that step (same shapes, lengths and
    number of new tokens)."""

    __slots__ = ("workspace", "_key")

    def __init__(self, workspace, key):
        self.workspace, self._key = workspace, key

    def _check(self, q, k_cache, page_table, seqlen_new):
        key = _plan_key(q, k_cache, page_table, seqlen_new)
        if key != self._key:
            raise ValueError(f"the plan was made for {self._key}, this call is {key}")


def _plan_key(q, k_cache, page_table, seqlen_new):
    return (str(q.device), str(q.dtype), tuple(q.shape), tuple(k_cache.shape), tuple(page_table.shape), seqlen_new)


def plan_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Union[None, int, Tensor] = None,
    page_table: Optional[Tensor] = None,
    seqlen_new: int = 0,
    *,
    block_table: Optional[Tensor] = None,
) -> Optional[KVCachePlan]:
    """Plans one decode step on the GPU, once for all its layers: the split of the requests'
    tiles over the SMs, computed from ``cache_seqlens`` (+ ``seqlen_new``, the new tokens each
    layer's call appends) on torch's current stream. Pass the result as ``plan=`` to every
    :func:`flash_attn_with_kvcache` of the step, whose calls then only launch the decode (and
    append). The arguments are a layer's, as that function takes them; change the lengths and
    make a new plan for the next step. On the CPU there is nothing to plan: returns None.

    >>> import torch, distattn
    >>> q, kc, vc = torch.randn(1, 1, 8, 64), torch.randn(1, 100, 2, 64), torch.randn(1, 100, 2, 64)
    >>> plan = distattn.plan_kvcache(q, kc, vc, cache_seqlens=100)  # None on the CPU
    >>> o = distattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=100, plan=plan)
    """
    if not isinstance(seqlen_new, int) or isinstance(seqlen_new, bool) or seqlen_new < 0:
        raise ValueError(f"seqlen_new must be a non-negative int, got {seqlen_new!r}")
    q, k_cache, v_cache, _, _, page_table, cache_seqlens = _kvcache_inputs(
        q, k_cache, v_cache, None, None, cache_seqlens, page_table, block_table
    )
    if not q.is_cuda:
        return None
    ws = _ops.plan_decode(q, k_cache, v_cache, page_table, cache_seqlens, seqlen_new)
    return KVCachePlan(ws, _plan_key(q, k_cache, page_table, seqlen_new))
