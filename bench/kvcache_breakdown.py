#!/usr/bin/env python3
"""Where a Python decode step's time goes: ``kvcache_py.py`` (same arguments) with
``KVCacheGroup.step``, ``.attention`` (the native call) and ``._step`` (planning) each timed
between two device synchronisations; prints, per rank and context, the medians over the
decode steps after the first, per call of one layer (``[kvcache_breakdown]`` lines). ``step``
minus ``attention`` is the Python side: routing the new tokens' K/V to their owners and
appending them; with ``--layers`` above 1, ``plan`` of the later layers is a table look-up.

    kvcache_breakdown.py --world 4 --contexts 262144,1048576 --steps 20 --out FILE"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import distattn.distributed as dd  # noqa: E402
import kvcache_py as K  # noqa: E402

LOG = {}
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def wrap(name, f):
    def g(*a, **kw):
        sync()
        t = time.perf_counter()
        r = f(*a, **kw)
        sync()
        LOG.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
        return r
    return g


dd.KVCacheGroup.step = wrap("step", dd.KVCacheGroup.step)
dd.KVCacheGroup.attention = wrap("attention", dd.KVCacheGroup.attention)
dd.KVCacheGroup._step = wrap("plan", dd.KVCacheGroup._step)
_worker = K.worker


def worker(rank, args, port, out_q):
    _worker(rank, args, port, out_q)
    L = args.layers
    n = (args.steps + 1) * L  # calls per context: the prompt and every decode step, per layer
    for ci, ctx in enumerate(args.contexts.split(",")):
        med = {k: statistics.median(v[ci * n + 2 * L:(ci + 1) * n]) for k, v in LOG.items()}
        print(f"[kvcache_breakdown] rank {rank} ctx {ctx}: " + " ".join(f"{k} {m:.3f} ms" for k, m in med.items()), flush=True)


K.worker = worker
if __name__ == "__main__":
    sys.exit(K.main())
