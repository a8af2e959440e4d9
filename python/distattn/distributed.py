"""Context parallelism over a ``torch.distributed`` process group: one sequence split over the
ranks of the group (one process per GPU, started by ``torchrun`` or Slurm, on one node or
several), attention computed exactly by one of distattn's strategies.

>>> import torch.distributed as dist, distattn.distributed as dd       # doctest: +SKIP
>>> cp = dd.ContextParallel(strategy="zigzag", mask="causal")          # doctest: +SKIP
>>> x = cp.shard(hidden, dim=1)              # this rank's tokens of [b, n, ...]   # doctest: +SKIP
>>> pos = cp.position_ids(hidden.shape[1])   # their positions, for RoPE and labels # doctest: +SKIP
>>> o = cp.attention(q, k, v)                # q, k, v: this rank's shards          # doctest: +SKIP

Strategies: ``ring``, ``zigzag``, ``striped``, ``balanced`` (DistFlashAttn), ``ulysses``,
``hybrid[:U]`` (USP), ``allgather``, ``dispatch`` (mask-aware), or ``auto`` (the planner's
time model picks one per sequence length). Masks: any spec of
``distattn.attention`` over the whole sequence. Each rank holds the rows ``cp.position_ids(n)``
of the whole tensors, in that order (a zig-zag rank holds two chunks, a striped rank every P-th
token; under a packed-documents mask zig-zag, all-gather and hybrid cut every document into
those chunks, so a rank holds two chunks of each document); ``cp.attention`` returns this rank's
rows of the whole sequence's attention, equal to ``distattn.attention`` on the gathered tensors,
and is differentiable.

Transport: CUDA tensors go through distattn's own NCCL communicator, bootstrapped from the
group (rank 0 makes the NCCL unique id and broadcasts it over the group), on its own stream,
ordered after torch's current stream and before torch's later work by events; a peer that
fails or stops responding for ``timeout`` seconds makes every rank raise. CPU tensors go
through the group itself (gloo): the test bed; a dead peer surfaces as the group's error.
"""

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _native
from ._ops import _dense, _desc, _stream, eager_autograd, through_dispatcher

__all__ = ["ContextParallel", "KVCacheGroup", "release_cached_memory"]


class _GroupTransfers:
    """Host transfers for distattn's interpreter, made with a process group: what the native
    ``GroupComm`` calls for each transfer (messages are ``bytes``)."""

    def __init__(self, group):
        self.pg = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.peers = [dist.get_global_rank(group, r) for r in range(self.world)]

    def group(self, sends, recvs) -> List[bytes]:
        ops = []
        for peer, data in sends:
            if len(data):
                t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.isend, t, self.peers[peer], self.pg))
        out = []
        for peer, n in recvs:
            t = torch.empty(n, dtype=torch.uint8)
            out.append(t)
            if n:
                ops.append(dist.P2POp(dist.irecv, t, self.peers[peer], self.pg))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return [t.numpy().tobytes() for t in out]

    def all_gather(self, data) -> List[bytes]:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.pg)
        return [torch.cat(parts).numpy().tobytes()]

    def all_to_all(self, data) -> List[bytes]:
        slot = len(data) // self.world
        chunk = lambda j: data[j * slot : (j + 1) * slot]  # noqa: E731
        others = [j for j in range(self.world) if j != self.rank]
        got = self.group([(j, chunk(j)) for j in others], [(j, slot) for j in others])
        parts = dict(zip(others, got))
        parts[self.rank] = bytes(chunk(self.rank))
        return [b"".join(parts[j] for j in range(self.world))]

    def reduce_scatter_f32(self, data) -> List[bytes]:
        t = torch.frombuffer(bytearray(data), dtype=torch.float32)
        dist.all_reduce(t, group=self.pg)
        slot = t.numel() // self.world
        return [t[self.rank * slot : (self.rank + 1) * slot].numpy().tobytes()]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def abort(self, reason: str) -> None:
        """Nothing to send: the peers learn of this rank's failure from the group itself."""


# ContextParallel objects by id, for the custom ops (which take plain values, not objects);
# weak, so a dropped group's communicator goes with it (autograd keeps the one a pending
# backward needs, see `_setup`).
_instances: "weakref.WeakValueDictionary[int, ContextParallel]" = weakref.WeakValueDictionary()


