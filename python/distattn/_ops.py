"""The two custom ops, ``distattn::forward`` and ``distattn::backward``, with fake (meta)
implementations for ``torch.compile`` and the autograd formula that links them.

Each op takes Q ``[b, nq, h, d]``, K and V ``[b, nk, hkv, d]`` (packed sequences: ``b = 1``
with cumulative lengths), a mask spec string and the softmax scale. Torch allocates every
output and, on a GPU, the backward's workspace; the native module checks the tensors, then
runs the CPU kernels or enqueues the CUDA kernels on torch's current stream and returns
without waiting, so a forward and backward can be captured in a CUDA graph (packed sequences
excepted: their lengths are read on the host).
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.float8_e4m3fn: "float8_e4m3fn",
}


def _desc(t: Tensor):
    """What the native module reads of a tensor: address, shape, strides, dtype, device (the
    CUDA ordinal, -1 for the CPU)."""
    return (t.data_ptr(), t.shape, t.stride(), _DTYPE_NAMES.get(t.dtype) or str(t.dtype), t.get_device())


def _dense(t: Tensor) -> Tensor:
    """``t`` contiguous and 16-byte aligned (what the kernels read), copied only if needed."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# torch's current stream of a device as a raw handle; the private call skips building a
# Stream object (a few microseconds of every call's host time).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _seqlens(cu_q: Optional[Tensor], cu_k: Optional[Tensor]):
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("packed sequences take both cu_seqlens_q and cu_seqlens_k (one was given)")
    return (cu_q.tolist(), cu_k.tolist())


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: str,
    softmax_scale: Optional[float],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    q, k, v = _dense(q), _dense(k), _dense(v)
    b, nq, h, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    _native.forward(
        _desc(q), _desc(k), _desc(v), _desc(o), _desc(lse),
        mask, softmax_scale, _seqlens(cu_seqlens_q, cu_seqlens_k), _stream(q),
    )  # fmt: skip
    return o, lse


forward = torch.library.custom_op("distattn::forward", _forward_impl, mutates_args=())


@forward.register_fake
def _(q, k, v, mask, softmax_scale, cu_seqlens_q, cu_seqlens_k):
    b, nq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, nq), dtype=torch.float32)


def _backward_impl(
    d_o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: str,
    softmax_scale: Optional[float],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    d_o, q, k, v, o, lse = (_dense(t) for t in (d_o, q, k, v, o, lse))
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = dq_acc = None
    if q.is_cuda:
        # The kernels' workspace, from torch's allocator: row sums of dO*O and, where the
        # kernels add dQ up over key blocks, its f32 sums (zeroed). Above d 128 on Hopper each
        # dQ row is computed whole and written as it is.
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        if _native.backward_dq_workspace(_desc(q)):
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    _native.backward(
        _desc(q), _desc(k), _desc(v), _desc(o), _desc(lse), _desc(d_o),
        _desc(dq), _desc(dk), _desc(dv),
        None if delta is None else _desc(delta), None if dq_acc is None else _desc(dq_acc),
        mask, softmax_scale, _seqlens(cu_seqlens_q, cu_seqlens_k), _stream(q),
    )  # fmt: skip
    return dq, dk, dv


backward = torch.library.custom_op("distattn::backward", _backward_impl, mutates_args=())


@backward.register_fake
def _(d_o, q, k, v, o, lse, mask, softmax_scale, cu_seqlens_q, cu_seqlens_k):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, softmax_scale, cu_seqlens_q, cu_seqlens_k = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.mask, ctx.softmax_scale = mask, softmax_scale
    # As in flash-attn, the LSE is an output for merging partial results, not a function of
    # the inputs that gradients flow through; and its gradient is never materialized as a
    # tensor of zeros (a kernel per backward otherwise).
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _gradients(ctx, d_o, backward_fn):
    if d_o is None:  # O took no part in the loss
        return None, None, None, None, None, None, None
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = backward_fn(d_o, q, k, v, o, lse, ctx.mask, ctx.softmax_scale, cu_seqlens_q, cu_seqlens_k)
    return dq, dk, dv, None, None, None, None


forward.register_autograd(lambda ctx, d_o, _d_lse: _gradients(ctx, d_o, backward), setup_context=_setup_context)


def eager_autograd(forward_impl, setup_context, gradients, backward_impl):
    """An op's autograd without the dispatcher: the same implementations, saved tensors and
    gradient formula as the registered autograd, for eager calls, where going through a
    custom op's registered autograd costs about 100 us per call on a slow host."""

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, d_o, *_not_differentiable):
            # The backward is not itself differentiable: a double backward (create_graph=True,
            # gradient penalties) raises, as the registered op's does, instead of silently
            # dropping attention's second-order term.
            return gradients(ctx, d_o, backward_impl)

    return Eager


