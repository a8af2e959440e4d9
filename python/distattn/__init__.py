"""distattn: exact, memory-efficient attention for PyTorch, on CPU and CUDA tensors.

Drop-in for flash-attn's functions (``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_with_kvcache`` for decoding over a paged or contiguous KV cache) and
``attention`` for any mask distattn has (documents, prefix-LM, shared question, block masks,
…). ``flash_attn_func``, ``flash_attn_varlen_func`` and ``attention`` are differentiable in
q, k and v (the decoding call and the FP8 inputs below are inference only: their outputs carry
no gradient), each through ``torch.library`` custom ops (``torch.ops.distattn.forward`` /
``backward``) that ``torch.compile(fullgraph=True)`` traces.
CPU tensors may be float32, bfloat16 or float16; CUDA tensors bfloat16 or float16, computed on
the tensors' GPU and torch's current stream. The LSE is in natural log. For inference,
``flash_attn_func`` and ``attention`` also take float8_e4m3fn q, k, v with FlashAttention-3's
descales (the FP8 kernel on H100/H200 at head dim 128; bfloat16 O).

Submodules: ``distattn.distributed`` (``ContextParallel``: one sequence split over the ranks of
a ``torch.distributed`` group by any of distattn's strategies), ``distattn.checkpoint``
(rematerialization-aware checkpointing: recomputation that skips the attention forward) and
``distattn.transformers`` (``attn_implementation="distattn"`` for Hugging Face models).
"""

from . import _native
from .interface import (
    KVCachePlan,
    attention,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    plan_kvcache,
)

__version__ = _native.__version__
cuda_available = _native.cuda_available

__all__ = [
    "attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "plan_kvcache",
    "KVCachePlan",
    "cuda_available",
    "__version__",
]