class ContextParallel:
    """Attention over one sequence split across the ranks of ``group`` by ``strategy``.

    ``mask`` is a spec over the whole sequence, as ``distattn.attention`` takes it.
    ``strategy="auto"`` runs, for each sequence length, whichever of zigzag, ulysses, hybrid,
    dispatch and allgather the planner's time model estimates fastest for a forward and backward
    step (``strategy_for(seq_len)`` says which; the model counts FLOPs, bytes and each kernel
    tile's and transfer group's fixed cost; on 4 × H200 its picks, ulysses for causal and full
    masks and dispatch for packed documents at 32k and 128k, ran within 1.8% of the fastest
    measured strategy, and on 2 × H200 its picks within 2.1%).
    ``num_heads`` and ``num_kv_heads`` are needed by ``auto`` and by ``hybrid`` without a degree
    (which pick their plans from them); ``ranks_per_node`` (default: ``LOCAL_WORLD_SIZE``, which
    torchrun sets, else Slurm's ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``) lets
    hybrid keep its all-to-alls inside nodes, consecutive ranks of the group sharing one;
    ``timeout`` (seconds) bounds how long a rank waits for a silent peer on the GPU.

    On GPUs the shards are read in place and O and the gradients are written into tensors torch
    allocates; the transfers' buffers come from the device's memory pool and are kept there for
    the next call (outside ``torch.cuda.memory_allocated``), until ``release_cached_memory()``.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        strategy: str = "zigzag",
        mask: str = "causal",
        *,
        num_heads: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        ranks_per_node: Optional[int] = None,
        timeout: float = 300.0,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel needs torch.distributed initialised (init_process_group)")
        if not isinstance(mask, str):
            raise TypeError(f"mask must be a spec string such as 'causal', got {type(mask).__name__}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.strategy = strategy
        self.mask = mask
        self.timeout = float(timeout)
        self.ranks_per_node = _native.launcher_ranks_per_node() if ranks_per_node is None else ranks_per_node
        if strategy == "auto" and (num_heads is None or num_kv_heads is None):
            raise ValueError("strategy 'auto' needs num_heads and num_kv_heads: the strategy it picks depends on them")
        if strategy == "hybrid" and (num_heads is None or num_kv_heads is None):
            # Its Ulysses degree, which places the tokens, comes from the head counts.
            raise ValueError("strategy 'hybrid' without a degree ('hybrid:U') needs num_heads and num_kv_heads")
        self._heads = (num_heads or self.world, num_kv_heads or num_heads or self.world)
        self._chosen: Dict[int, str] = {}
        self._layouts: Dict[int, List[Tensor]] = {}
        self._ranks: Dict[tuple, object] = {}
        self._kept: Dict[tuple, List[Tuple[str, List[int]]]] = {}
        self._transports: Dict[object, object] = {}
        self._id = id(self)
        _instances[self._id] = self
        if strategy != "auto":
            _native.strategy_name(strategy)  # an unknown name fails here, not at the first call

    # ------------------------------------------------------------------ layout

    def strategy_for(self, seq_len: int) -> str:
        """The strategy the ranks run for a sequence of ``seq_len`` tokens: the one given or, for
        ``"auto"``, the planner's pick for this length, heads and mask (the same on every rank)."""
        if self.strategy != "auto":
            return self.strategy
        s = self._chosen.get(seq_len)
        if s is None:
            # Chosen at head dim 128 whatever the tensors' is: position_ids, which does not know
            # it, and the ranks' plans must agree, and the estimates' FLOPs and bytes both scale
            # with it.
            s = _native.cp_auto_strategy(self.world, (1, seq_len, *self._heads, 128), self.mask, self.ranks_per_node)
            _remember(self._chosen, seq_len, s)
        return s

    def _positions(self, n: int) -> List[Tensor]:
        """Every rank's token positions of a sequence of ``n`` tokens."""
        lay = self._layouts.get(n)
        if lay is None:
            strategy = self.strategy_for(n)
            runs = _native.cp_layout(strategy, self.world, (1, n, *self._heads, 8), self.mask, self.ranks_per_node)
            lay = [
                torch.cat([torch.arange(s, e) for s, e in r]) if r else torch.empty(0, dtype=torch.long) for r in runs
            ]
            _remember(self._layouts, n, lay)
        return lay

    def position_ids(self, seq_len: int, device=None) -> Tensor:
        """The global positions of this rank's tokens of a ``seq_len``-token sequence, ascending
        (int64): what ``shard`` keeps, and the positions RoPE and the labels need."""
        return self._positions(seq_len)[self.rank].to(device)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x`` along ``dim`` (the whole sequence)."""
        idx = self.position_ids(x.shape[dim], x.device)
        return x.index_select(dim, idx)

    def unshard(self, x: Tensor, dim: int = 1, seq_len: Optional[int] = None) -> Tensor:
        """The whole sequence from every rank's shard ``x`` along ``dim`` (gathered over the
        group; not differentiable). ``seq_len`` defaults to the sum of the shards' lengths."""
        lens = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(self.world)]
        dist.all_gather(lens, torch.tensor([x.shape[dim]], device=x.device), group=self.group)
        lens = [int(t) for t in lens]
        n = seq_len if seq_len is not None else sum(lens)
        pos = self._positions(n)
        if [len(p) for p in pos] != lens:
            raise ValueError(f"shards of {lens} tokens are not this strategy's layout of {n} tokens")
        longest = max(lens)
        xt = x.detach().movedim(dim, 0).contiguous()
        pad = torch.zeros((longest - xt.shape[0], *xt.shape[1:]), dtype=xt.dtype, device=xt.device)
        parts = [torch.empty((longest, *xt.shape[1:]), dtype=xt.dtype, device=xt.device) for _ in range(self.world)]
        dist.all_gather(parts, torch.cat([xt, pad]), group=self.group)
        out = torch.empty((n, *xt.shape[1:]), dtype=xt.dtype, device=xt.device)
        for r, (p, part) in enumerate(zip(pos, parts)):
            out[p.to(x.device)] = part[: lens[r]]
        return out.movedim(0, dim)

    # ------------------------------------------------------------------ attention

    def _transport(self, device: torch.device):
        key = device.index if device.type == "cuda" else "cpu"
        t = self._transports.get(key)
        if t is None:
            if device.type == "cuda":
                nccl_id = [_native.nccl_unique_id() if self.rank == 0 else None]
                dist.broadcast_object_list(nccl_id, src=dist.get_global_rank(self.group, 0), group=self.group)
                t = _native.CpTransport.nccl(device.index, nccl_id[0], self.rank, self.world, self.timeout)
            else:
                t = _native.CpTransport.host(_GroupTransfers(self.group), self.rank, self.world)
            self._transports[key] = t
        return t

    def _rank(self, shape: tuple, seq_len: int, softmax_scale: Optional[float], device: torch.device):
        b, _, h, d = shape[0]
        hkv = shape[1][2]
        key = (b, seq_len, h, hkv, d, softmax_scale, str(device))
        r = self._ranks.get(key)
        if r is None:
            r = _native.CpRank(
                self.strategy_for(seq_len), self.world, self.rank, (b, seq_len, h, hkv, d), self.mask, softmax_scale,
                self._transport(device), self.ranks_per_node,
            )  # fmt: skip
            _remember(self._ranks, key, r)
        return r

    def _kept_shapes(self, shape: tuple, seq_len: int, dtype: torch.dtype) -> List[Tuple[str, List[int]]]:
        """What this rank's forward keeps for its backward (Ulysses and hybrid: the head-sharded
        Q, K, V and LSE), as ``(name, shape)``; none for the other strategies."""
        b, _, h, d = shape[0]
        key = (b, seq_len, h, shape[1][2], d, dtype)
        kept = self._kept.get(key)
        if kept is None:
            strategy, name = self.strategy_for(seq_len), str(dtype).removeprefix("torch.")
            kept = _native.cp_kept(strategy, self.world, self.rank, key[:5], self.mask, name, self.ranks_per_node)
            _remember(self._kept, key, kept)
        return kept

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        return_lse: bool = False,
        softmax_scale: Optional[float] = None,
        seq_len: Optional[int] = None,
    ):
        """This rank's rows of the whole sequence's attention: q ``[b, n_local, h, d]``, k and v
        ``[b, n_local, h_kv, d]`` (this rank's shards), O like q and (``return_lse``) the LSE
        ``[b, h, n_local]`` in natural log. Differentiable in q, k and v, and traced by
        ``torch.compile(fullgraph=True)`` (pass ``seq_len`` there). ``seq_len`` (the whole
        sequence) defaults to the sum of the ranks' shard lengths, summed over the group at
        each call (one small collective): pass it to save that.

        On GPUs the call (forward or backward) returns once its work is queued, as a torch
        kernel does; torch's stream waits for it. A failure on the way (a peer that died, a
        stall past ``timeout``) ends the transfers, so nothing waiting on the device hangs, and
        is raised by the group's next call or by :meth:`synchronize`."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got {tuple(t.shape)}")
        if seq_len is None:
            seq_len = self._seq_len(q.shape[1], q.device)
        if softmax_scale is not None:
            softmax_scale = float(softmax_scale)
        # A call whose backward may run has its forward keep what that backward takes.
        keep = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        o, lse, *_ = _cp_call(q.contiguous(), k.contiguous(), v.contiguous(), self._id, seq_len, softmax_scale, keep)
        return (o, lse) if return_lse else o

    def synchronize(self) -> None:
        """Waits for the device work of this group's last GPU attention call and raises the
        failure it met, if any (say, before saving a checkpoint)."""
        for t in self._transports.values():
            t.synchronize()

    def _seq_len(self, local: int, device) -> int:
        # Every rank asks the group at every such call: a rank answering from a cache while
        # another asks would leave the collective unmatched.
        t = torch.tensor([local], dtype=torch.long, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, group=self.group)
        return int(t)


def _appended(buf: Optional[Tensor], held: int, rows: Tensor) -> Tensor:
    """``buf`` with ``rows`` written after its first ``held`` rows; a full buffer is replaced by
    one twice as large (at least 16 rows), so a request's appends cost amortized O(1) each."""
    n = held + rows.shape[0]
    if buf is None or buf.shape[0] < n:
        grown = rows.new_empty((max(n, 16, 2 * (0 if buf is None else buf.shape[0])), *rows.shape[1:]))
        if held:
            grown[:held] = buf[:held]
        buf = grown
    buf[held:n] = rows
    return buf