_EagerAttention = eager_autograd(_forward_impl, _setup_context, _gradients, _backward_impl)


try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # an older torch: always through the dispatcher
    _get_current_dispatch_mode = lambda: True  # noqa: E731


def through_dispatcher() -> bool:
    """Whether a call must go through the custom ops: when torch.compile traces it, or when a
    dispatch mode watches the ops (selective activation checkpointing, which saves the
    attention ops' outputs; op counters). Otherwise the same computation runs without the
    dispatcher, whose autograd costs about 100 us of host time per call."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def attention(*inputs) -> Tuple[Tensor, Tensor]:
    """O and LSE of `forward`'s inputs, differentiable in q, k, v: the custom op or, when
    nothing needs the dispatcher, the same computation without it."""
    if through_dispatcher():
        return forward(*inputs)
    return _EagerAttention.apply(*inputs)


# ---------------------------------------------------------------- FP8 forward


def _dequantized(x: Tensor, descale: Optional[Tensor]) -> Tensor:
    """An e4m3 ``[b, n, heads, d]`` tensor's values in f32: codes times their (batch, KV head)
    descale."""
    xf = x.to(torch.float32)
    if descale is None:
        return xf
    b, _, heads, _ = x.shape
    per_head = descale.repeat_interleave(heads // descale.shape[1], dim=1)
    return xf * per_head.view(b, 1, heads, 1)


def _forward_e4m3_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    mask: str,
    softmax_scale: Optional[float],
) -> Tuple[Tensor, Tensor]:
    q, k, v = _dense(q), _dense(k), _dense(v)
    descales = tuple(None if t is None else _dense(t) for t in (q_descale, k_descale, v_descale))
    if not q.is_cuda:
        # The CPU computes the exact attention of the values the codes stand for, in f32.
        xs = (_dequantized(x, d) for x, d in zip((q, k, v), descales))
        o, lse = _forward_impl(*xs, mask, softmax_scale, None, None)
        return o.to(torch.bfloat16), lse
    b, nq, h, d = q.shape
    o = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    # The kernels' workspace: V transposed (8-bit tensor-core products read K-major operands).
    vt = torch.empty(_native.e4m3_workspace_len(b, k.shape[1], k.shape[2], d), dtype=torch.uint8, device=q.device)
    _native.forward_e4m3(
        _desc(q), _desc(k), _desc(v), *(None if t is None else _desc(t) for t in descales),
        _desc(vt), _desc(o), _desc(lse), mask, softmax_scale, None, _stream(q),
    )  # fmt: skip
    return o, lse


# Inference only: no autograd is registered (the backward of FP8 inputs is not provided).
forward_e4m3 = torch.library.custom_op("distattn::forward_e4m3", _forward_e4m3_impl, mutates_args=())


@forward_e4m3.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, mask, softmax_scale):
    b, nq, h, _ = q.shape
    return q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty((b, h, nq), dtype=torch.float32)


def attention_e4m3(*inputs) -> Tuple[Tensor, Tensor]:
    """`forward_e4m3` of these inputs: the custom op when torch.compile traces the call, its
    implementation without the dispatcher when eager."""
    if through_dispatcher():
        return forward_e4m3(*inputs)
    return _forward_e4m3_impl(*inputs)


# ---------------------------------------------------------------- decode over a KV cache

# Workspace sizes per (device, dtype, q shape, cache shape, batch, max pages): asked of the
# native module once, so a decode step costs no extra host round trip.
_decode_ws_sizes = {}


def _decode_workspace(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cache_seqlens: Tensor):
    key = (q.device, q.dtype, tuple(q.shape), tuple(k_cache.shape), tuple(page_table.shape))
    sizes = _decode_ws_sizes.get(key)
    if sizes is None:
        sizes = _native.decode_workspace(
            _desc(q), _desc(k_cache), _desc(v_cache), _desc(page_table), _desc(cache_seqlens)
        )
        _decode_ws_sizes[key] = sizes
    n_cu, n_po, n_pl, n_c = sizes
    dev = q.device
    return (
        torch.empty(n_cu, dtype=torch.int64, device=dev),
        torch.empty(n_po, dtype=torch.float32, device=dev),
        torch.empty(n_pl, dtype=torch.float32, device=dev),
        torch.empty(n_c, dtype=torch.int32, device=dev),  # (zeroed by the step's plan)
    )


def _decode_run(q, k_cache, v_cache, page_table, cache_seqlens, k, v, softmax_scale, causal, planned_ws):
    """One decode call; on a GPU with the workspace of a plan made for this step (`planned_ws`,
    the plan not launched again) or a fresh one (planned here)."""
    q = _dense(q)
    k, v = (None if t is None else _dense(t) for t in (k, v))
    b, s, h, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    ws = None
    if q.is_cuda:
        ws = planned_ws if planned_ws is not None else _decode_workspace(q, k_cache, v_cache, page_table, cache_seqlens)
        ws = tuple(_desc(t) for t in ws)
    _native.decode(
        _desc(q), _desc(k_cache), _desc(v_cache), _desc(page_table), _desc(cache_seqlens),
        None if k is None else _desc(k), None if v is None else _desc(v),
        _desc(o), _desc(lse), ws, planned_ws is not None, softmax_scale, causal, _stream(q),
    )  # fmt: skip
    return o, lse


def _decode_impl(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cache_seqlens: Tensor,
    k: Optional[Tensor],
    v: Optional[Tensor],
    softmax_scale: Optional[float],
    causal: bool,
) -> Tuple[Tensor, Tensor]:
    return _decode_run(q, k_cache, v_cache, page_table, cache_seqlens, k, v, softmax_scale, causal, None)


def plan_decode(q, k_cache, v_cache, page_table, cache_seqlens, seqlen_new):
    """A GPU workspace with the step's plan enqueued on torch's current stream."""
    ws = _decode_workspace(q, k_cache, v_cache, page_table, cache_seqlens)
    _native.decode_plan(
        _desc(q), _desc(k_cache), _desc(v_cache), _desc(page_table), _desc(cache_seqlens),
        seqlen_new, tuple(_desc(t) for t in ws), _stream(q),
    )  # fmt: skip
    return ws


# The caches are written in place when new K/V are given.
decode = torch.library.custom_op("distattn::decode", _decode_impl, mutates_args=("k_cache", "v_cache"))


@decode.register_fake
def _(q, k_cache, v_cache, page_table, cache_seqlens, k, v, softmax_scale, causal):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


def decode_call(*inputs) -> Tuple[Tensor, Tensor]:
    """`decode` of these inputs: the custom op when torch.compile traces the call or a dispatch
    mode watches it (export, make_fx), its implementation without the dispatcher (tens of
    microseconds of host time) otherwise."""
    if through_dispatcher():
        return decode(*inputs)
    return _decode_impl(*inputs)