class KVCacheGroup:
    """Attention over a KV cache spread over the ranks of ``group`` (Infinite-LLM's
    DistAttention): each request's tokens are dealt out to the ranks by ``placement``
    (``"pages:N"``: pages of N tokens round-robin from the request's home rank;
    ``"contiguous:N"``: one chunk per rank of a request of up to N tokens; ``"zigzag:N"``: two
    chunks per rank, an early and a late one, so that a long prompt's causal work is even), and
    a step's attention runs where the keys live.

    A step is a list of requests ``(home, cached, new)``: ``new`` tokens (queries, their K/V
    already appended) against ``cached + new`` keys, causal. ``local_queries`` and
    ``local_keys`` say which rows this rank holds, in the order ``attention`` takes them;
    ``strategy`` is ``"pass-q"`` (queries travel, partial O and LSE come back), ``"ring"`` (the
    cache travels) or ``"auto"`` (whichever the planner's time model estimates faster). Forward
    only (serving); exact.

    A model keeps one cache per layer: ``KVCacheGroup(share_with=first_layer)`` makes another
    layer's cache over the same group, placement and timeout that uses ``first_layer``'s
    communicator (on GPUs one NCCL communicator for every layer, not one each) and its step
    plans (a step is planned once for all layers).
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        placement: Optional[str] = None,
        *,
        timeout: Optional[float] = None,
        share_with: Optional["KVCacheGroup"] = None,
    ):
        if share_with is None:
            self._cp = ContextParallel(group, strategy="pass-q", timeout=300.0 if timeout is None else timeout)
            self.placement = "pages:16" if placement is None else placement
            self._steps: Dict[tuple, tuple] = {}
        else:
            if not isinstance(share_with, KVCacheGroup):
                raise TypeError(f"share_with must be a KVCacheGroup, got {type(share_with).__name__}")
            given = {"group": group, "placement": placement, "timeout": timeout}
            own = {"group": share_with._cp.group, "placement": share_with.placement, "timeout": share_with._cp.timeout}
            for name, value in given.items():
                if value is not None and value != own[name]:
                    raise ValueError(f"{name} {value!r} differs from the shared cache's {own[name]!r}")
            self._cp, self.placement, self._steps = share_with._cp, share_with.placement, share_with._steps
        self.rank, self.world = self._cp.rank, self._cp.world
        # The cache this rank holds (``add``/``step``): per request its home, its length, the
        # K/V of the positions placed here (ascending, in buffers with room to grow) and how many
        # rows of them are filled.
        self._requests: Dict[object, list] = {}

    # ------------------------------------------------------------------ a cache that grows

    def _check_growable(self):
        """A growing cache's placement fixes where each position goes: its capacity is named."""
        kind, _, n = self.placement.partition(":")
        if not n.isdigit() or int(n) == 0 or kind not in ("pages", "contiguous", "zigzag"):
            raise ValueError(
                f"a growing cache needs placement pages:N, contiguous:N or zigzag:N (capacity), got {self.placement!r}"
            )

    def add(self, rid, home: int) -> None:
        """Starts request ``rid`` homed on rank ``home`` (every rank calls it alike)."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} exists already")
        if not 0 <= home < self.world:
            raise ValueError(f"home rank {home} is not a rank of a group of {self.world}")
        self._check_growable()
        self._requests[rid] = [home, 0, None, None, 0]

    def drop(self, rid) -> None:
        """Ends request ``rid``, freeing its cache (every rank calls it alike)."""
        self._requests.pop(rid)

    def step(self, batch, q: Tensor, k_new: Tensor, v_new: Tensor, strategy: str = "auto", softmax_scale=None, return_lse=False):
        """One step of ``batch`` (``[(rid, new tokens), ...]``, the same on every rank): each rank
        passes the new tokens of the requests homed on it, in batch order, as q ``[1, rows, h,
        d]`` and their K/V ``[1, rows, h_kv, d]``. Their K/V go to the ranks the placement puts
        them on (appended in place), then the step's attention runs; returns O (and the LSE)
        of this rank's rows, like q."""
        self._check_growable()
        plan = []  # (rid, home, cached, new)
        for rid, new in batch:
            home, length = self._requests[rid][:2]
            plan.append((rid, home, length, int(new)))
        mine = [(rid, cached, new) for rid, home, cached, new in plan if home == self.rank]
        if q.shape[1] != sum(n for _, _, n in mine) or k_new.shape[1] != q.shape[1] or v_new.shape != k_new.shape:
            raise ValueError(
                f"q/k_new/v_new hold {q.shape[1]}/{k_new.shape[1]}/{v_new.shape[1]} rows; the requests homed on "
                f"rank {self.rank} add {sum(n for _, _, n in mine)}"
            )
        def owners(home, cached, new):
            # Each new position's rank, as the placement deals it.
            return torch.tensor(_native.kv_owners(self.placement, self.world, home, cached, new), dtype=torch.long)

        hkv, d = k_new.shape[2], k_new.shape[3]
        kv_new = torch.stack([k_new[0], v_new[0]], 1)  # [rows, 2, h_kv, d]: a row's K and V travel together
        # Rows this rank sends to each owner (and keeps): per request (batch order) its row
        # indices into kv_new, positions ascending.
        rows_to = {r: [] for r in range(self.world)}
        at = 0
        for rid, cached, new in mine:
            own = owners(self.rank, cached, new)
            for r in own.unique().tolist():
                rows_to[r].append((rid, (at + torch.nonzero(own == r).flatten()).to(kv_new.device)))
            at += new
        sends = {
            r: kv_new[torch.cat([i for _, i in parts])].reshape(-1, hkv, d)
            for r, parts in rows_to.items()
            if parts and r != self.rank
        }
        # What this rank receives, per home: the requests (batch order) and how many of their new
        # positions it owns.
        incoming = {}
        for rid, home, cached, new in plan:
            if home != self.rank:
                n = int((owners(home, cached, new) == self.rank).sum())
                if n:
                    incoming.setdefault(home, []).append((rid, n))
        recvs = {
            r: torch.empty((2 * sum(n for _, n in parts), hkv, d), dtype=k_new.dtype, device=k_new.device)
            for r, parts in incoming.items()
        }
        ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(self._cp.group, r), self._cp.group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self._cp.group, r), self._cp.group) for r, t in recvs.items()]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        # Append what stays and what came: each request's rows here come from one rank, in
        # position order.
        got = {rid: kv_new[i] for rid, i in rows_to[self.rank]}
        for r, parts in incoming.items():
            buf, at = recvs[r].view(-1, 2, hkv, d), 0
            for rid, n in parts:
                got[rid], at = buf[at : at + n], at + n
        for rid, _, _, new in plan:
            entry = self._requests[rid]
            rows = got.get(rid)
            if rows is not None:
                held = entry[4]
                entry[2] = _appended(entry[2], held, rows[:, 0])
                entry[3] = _appended(entry[3], held, rows[:, 1])
                entry[4] = held + rows.shape[0]
            entry[1] += new
        # The step's keys here: each request's filled rows, in batch order. A lone request's
        # are a view of its buffer; several are packed into one copy.
        held = [e for e in (self._requests[rid] for rid, *_ in plan) if e[4]]

        def packed(i):
            parts = [e[i][: e[4]] for e in held]
            return (parts[0] if len(parts) == 1 else torch.cat(parts) if parts else k_new.new_empty((0, hkv, d)))[None]

        k, v = packed(2), packed(3)
        requests = [(home, cached, new) for _, home, cached, new in plan]
        return self.attention(q, k, v, requests, False, strategy, softmax_scale, return_lse)

    def _step(self, requests, prefill, strategy, shape, softmax_scale, device):
        requests = tuple((int(h), int(c), int(n)) for h, c, n in requests)
        key = (requests, prefill, strategy, shape, softmax_scale, str(device))
        got = self._steps.get(key)
        if got is None:
            h, hkv, d = shape
            got = _native.CpRank.serving(
                list(requests), self.placement, prefill, strategy, self.world, self.rank, h, hkv, d, softmax_scale,
                self._cp._transport(device),
            )  # fmt: skip
            _remember(self._steps, key, got)
        return got

    @staticmethod
    def _per_request(runs, lens):
        """Global packed runs as (request, start, end) within each request."""
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        out = []
        for s, e in runs:
            i = 0
            while s < e:
                while starts[i + 1] <= s:
                    i += 1
                stop = min(e, starts[i + 1])
                out.append((i, s - starts[i], stop - starts[i]))
                s = stop
        return out

    def local_queries(self, requests, prefill: bool = False):
        """This rank's query rows: ``(request, first, end)`` runs over each request's new tokens."""
        r, _ = self._step(requests, prefill, "pass-q", (1, 1, 8), None, torch.device("cpu"))
        return self._per_request(r.tokens(), [n for _, _, n in requests])

    def local_keys(self, requests, prefill: bool = False):
        """This rank's cached keys: ``(request, first, end)`` runs over each request's
        ``cached + new`` positions, ascending within each request, in request order."""
        capacity = max(c + n for _, c, n in requests)
        return [
            (i, s, e)
            for i, (home, c, n) in enumerate(requests)
            for s, e in _native.kv_positions(self.placement, self.world, capacity, int(home), int(c) + int(n), self.rank)
        ]

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        requests,
        prefill: bool = False,
        strategy: str = "auto",
        softmax_scale: Optional[float] = None,
        return_lse: bool = False,
    ):
        """O ``[1, rows, h, d]`` (and LSE ``[1, h, rows]``, natural log) of this rank's query rows
        ``q`` ``[1, rows, h, d]`` against the whole cache, this rank holding keys ``k``, ``v``
        ``[1, keys, h_kv, d]`` (rows in ``local_queries`` / ``local_keys`` order)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D [1, rows, heads, head_dim], got {tuple(t.shape)}")
        scale = None if softmax_scale is None else float(softmax_scale)
        r, used = self._step(requests, prefill, strategy, (q.shape[2], k.shape[2], q.shape[3]), scale, q.device)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty_like(q)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        with torch.no_grad():
            r.forward(_desc(q), _desc(k), _desc(v), _desc(o), _desc(lse), [], _stream(q))
        self.last_strategy = used
        return (o, lse) if return_lse else o


def release_cached_memory(device=None) -> None:
    """Returns to the GPU the workspace that context-parallel calls on ``device`` (default: the
    current CUDA device) keep for their next call, as ``torch.cuda.empty_cache()`` does for
    torch's cached blocks. Calls keep it because mapping it again at every call costs time (a
    third of a 32k-token forward on two GPUs); a call after this one maps it again."""
    if not torch.cuda.is_available():
        return
    d = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {d}")
    index = d.index if d.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)  # blocks that enqueued work still holds are not released
    _native.release_cached_memory(index)


def _remember(cache: dict, key, value) -> None:
    """Keeps `value` under `key`, starting over past 64 entries: a run of ever new sequence
    lengths (variable-length training) does not grow the per-length plans without bound."""
    if len(cache) >= 64:
        cache.clear()
    cache[key] = value


# ---------------------------------------------------------------- custom ops and autograd


def _kept_outputs(q: Tensor, k: Tensor, cp_id: int, seq_len: int, keep: bool) -> List[Tensor]:
    """Tensors for what the forward keeps for its backward (four empty ones when nothing is)."""
    # The plan decides these shapes, in no closed form of the inputs': under torch.compile's
    # dynamic shapes (a second sequence length, or a second instance's id) they are specialized
    # to the traced values.
    q_shape, k_shape = tuple(int(x) for x in q.shape), tuple(int(x) for x in k.shape)
    shapes = _instances[int(cp_id)]._kept_shapes((q_shape, k_shape), int(seq_len), q.dtype) if keep else []
    if not shapes:
        return [q.new_empty(0) for _ in range(4)]
    return [q.new_empty(shape, dtype=torch.float32 if name == "lse" else q.dtype) for name, shape in shapes]


def _cp_forward_impl(
    q: Tensor, k: Tensor, v: Tensor, cp_id: int, seq_len: int, softmax_scale: Optional[float], keep: bool
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cp = _instances[cp_id]
    q, k, v = _dense(q), _dense(k), _dense(v)
    r = cp._rank((tuple(q.shape), tuple(k.shape)), seq_len, softmax_scale, q.device)
    b, n, h, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
    kept = _kept_outputs(q, k, cp_id, seq_len, keep)
    written = [_desc(t) for t in kept if t.numel()]
    r.forward(_desc(q), _desc(k), _desc(v), _desc(o), _desc(lse), written, _stream(q))
    return (o, lse, *kept)


def _cp_backward_impl(
    d_o: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cp_id: int,
    seq_len: int,
    softmax_scale: Optional[float],
    kv_heads: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    # q, k, v and lse are the shards, or what the forward kept instead: the gradients are shaped
    # like the shards, O's for dQ.
    cp = _instances[cp_id]
    # Dense copies where needed, held in locals: the native call reads their memory.
    d_o, q, k, v, o, lse = (_dense(t) for t in (d_o, q, k, v, o, lse))
    b, n, _, d = o.shape
    kv_shape = (b, n, kv_heads, d)
    r = cp._rank((tuple(o.shape), kv_shape), seq_len, softmax_scale, o.device)
    dq, dk, dv = torch.empty_like(o), o.new_empty(kv_shape), o.new_empty(kv_shape)
    r.backward(
        _desc(q), _desc(k), _desc(v), _desc(o), _desc(lse), _desc(d_o), _desc(dq), _desc(dk), _desc(dv), _stream(o),
    )  # fmt: skip
    return dq, dk, dv


cp_forward = torch.library.custom_op("distattn::cp_forward", _cp_forward_impl, mutates_args=())
cp_backward = torch.library.custom_op("distattn::cp_backward", _cp_backward_impl, mutates_args=())


@cp_forward.register_fake
def _(q, k, v, cp_id, seq_len, softmax_scale, keep):
    b, n, h, _ = q.shape
    o, lse = q.new_empty(q.shape), q.new_empty((b, h, n), dtype=torch.float32)
    return (o, lse, *_kept_outputs(q, k, cp_id, seq_len, keep))


@cp_backward.register_fake
def _(d_o, q, k, v, o, lse, cp_id, seq_len, softmax_scale, kv_heads):
    b, n, _, d = o.shape
    return o.new_empty(o.shape), o.new_empty((b, n, kv_heads, d)), o.new_empty((b, n, kv_heads, d))


def _setup(ctx, inputs, output):
    q, k, v, cp_id, seq_len, softmax_scale, _keep = inputs
    o, lse, *kept = output
    # What the forward kept stands in for the shards of Q, K, V and the LSE: as many values.
    held = kept if kept[0].numel() else (q, k, v, lse)
    ctx.save_for_backward(held[0], held[1], held[2], o, held[3])
    ctx.args = (cp_id, seq_len, softmax_scale, k.shape[2])
    ctx.cp = _instances[int(cp_id)]  # alive until the backward has run (an int also where traced)
    ctx.mark_non_differentiable(lse, *kept)
    ctx.set_materialize_grads(False)


def _grads(ctx, d_o, backward_fn):
    if d_o is None:
        return None, None, None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = backward_fn(d_o, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


cp_forward.register_autograd(lambda ctx, d_o, *_: _grads(ctx, d_o, cp_backward), setup_context=_setup)


_EagerCp = eager_autograd(_cp_forward_impl, _setup, _grads, _cp_backward_impl)


def _cp_call(*inputs):
    if through_dispatcher():
        return cp_forward(*inputs)
    return _EagerCp.apply(*inputs)
