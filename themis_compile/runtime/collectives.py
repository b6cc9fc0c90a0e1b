"""SparseAllGather and SparseReduceScatter (§3.2), asynchronous and topology-aware (§3.3).

``sparse_all_gather(chunks, P, P', topology)`` delivers exactly ΔP = P' \\ P: every device receives a
bit-exact copy of each expert chunk that P' adds to it. ``sparse_reduce_scatter(grads, P', P, topology)``
is its mirror image: every owner receives the sum of its expert's gradient over all devices holding the
expert in P'. Both return a handle at once; ``handle.wait()`` returns the result.

Realization (one plan, computed identically on every rank from (P, P', topology, chunk layout)):

    SpAG, for every expert e and every node n that holds added replicas S = {s_1..s_m} of e:
      stage 0 (scatter):    the owner splits the chunk into m pieces and sends piece j to s_j —
                            Ψ enters node n exactly once (§3.3), from one source;
      stage 1 (all-gather): s_j sends piece j to the other members of S, inside node n.
    SpRS runs the same plan backwards with sends and receives swapped:
      stage 0 (reduce-scatter inside node n): s_k sends piece j of its gradient to s_j, which adds it;
      stage 1 (gather):     s_j sends its partial sum of piece j to the owner, which adds it to its own
                            gradient — one combined partial sum leaves each node (§3.3).

Every added replica thus receives exactly Ψ in SpAG and sends exactly Ψ in SpRS (Eq. 4), each newly
reached node sees Ψ of inter-node traffic, and the collective takes two message rounds whatever the
replica count. Piece sizes are chosen by water-filling on the bytes each device already sends in this
collective, so devices that send a lot (owners of many hot experts) get small pieces to relay: any holder
may supply a piece (§3.3). Pieces are cut at element boundaries so that gradients can be summed piecewise.
What one device sends to another in one stage is cut into runs by sizes both sides know (`_runs`): small
pieces are bucketed into one buffer, large ones travel alone, and a run whose bytes lie back to back in
memory is sent from or received into that memory without a copy. Replicas and partial sums are therefore
allocated as views into one flat buffer per expert (`ChunkLayout.empty`).

Asynchrony: on gloo the stages run on one background thread per process group (FIFO, so collectives
execute in issue order on every rank; ``Work.wait`` releases the GIL, so compute on the main thread
proceeds meanwhile). On NCCL the stages are enqueued at once on the communicator's stream (host
non-blocking; the handle then reports completion as soon as everything is enqueued, and consumers are
ordered after the transfers by the stream, as with any NCCL collective). The p2p messages use a private tag; other collectives on the same group do not interfere,
but a dedicated group (``dist.new_group()``) is the safest choice.

Chunk layout. A chunk is an expert's list of parameter tensors (any dtype/shape mix, zero-size allowed),
e.g. SwiGLU ``[w1, w2, w3]``. Receivers must know it: pass ``spec=[(shape, dtype), ...]`` (the same for
every expert of the layer, or a mapping expert -> spec); when omitted it is derived from a local chunk
(SpAG: an owned chunk; SpRS: any local gradient), which requires that all experts of the layer share one
spec and that a receiving rank holds at least one chunk.

Numerics of SpRS: the owner's result is ``own + Σ_n partial_n`` with each node's partial sum formed in a
fixed order (ascending device id) — bitwise reproducible across runs for a fixed plan. Against a sum in
another order it differs by rounding only: |result - exact| ≤ (k-1)·eps·Σ_i |g_i| elementwise for k
holders (standard recursive-summation bound; fp32 eps = 2^-23); integer-valued fp32 gradients sum exactly.

Legend: E experts, D devices (ranks of the group), N nodes.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import datetime
import functools
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from themis_compile.cost_model.volume import SPAG, SPRS, CollectiveVolume
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = [
    "ChunkLayout",
    "Transfer",
    "CommPlan",
    "SparseCollectiveHandle",
    "SpAGHandle",
    "SpRSHandle",
    "collective_device",
    "plan_sparse_all_gather",
    "plan_sparse_reduce_scatter",
    "sparse_all_gather",
    "sparse_reduce_scatter",
    "shutdown_workers",
]

ChunkSpec = Sequence[tuple[Sequence[int], torch.dtype]]

_P2P_TAG = 0x7E4D  # private tag of sparse-collective messages (gloo matches p2p by (peer, tag))
DEFAULT_TIMEOUT_S = 300.0


# ============================================================================================ layout
@dataclass(frozen=True)
class ChunkLayout:
    """Byte layout of one expert chunk: its tensors concatenated without padding.

    Attributes:
        shapes: shape of every tensor of the chunk.
        dtypes: dtype of every tensor.
        offsets: byte offset of every tensor in the flat chunk, plus the total (len = tensors + 1).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]

    @classmethod
    def from_spec(cls, spec: ChunkSpec) -> ChunkLayout:
        """Build from ``[(shape, dtype), ...]``."""
        shapes, dtypes, offsets = [], [], [0]
        for item in spec:
            try:
                shape, dtype = item
            except (TypeError, ValueError) as exc:
                raise ValueError(f"a chunk spec entry must be (shape, dtype), got {item!r}") from exc
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"chunk spec dtype must be a torch.dtype, got {dtype!r}")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"chunk spec shape must be non-negative, got {shape}")
            shapes.append(shape)
            dtypes.append(dtype)
            offsets.append(offsets[-1] + math.prod(shape) * dtype.itemsize)
        return cls(tuple(shapes), tuple(dtypes), tuple(offsets))

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> ChunkLayout:
        """The layout of a list of tensors."""
        return cls.from_spec([(tuple(t.shape), t.dtype) for t in tensors])

    @property
    def nbytes(self) -> int:
        """Ψ: the chunk's byte size."""
        return self.offsets[-1]

    def snap(self, x: float) -> int:
        """The element boundary nearest to byte offset ``x`` (cuts never split an element)."""
        if x <= 0:
            return 0
        if x >= self.nbytes:
            return self.nbytes
        i = bisect.bisect_right(self.offsets, x) - 1
        size = self.dtypes[i].itemsize
        return self.offsets[i] + int(round((x - self.offsets[i]) / size)) * size

    def segments(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The byte range [start, stop) of the flat chunk as ``(tensor, lo, hi)`` byte ranges per tensor."""
        out = []
        i = max(bisect.bisect_right(self.offsets, start) - 1, 0)
        while i < len(self.shapes) and self.offsets[i] < stop:
            lo, hi = max(start, self.offsets[i]), min(stop, self.offsets[i + 1])
            if hi > lo:
                out.append((i, lo - self.offsets[i], hi - self.offsets[i]))
            i += 1
        return out

    def check(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Raise ValueError unless ``tensors`` match this layout."""
        got = tuple((tuple(t.shape), t.dtype) for t in tensors)
        want = tuple(zip(self.shapes, self.dtypes))
        if got != want:
            raise ValueError(f"{what} does not match the chunk spec: got {list(got)}, expected {list(want)}")

    def empty(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Freshly allocated (contiguous, uninitialized) tensors of this layout.

        They are views into one flat buffer, back to back as in the layout, whenever every tensor's offset
        is a multiple of its dtype's size: a piece of the chunk that spans several tensors is then one
        contiguous byte range, which travels without a copy. Otherwise they are separate allocations.
        """
        if all(off % dt.itemsize == 0 for off, dt in zip(self.offsets, self.dtypes)):
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            return [flat[a:b].view(dt).view(s)
                    for s, dt, a, b in zip(self.shapes, self.dtypes, self.offsets, self.offsets[1:])]
        return [torch.empty(s, dtype=dt, device=device) for s, dt in zip(self.shapes, self.dtypes)]


# ============================================================================================ plan
@dataclass(frozen=True, order=True)
class Transfer:
    """Bytes [start, stop) of expert ``expert``'s flat chunk move from device ``src`` to ``dst``;
    ``slice``: the pipeline slice it belongs to, `DIRECT` when no relay depends on it (see
    `plan_sparse_all_gather`)."""

    src: int
    dst: int
    expert: int
    start: int
    stop: int
    slice: int = 0

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class CommPlan:
    """The global message plan of one sparse collective; identical on every rank.

    Attributes:
        collective: ``"SparseAllGather"`` or ``"SparseReduceScatter"``.
        stages: per stage, its transfers sorted by (src, dst, expert, start); a stage starts after the
            previous one has completed on the participating devices.
        node_ids: [D] node of every device.
        num_nodes: N.
    """

    collective: str
    stages: tuple[tuple[Transfer, ...], ...]
    node_ids: tuple[int, ...]
    num_nodes: int
    # Per rank, its part of the plan cut into messages and runs (`_schedule`); not part of the plan's value.
    _schedules: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.node_ids)

    def messages(self, stage: int, slice: int | None = None) -> dict[tuple[int, int], list[Transfer]]:
        """Stage ``stage`` (only its slice ``slice`` when given) bucketed into one message per (src, dst)."""
        out: dict[tuple[int, int], list[Transfer]] = {}
        for t in self.stages[stage]:
            if slice is None or t.slice == slice:
                out.setdefault((t.src, t.dst), []).append(t)
        return out

    @property
    def num_slices(self) -> int:
        """Pipeline slices (besides `DIRECT`): stage 1 of slice i may start once stage 0 of slice i arrived."""
        return 1 + max((t.slice for stage in self.stages for t in stage), default=0)

    def num_messages(self) -> int:
        return sum(len(self.messages(s, i)) for s in range(len(self.stages))
                   for i in (DIRECT, *range(self.num_slices)))

    def sent_bytes_D(self) -> tuple[int, ...]:
        """[D] bytes each device sends."""
        sent = [0] * self.num_devices
        for stage in self.stages:
            for t in stage:
                sent[t.src] += t.nbytes
        return tuple(sent)

    def recv_bytes_D(self) -> tuple[int, ...]:
        """[D] bytes each device receives."""
        recv = [0] * self.num_devices
        for stage in self.stages:
            for t in stage:
                recv[t.dst] += t.nbytes
        return tuple(recv)

    def volume(self) -> CollectiveVolume:
        """What this plan moves, in the cost model's terms (compare with ``cost_model.volume``)."""
        ingress = [0] * self.num_nodes
        egress = [0] * self.num_nodes
        for stage in self.stages:
            for t in stage:
                a, b = self.node_ids[t.src], self.node_ids[t.dst]
                if a != b:
                    egress[a] += t.nbytes
                    ingress[b] += t.nbytes
        sent = self.sent_bytes_D()
        return CollectiveVolume(self.collective, sum(sent), self.recv_bytes_D(), sent, sum(ingress),
                                tuple(ingress), tuple(egress))


def _water_fill(loads: Sequence[float], total: int, factor: int) -> list[float]:
    """Amounts x_j ≥ 0 with Σ x_j = total minimizing max_j (loads_j + factor·x_j)."""
    m = len(loads)
    if m == 1 or factor == 0:
        return [float(total)] + [0.0] * (m - 1) if factor == 0 else [float(total)]
    order = sorted(range(m), key=lambda j: (loads[j], j))
    budget, cum, level = float(total) * factor, 0.0, 0.0
    for k in range(m):
        cum += loads[order[k]]
        level = (budget + cum) / (k + 1)
        if k + 1 == m or level <= loads[order[k + 1]]:
            break
    return [max(0.0, level - load) / factor for load in loads]


def _pieces(layout: ChunkLayout, members: Sequence[int], sent: list[float]) -> list[tuple[int, int, int]]:
    """Split a chunk among ``members`` (ascending) as ``(member, start, stop)``, balancing what they send.

    In the all-gather stage member j sends its piece to the other m-1 members, so its piece costs it
    (m-1) bytes per byte; water-filling on ``sent`` (bytes already sent, updated here) balances the load.
    """
    m, total = len(members), layout.nbytes
    amounts = _water_fill([sent[d] for d in members], total, m - 1)
    cuts, acc = [0], 0.0
    for x in amounts[:-1]:
        acc += x
        cuts.append(min(max(layout.snap(acc), cuts[-1]), total))
    cuts.append(total)
    out = []
    for j, d in enumerate(members):
        out.append((d, cuts[j], cuts[j + 1]))
        sent[d] += (m - 1) * (cuts[j + 1] - cuts[j])
    return out


DIRECT = -1                  # the slice of transfers no relay waits for (a node's only new holder)
_SLICE_BYTES = 1 << 20       # a relayed piece is cut into slices of about this size ...
_MAX_SLICES = 4              # ... but into no more than this many


def _slices(layout: ChunkLayout, start: int, stop: int) -> list[tuple[int, int]]:
    """Bytes [start, stop) of a relayed piece as pipeline slices, cut at element boundaries (non-empty)."""
    k = min(_MAX_SLICES, max(1, (stop - start) // _SLICE_BYTES))
    cuts = [start]
    for i in range(1, k):
        cuts.append(min(max(layout.snap(start + (stop - start) * i / k), cuts[-1]), stop))
    cuts.append(stop)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _require_placements(shard: Placement, placement: Placement) -> None:
    """ValueError unless both are `Placement` objects (checked before anything reads them)."""
    if not isinstance(shard, Placement) or not isinstance(placement, Placement):
        raise ValueError("shard and placement must be themis_compile.planner.Placement objects")


def _check_placements(shard: Placement, placement: Placement, topology: Topology) -> None:
    _require_placements(shard, placement)
    shard.require_shard_placement("the shard placement P")
    if shard.shape != placement.shape:
        raise ValueError(f"P and P' have different shapes {shard.shape} and {placement.shape}")
    if not shard.issubset(placement):
        raise ValueError("the ephemeral placement P' must contain the shard placement P (P ⊆ P')")
    topology.validate(shard.num_devices)


class _BoundedCache:
    """A least-recently-used map of at most ``maxsize`` entries, keyed by value (placement digests,
    placements, topologies): an entry can never be found for another object that happens to reuse a
    freed object's ``id()``. Safe to use from several threads."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = int(maxsize)
        self._data: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


# Plans are pure functions of their key, so a process-wide cache is exact; bounded so that a long run
# of distinct placements (re-sharding every 100 iterations, calibration every iteration) cannot grow it.
_PLAN_CACHE_SIZE = 256
_PLAN_CACHE = _BoundedCache(_PLAN_CACHE_SIZE)


def _plan_key(collective: str, shard: Placement, placement: Placement, topology: Topology,
              layout_E: Sequence[ChunkLayout]) -> tuple:
    # The cutting constants are part of the wire format (every rank must cut alike): part of the key.
    return (collective, shard.digest(), placement.digest(), topology.devices_per_node, tuple(layout_E),
            _SLICE_BYTES, _MAX_SLICES)


def plan_sparse_all_gather(shard: Placement, placement: Placement, topology: Topology,
                           layouts: ChunkLayout | Sequence[ChunkLayout]) -> CommPlan:
    """The two-stage, topology-aware message plan of SpAG(P=shard, P'=placement) (see module docstring).

    ``layouts`` is one `ChunkLayout` for all experts or one per expert. Pure and deterministic: every rank
    computes the same plan.
    """
    _require_placements(shard, placement)
    E, D = shard.shape
    layout_E = [layouts] * E if isinstance(layouts, ChunkLayout) else list(layouts)
    if len(layout_E) != E:
        raise ValueError(f"need one chunk layout per expert ({E}), got {len(layout_E)}")
    key = _plan_key(SPAG, shard, placement, topology, layout_E)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:                         # validated when it was planned
        return cached
    _check_placements(shard, placement, topology)
    owners_E = shard.owners()
    node_ids = topology.node_ids
    delta_ED = placement.mask & ~shard.mask
    sent = [0.0] * D                                   # bytes each device sends so far (for balancing)
    stage0: list[Transfer] = []
    stage1: list[Transfer] = []
    # Largest total transfers first, so that later (smaller) ones even out the load they leave.
    order_E = sorted(range(E), key=lambda e: (-layout_E[e].nbytes * int(delta_ED[e].sum()), e))
    for e in order_E:
        added = np.flatnonzero(delta_ED[e])
        psi = layout_E[e].nbytes
        if added.size == 0 or psi == 0:
            continue
        owner = int(owners_E[e])
        for n in np.unique(node_ids[added]):          # §3.3: one entry per node, fan out inside it
            members = [int(d) for d in added[node_ids[added] == n]]
            sent[owner] += psi
            pieces = _pieces(layout_E[e], members, sent)
            for d, a, b in pieces:
                if b <= a:
                    continue
                if len(members) == 1:
                    stage0.append(Transfer(owner, d, e, a, b, DIRECT))          # the whole chunk
                    continue
                # Pipelining: a large piece goes in slices; stage 1 forwards slice i as soon as it arrived.
                for i, (lo, hi) in enumerate(_slices(layout_E[e], a, b)):
                    stage0.append(Transfer(owner, d, e, lo, hi, i))                   # scatter into node n
                    stage1.extend(Transfer(d, d2, e, lo, hi, i) for d2 in members if d2 != d)  # all-gather
    stages = tuple(tuple(sorted(s)) for s in (stage0, stage1) if s)
    plan = CommPlan(SPAG, stages, tuple(int(n) for n in node_ids), topology.num_nodes)
    _PLAN_CACHE.put(key, plan)
    return plan


def plan_sparse_reduce_scatter(placement: Placement, shard: Placement, topology: Topology,
                               layouts: ChunkLayout | Sequence[ChunkLayout]) -> CommPlan:
    """The plan of SpRS(P'=placement, P=shard): the SpAG plan run backwards with src and dst swapped."""
    spag = plan_sparse_all_gather(shard, placement, topology, layouts)    # validates the inputs
    E = shard.shape[0]
    layout_E = [layouts] * E if isinstance(layouts, ChunkLayout) else list(layouts)
    key = _plan_key(SPRS, shard, placement, topology, layout_E)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:
        return cached
    stages = tuple(tuple(sorted(Transfer(t.dst, t.src, t.expert, t.start, t.stop, t.slice) for t in stage))
                   for stage in reversed(spag.stages))
    plan = CommPlan(SPRS, stages, spag.node_ids, spag.num_nodes)
    _PLAN_CACHE.put(key, plan)
    return plan


# ============================================================================================ execution
def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (a copy first when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copied when its offset is not aligned)."""
    if buf.storage_offset() % dtype.itemsize:
        buf = buf.clone()
    return buf.view(dtype)


_Segment = tuple[Any, int, int]     # (where, lo, hi): bytes [lo, hi) of one tensor of a chunk
_ZERO_COPY_BYTES = 1 << 20           # segments at least this large travel as their own message
_BUCKET_BYTES = 64 << 10             # transfers smaller than this share a message with their neighbours


def _runs(per_transfer: list[list[_Segment]]) -> list[list[_Segment]]:
    """Cut one message (the segments of each of its transfers, in order) into runs, one buffer each.

    - A transfer of at least ``_BUCKET_BYTES`` forms its own runs, so that where its bytes lie back to back
      in memory (chunks allocated by `ChunkLayout.empty`) the run is that memory itself, with no copy;
      within it, a segment of at least ``_ZERO_COPY_BYTES`` travels alone (no copy even when the chunk's
      tensors are separate allocations).
    - Smaller transfers are bucketed with their neighbours: one message instead of many.

    Depends only on the transfer and segment sizes, which sender and receiver share, so both cut alike;
    each side then decides on its own whether a run needs a copy (`_span`).
    """
    runs: list[list[_Segment]] = []
    bucket: list[_Segment] = []
    for segs in per_transfer:
        if sum(hi - lo for _, lo, hi in segs) < _BUCKET_BYTES:
            bucket += segs
            continue
        if bucket:
            runs.append(bucket)
            bucket = []
        part: list[_Segment] = []
        for seg in segs:
            if seg[2] - seg[1] >= _ZERO_COPY_BYTES:
                if part:
                    runs.append(part)
                    part = []
                runs.append([seg])
            else:
                part.append(seg)
        if part:
            runs.append(part)
    if bucket:
        runs.append(bucket)
    return runs


def _span(run: list[_Segment]) -> torch.Tensor | None:
    """The run's bytes as one uint8 tensor when they lie back to back in one storage (sent from, or
    received into, without a copy); None when they do not."""
    view, lo, hi = run[0]
    if len(run) == 1:
        return view[lo:hi]
    storage = view.untyped_storage().data_ptr()
    end = view.storage_offset() + hi
    for v, a, b in run[1:]:
        if v.untyped_storage().data_ptr() != storage or v.storage_offset() + a != end:
            return None
        end = v.storage_offset() + b
    start = view.storage_offset() + lo
    return view.as_strided((end - start,), (1,), start)


_Run = tuple[_Segment, ...]           # segments ((expert, tensor), lo, hi) that travel as one buffer


@dataclass(frozen=True)
class _Schedule:
    """One rank's part of a plan, cut into runs once and cached with the plan (`_schedule`).

    Attributes:
        posts: per (stage, slice) this rank takes part in: its receives as ``(src, runs)`` and its sends
            as ``(dst, runs, crosses_nodes)``, in the order both sides post them.
        first_stage_ranges: per expert, the distinct byte ranges ``(tensor, lo, hi)`` this rank receives
            in stage 0 (in SpRS: the piece it combines for its node).
    """

    posts: dict[tuple[int, int], tuple[tuple[tuple[int, tuple[_Run, ...]], ...],
                                       tuple[tuple[int, tuple[_Run, ...], bool], ...]]]

    first_stage_ranges: dict[int, tuple[tuple[int, int, int], ...]]


def _schedule(plan: CommPlan, layouts: ChunkLayout | list[ChunkLayout], rank: int) -> _Schedule:
    """``rank``'s `_Schedule` of ``plan`` (whose chunk layouts are ``layouts``); cached on the plan."""
    key = (rank, _ZERO_COPY_BYTES, _BUCKET_BYTES)      # the cutting constants, as in the plan cache
    cached = plan._schedules.get(key)
    if cached is not None:
        return cached

    def runs(transfers: list[Transfer]) -> tuple[_Run, ...]:
        return tuple(tuple(run) for run in _runs([
            [((t.expert, i), lo, hi) for i, lo, hi in _layout_of(layouts, t.expert).segments(t.start, t.stop)]
            for t in transfers]))

    posts = {}
    for stage in range(len(plan.stages)):
        for slice_ in (DIRECT, *range(plan.num_slices)):
            msgs = sorted(plan.messages(stage, slice_).items())
            receives = tuple((src, runs(ts)) for (src, dst), ts in msgs if dst == rank)
            sends = tuple((dst, runs(ts), plan.node_ids[src] != plan.node_ids[dst])
                          for (src, dst), ts in msgs if src == rank)
            if receives or sends:
                posts[(stage, slice_)] = (receives, sends)
    ranges: dict[int, dict[tuple[int, int, int], None]] = {}
    for (stage, _), (receives, _) in posts.items():
        if stage == 0:
            for _, rs in receives:
                for run in rs:
                    for (e, i), lo, hi in run:
                        ranges.setdefault(e, {})[(i, lo, hi)] = None
    schedule = plan._schedules[key] = _Schedule(posts, {e: tuple(r) for e, r in ranges.items()})
    return schedule


class _GroupWorker:
    """The thread that runs one process group's CPU (gloo) collective jobs, in issue order.

    Lifetime: it stops when its group is garbage collected (after ``dist.destroy_process_group``, or
    when the last reference to a sub-group goes), at `shutdown_workers`, and at interpreter exit; a job
    already queued runs to completion (or to its collective timeout) first. The thread is a daemon only
    so that a job stuck past its timeout cannot hang the interpreter's exit.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:                    # stop(): every job queued before it has run
                return
            job()
            job = None                         # hold no finished job (and its group) while waiting

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask the thread to finish after the jobs already queued; with ``timeout_s``, wait that long for
        it. Returns whether the thread has ended."""
        self._jobs.put(None)
        if timeout_s is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


# Weakly keyed by the group object itself: a destroyed group's entry goes with it (its finalizer stops
# the thread), and a new group can never inherit an old group's worker through a reused id().
_WORKERS: weakref.WeakKeyDictionary[Any, _GroupWorker] = weakref.WeakKeyDictionary()
_WORKERS_LOCK = threading.Lock()
_AT_EXIT_REGISTERED = False


def _worker_for(group: Any) -> _GroupWorker:
    global _AT_EXIT_REGISTERED
    with _WORKERS_LOCK:
        worker = _WORKERS.get(group)
        if worker is None or not worker.alive:
            worker = _WORKERS[group] = _GroupWorker(f"themis-sparse-collectives-{id(group):x}")
            weakref.finalize(group, worker.stop)
            if not _AT_EXIT_REGISTERED:
                atexit.register(shutdown_workers)
                _AT_EXIT_REGISTERED = True
        return worker


def shutdown_workers(timeout_s: float = 5.0) -> bool:
    """Stop the background threads of every process group's CPU collectives and wait up to
    ``timeout_s`` seconds for each (the jobs already issued run first). Returns whether all ended.

    Called at interpreter exit; a later CPU collective starts a fresh thread for its group.
    """
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    deadline = time.monotonic() + timeout_s
    return all([w.stop(max(0.0, deadline - time.monotonic())) for w in workers])


class SparseCollectiveHandle:
    """An in-flight sparse collective. ``wait()`` returns its result; ``is_completed()`` polls.

    Attributes:
        collective: ``"SparseAllGather"`` or ``"SparseReduceScatter"``.
        layer: the layer name given at the call (for error messages and logs).
        plan: the global `CommPlan` (the same on every rank).
        volume: the plan's global byte counts (`CollectiveVolume`): what every device sends and receives
            and what crosses node boundaries; equals ``cost_model.volume`` on the fixed side.
        sent_bytes, recv_bytes, inter_node_sent_bytes: what this rank actually put on / took off the wire
            (counted from the message buffers; final after ``wait()``).
    """

    def __init__(self, collective: str, layer: str, plan: CommPlan, rank: int, timeout_s: float,
                 layout_known: bool = True) -> None:
        self.collective = collective
        self._layout_known = layout_known
        self.layer = layer
        self.plan = plan
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.inter_node_sent_bytes = 0
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._nccl = False            # set by `_launch`: waits must not block the host on NCCL

    @property
    def volume(self) -> CollectiveVolume:
        """The global byte counts. A rank that holds no chunk and was given no ``spec`` cannot know the
        chunk size: there this raises RuntimeError (pass ``spec=`` to get the numbers everywhere)."""
        if not self._layout_known:
            raise RuntimeError(f"{self._name()}: rank {self.rank} holds no chunk and got no spec, so it does "
                               f"not know the chunk layout; pass spec= to record global volumes here")
        return self.plan.volume()

    def _name(self) -> str:
        return f"{self.collective} of layer {self.layer!r}" if self.layer else f"{self.collective}"

    def is_completed(self) -> bool:
        """True once the collective has finished on this rank (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done and return the result; raise TimeoutError/RuntimeError naming the collective
        and layer if it failed or did not finish within ``timeout_s`` (default: the call's timeout plus a
        grace period for the stage that is timing out)."""
        limit = self.timeout_s + 10.0 if timeout_s is None else float(timeout_s)
        if not self._done.wait(limit):
            raise TimeoutError(f"{self._name()} did not complete on rank {self.rank} within {limit:.1f}s")
        if self._error is not None:
            raise self._error
        return self._result

    # ---------------------------------------------------------------------------------- running
    def _run(self, body: Callable[[], Any]) -> None:
        try:
            self._result = body()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting thread
            self._error = exc
            logger.error("%s failed on rank %d: %s", self._name(), self.rank, exc)
        finally:
            self._done.set()

    def _run_stages(self, group: Any, deadline: float, device: torch.device, schedule: _Schedule,
                    send_view: Callable[[int, Any], torch.Tensor], recv_view: Callable[[Any], torch.Tensor] | None,
                    on_recv: Callable[[_Run, torch.Tensor], None]) -> None:
        """Run this rank's part of the plan.

        Order (the same on every rank, so per peer both sides post the same sequence of messages, which
        gloo matches in posting order and NCCL in issue order):

        1. stage 0 of every slice (what relays wait for goes first);
        2. every stage's direct transfers (slice ``DIRECT``: no relay depends on them);
        3. for slice i = 0, 1, ...: once this rank's stage-0 receives of slice i have arrived (and been
           unpacked), stage 1 of slice i — relaying overlaps the rest of stage 0;
        then the remaining receives, and last the sends (their buffers stay alive until then).
        """
        num_stages, num_slices = len(self.plan.stages), self.plan.num_slices
        pending: list[_Pending] = []

        def post(stage: int, slice_: int) -> tuple[list, list]:
            return self._post(group, stage, slice_, device, schedule, send_view, recv_view, deadline, pending)

        first = [post(0, i) for i in range(num_slices)]
        direct = [(stage, post(stage, DIRECT)) for stage in range(num_stages)]
        later = []
        for i in range(num_slices):
            self._complete(first[i], 0, deadline, on_recv)
            later += [(stage, post(stage, i)) for stage in range(1, num_stages)]
        for stage, posted in direct + later:
            self._complete(posted, stage, deadline, on_recv)
        for p in pending:
            self._wait(p.works, p.stage, deadline)

    def _post(self, group: Any, stage: int, slice_: int, device: torch.device, schedule: _Schedule,
              send_view: Callable[[int, Any], torch.Tensor], recv_view: Callable[[Any], torch.Tensor] | None,
              deadline: float, pending: list[_Pending]) -> tuple[list[tuple[int, Any]], list]:
        """Post this rank's receives and sends of one (stage, slice) as one batch; sends go to ``pending``.

        Each (src, dst) message travels as the runs of `_runs` (both sides cut the same sizes into the
        same runs). ``send_view(stage, (expert, tensor))`` and ``recv_view((expert, tensor))`` give the
        1-D uint8 view of a tensor the bytes come from or go to (``recv_view=None``: received bytes are
        combined by ``on_recv``, never written in place). A run whose bytes lie back to back there
        travels without a copy (`_span`); others are concatenated, or received into a buffer and unpacked.
        On NCCL one `dist.batch_isend_irecv` per (stage, slice) makes the receives and sends one group, so
        two devices exchanging in both directions cannot block each other.
        Returns the receives and the buffers to unpack once they arrived.
        """
        receives, sends_ = schedule.posts.get((stage, slice_), ((), ()))
        if not receives and not sends_:
            return [], []
        sends = _Pending(stage)
        pending.append(sends)
        received: list = []
        recv_ops: list[tuple[int, torch.Tensor]] = []
        send_ops: list[tuple[int, torch.Tensor]] = []
        for src, runs in receives:
            for run in runs:
                buf = None if recv_view is None else _span([(recv_view(key), lo, hi) for key, lo, hi in run])
                if buf is None:
                    buf = torch.empty(sum(hi - lo for _, lo, hi in run), dtype=torch.uint8, device=device)
                    received.append((len(recv_ops), run, buf))     # unpacked once operation i arrived
                recv_ops.append((src, buf))
                self.recv_bytes += buf.numel()
        for dst, runs, crosses_nodes in sends_:
            for run in runs:
                segs = [(send_view(stage, key), lo, hi) for key, lo, hi in run]
                buf = _span(segs)
                if buf is None:
                    buf = torch.cat([view[lo:hi] for view, lo, hi in segs])
                sends.buffers.append(buf)
                send_ops.append((dst, buf))
                self.sent_bytes += buf.numel()
                if crosses_nodes:
                    self.inter_node_sent_bytes += buf.numel()
        try:
            if self._nccl:
                ops = [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer, tag=_P2P_TAG)
                       for peer, buf in recv_ops]
                ops += [dist.P2POp(dist.isend, buf, group=group, group_peer=peer, tag=_P2P_TAG)
                        for peer, buf in send_ops]
                works = dist.batch_isend_irecv(ops)
            else:
                # gloo has no grouping to do: post on the process group itself, which spares the
                # per-operation argument checks of the functional API (most of a small message's cost).
                pg = group if group is not None else dist.group.WORLD
                works = [pg.recv([buf], peer, _P2P_TAG) for peer, buf in recv_ops]
                works += [pg.send([buf], peer, _P2P_TAG) for peer, buf in send_ops]
        except Exception as exc:  # noqa: BLE001 - re-raised with the collective's and layer's names
            raise self._failure(exc, stage, [p for p, _ in recv_ops + send_ops], deadline) from exc
        if len(works) == len(recv_ops) + len(send_ops):   # one work per operation (gloo)
            recvs = [(peer, w) for (peer, _), w in zip(recv_ops, works)]
            sends.works = [(peer, w) for (peer, _), w in zip(send_ops, works[len(recv_ops):])]
        else:                                          # one work for the whole batch (NCCL)
            first_peer = min(p for p, _ in recv_ops + send_ops)
            recvs = [(first_peer, w) for w in works]
            sends.works = []
        return recvs, received

    def _complete(self, posted: tuple[list[tuple[int, Any]], list], stage: int, deadline: float,
                  on_recv: Callable[[_Run, torch.Tensor], None]) -> None:
        """Wait for posted receives; unpack each one that did not land in place as soon as it arrived, so
        that unpacking (in SpRS: summing) overlaps the receives still in flight."""
        recvs, received = posted
        done = 0

        def unpack_through(i: int) -> None:
            nonlocal done
            while done < len(received) and received[done][0] <= i:
                _, run, buf = received[done]
                on_recv(run, buf)
                done += 1

        # On gloo a work per receive, in posting order; on NCCL the batch's works, then everything.
        self._wait(recvs, stage, deadline, None if self._nccl else unpack_through)
        unpack_through(len(received) + len(recvs))

    def _wait(self, works: list[tuple[int, Any]], stage: int, deadline: float,
              after: Callable[[int], None] | None = None) -> None:
        """Wait for ``works`` in order, calling ``after(i)`` once work i is done. On gloo each wait is
        bounded by the deadline; on NCCL ``wait()`` only orders the current stream after the transfer (a
        timeout would block the host), and the process group's own timeout applies."""
        for i, (peer, work) in enumerate(works):
            try:
                if self._nccl:
                    work.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("the deadline passed")
                    work.wait(timeout=datetime.timedelta(seconds=remaining))
            except Exception as exc:  # noqa: BLE001 - re-raised with the collective's and layer's names
                # The peer whose transfer failed first, then those not waited for yet (gloo reports a
                # point-to-point work as incomplete until it has been waited for).
                waiting = [peer] + [p for p, _ in works[i + 1:] if p != peer]
                raise self._failure(exc, stage, waiting, deadline) from exc
            if after is not None:
                after(i)

    def _failure(self, exc: BaseException, stage: int, peers: list[int], deadline: float) -> Exception:
        """The error to raise for ``exc``: names the collective, the layer, the stage and the peers."""
        unique = list(dict.fromkeys(peers))
        timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() \
            or time.monotonic() >= deadline
        kind = TimeoutError if timed_out else RuntimeError
        what = f"timed out after {self.timeout_s:.1f}s" if timed_out else "failed"
        return kind(f"{self._name()} {what} on rank {self.rank}: stage {stage} was still exchanging "
                    f"with ranks {unique} ({exc}); after a timeout the process group is unusable "
                    f"(gloo closes its connections) and must be rebuilt")


@dataclass
class _Pending:
    """Sends of one stage still in flight, and the buffers they read."""

    stage: int
    works: list[tuple[int, Any]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)


def _group_rank_and_size(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: Any = None) -> torch.device:
    """The device a group's collectives take their tensors on: the current CUDA device where the group
    runs NCCL for CUDA tensors (``init_process_group("nccl")``, ``"cpu:gloo,cuda:nccl"``, or no backend
    named on a CUDA machine), else the CPU."""
    if not dist.is_available() or not dist.is_initialized():
        return torch.device("cpu")
    try:
        config = str(dist.get_backend_config(group))    # e.g. "cuda:nccl" or "cpu:gloo,cuda:nccl"
    except Exception:  # noqa: BLE001 - older or custom groups: the backend's name
        config = str(dist.get_backend(group))
    if "nccl" in config.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_device(group: Any, local: Mapping[int, Sequence[torch.Tensor]]) -> torch.device:
    for ts in local.values():
        for t in ts:
            return t.device
    return collective_device(group)


def _resolve_layouts(spec: ChunkSpec | Mapping[int, ChunkSpec] | None, num_experts: int,
                     local: Mapping[int, Sequence[torch.Tensor]], needed: bool, what: str
                     ) -> ChunkLayout | list[ChunkLayout] | None:
    if spec is None:
        if not local:
            if needed:
                raise ValueError(f"{what}: this rank holds no chunk to derive the chunk layout from; "
                                 f"pass spec=[(shape, dtype), ...]")
            return None
        return ChunkLayout.of(local[min(local)])
    if isinstance(spec, Mapping):
        missing = [e for e in range(num_experts) if e not in spec]
        if missing:
            raise ValueError(f"{what}: spec mapping lacks experts {missing}")
        return [ChunkLayout.from_spec(spec[e]) for e in range(num_experts)]
    return ChunkLayout.from_spec(spec)


def _layout_of(layouts: ChunkLayout | list[ChunkLayout], e: int) -> ChunkLayout:
    return layouts if isinstance(layouts, ChunkLayout) else layouts[e]


@dataclass(frozen=True)
class _Local:
    """What a placement pair means for one rank, computed once per (P, P', topology, rank) and cached.

    Attributes:
        owners_E: [E] the owner of every expert in P.
        added_E: experts P' adds on this rank (SpAG receives them; in SpRS they are its replicas).
        replicated_E: experts this rank owns that P' replicates (SpAG sends them; SpRS sums into them).
        holds_E: experts this rank holds in P'.
    """

    owners_E: tuple[int, ...]
    added_E: tuple[int, ...]
    replicated_E: tuple[int, ...]
    holds_E: frozenset[int]


_LOCAL_CACHE = _BoundedCache(_PLAN_CACHE_SIZE)


def _common(shard: Placement, placement: Placement, topology: Topology | None, group: Any, what: str
            ) -> tuple[Topology, int, _Local]:
    """(topology, rank, this rank's `_Local`) after checking the placements against each other and the
    group; the checks run once per placement pair (a cached pair passed them)."""
    rank, world = _group_rank_and_size(group)
    _require_placements(shard, placement)
    if topology is None:
        topology = _single_node(shard.num_devices)
    key = (shard, placement, topology.devices_per_node, rank, world)
    local = _LOCAL_CACHE.get(key)
    if local is not None:
        return topology, rank, local
    _check_placements(shard, placement, topology)
    if shard.num_devices != world:
        raise ValueError(f"{what}: placements span {shard.num_devices} devices but the group has {world} ranks")
    delta_ED = placement.mask & ~shard.mask
    owners_E = tuple(int(o) for o in shard.owners())
    local = _Local(owners_E, tuple(int(e) for e in np.flatnonzero(delta_ED[:, rank])),
                   tuple(int(e) for e in np.flatnonzero(delta_ED.any(axis=1)) if owners_E[e] == rank),
                   frozenset(int(e) for e in np.flatnonzero(placement.mask[:, rank])))
    _LOCAL_CACHE.put(key, local)
    return topology, rank, local


@functools.lru_cache(maxsize=64)
def _single_node(num_devices: int) -> Topology:
    """The default topology (one node), made once per size."""
    return Topology.single_node(num_devices)


# ============================================================================================ SpAG
class SpAGHandle(SparseCollectiveHandle):
    """Handle of `sparse_all_gather`; ``wait()`` -> {expert: [tensors]} for ΔP on this rank."""


def sparse_all_gather(chunks: Mapping[int, Sequence[torch.Tensor]], shard: Placement, placement: Placement,
                      topology: Topology | None = None, group: Any = None, *, spec: ChunkSpec | None = None,
                      layer: str = "", out: Mapping[int, Sequence[torch.Tensor]] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> SpAGHandle:
    """Start SpAG(P=shard, P'=placement) (§3.2): materialize the replicas ΔP = P' \\ P.

    Args:
        chunks: for every expert this rank owns in ``shard`` (at least those with added replicas), its list
            of parameter tensors. They must not be modified before ``wait()`` returns.
        shard: the shard placement P (one owner per expert).
        placement: the ephemeral placement P' ⊇ P.
        topology: nodes of the group's ranks; ``None`` = one node.
        group: the process group (default: the world). Every rank of it must call this, in the same order
            as other sparse collectives on the group. On NCCL, one operation involving every rank must have
            run on the group before (e.g. an all-reduce), as torch's batched point-to-point operations need.
        spec: the chunk layout ``[(shape, dtype), ...]`` (or expert -> layout); default: derived from a local
            chunk (see module docstring).
        layer: a name for errors and logs.
        out: optional preallocated destination tensors per received expert (reused across
            re-materializations); missing experts are allocated.
        timeout_s: a rank that does not arrive makes the others raise TimeoutError after this long.

    Returns:
        A handle whose ``wait()`` returns ``{expert: [tensor, ...]}`` with bit-exact copies of every expert
        P' adds to this rank (and nothing else). Tensors allocated here are views into one buffer per expert
        (`ChunkLayout.empty`): they share a storage, and freeing one storage frees the expert's chunk.
    """
    topology, rank, local = _common(shard, placement, topology, group, SPAG)
    owners_E, receives_E, sends_E = local.owners_E, local.added_E, local.replicated_E
    missing = [e for e in sends_E if e not in chunks]
    if missing:
        raise ValueError(f"{SPAG} of layer {layer!r}: rank {rank} owns experts {missing} that P' replicates "
                         f"but `chunks` lacks them")
    not_owned = [e for e in chunks if not (0 <= int(e) < shard.num_experts) or owners_E[int(e)] != rank]
    if not_owned:
        raise ValueError(f"{SPAG} of layer {layer!r}: `chunks` holds experts {not_owned} that rank {rank} "
                         f"does not own in P")
    layouts = _resolve_layouts(spec, shard.num_experts, chunks, bool(receives_E), f"{SPAG} of layer {layer!r}")
    layout_known = layouts is not None
    if layouts is None:       # this rank neither sends nor receives: any layout gives it an empty plan
        layouts = ChunkLayout.from_spec([])
    for e in sends_E:
        _layout_of(layouts, e).check(chunks[e], f"{SPAG} of layer {layer!r}: chunk of expert {e}")
    plan = plan_sparse_all_gather(shard, placement, topology, layouts)
    handle = SpAGHandle(SPAG, layer, plan, rank, timeout_s, layout_known)

    # Step 1: destination tensors for every expert P' adds here (allocated now: zero-size ones are done).
    result: dict[int, list[torch.Tensor]] = {}
    device = _default_device(group, chunks)
    for e in receives_E:
        layout = _layout_of(layouts, e)
        if out is not None and e in out:
            dst = list(out[e])
            layout.check(dst, f"{SPAG} of layer {layer!r}: out[{e}]")
            if not all(t.is_contiguous() for t in dst):
                raise ValueError(f"{SPAG} of layer {layer!r}: out[{e}] tensors must be contiguous")
        else:
            dst = layout.empty(device)
        result[e] = dst
    schedule = _schedule(plan, layouts, rank)
    if not schedule.posts:
        handle._result = result
        handle._done.set()
        return handle
    src_bytes = {e: [_flat_bytes(t) for t in chunks[e]] for e in sends_E}
    dst_bytes = {e: [t.reshape(-1).view(torch.uint8) for t in ts] for e, ts in result.items()}

    def view(key: tuple[int, int]) -> torch.Tensor:
        e, i = key
        return src_bytes[e][i] if e in src_bytes else dst_bytes[e][i]

    def on_recv(run: _Run, buf: torch.Tensor) -> None:
        pos = 0
        for key, lo, hi in run:
            view(key)[lo:hi].copy_(buf[pos:pos + hi - lo])
            pos += hi - lo

    deadline = time.monotonic() + handle.timeout_s

    def body() -> dict[int, list[torch.Tensor]]:
        handle._run_stages(group, deadline, device, schedule, lambda stage, key: view(key), view, on_recv)
        return result

    _launch(handle, group, body, device)
    return handle


def _launch(handle: SparseCollectiveHandle, group: Any, body: Callable[[], Any], device: torch.device) -> None:
    """Run ``body`` (the rank's stages): on CPU tensors (gloo) on the group's background thread; on device
    tensors (NCCL) at once, batched and enqueued on the communicator's stream."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: rank %d starts %d stage(s), %d message(s) globally", handle._name(), handle.rank,
                     len(handle.plan.stages), handle.plan.num_messages())
    if device.type != "cpu":
        handle._nccl = True
        handle._run(body)                      # enqueued on the NCCL stream; the host does not block
    else:
        pg = group if group is not None else dist.group.WORLD
        _worker_for(pg).submit(lambda: handle._run(body))


# ============================================================================================ SpRS
class SpRSHandle(SparseCollectiveHandle):
    """Handle of `sparse_reduce_scatter`; ``wait()`` -> {owned expert: [summed gradient tensors]}."""


def sparse_reduce_scatter(grads: Mapping[int, Sequence[torch.Tensor]], placement: Placement, shard: Placement,
                          topology: Topology | None = None, group: Any = None, *, spec: ChunkSpec | None = None,
                          layer: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> SpRSHandle:
    """Start SpRS(P'=placement, P=shard) (§3.2): sum every expert's gradient into its owner.

    Args:
        grads: this rank's gradient tensors for every expert it holds in P' — the replicas ΔP on this rank
            and its own shard's experts (those with replicas at least). Not modified; must not be modified
            before ``wait()`` returns.
        placement, shard: P' ⊇ P and the shard placement P.
        topology, group, spec, layer, timeout_s: as in `sparse_all_gather` (the layout defaults to that of a
            local gradient).

    Returns:
        A handle whose ``wait()`` returns, for every expert this rank owns that appears in ``grads``, the
        sum of its gradient over all holders in P' **including the owner's own gradient** (for replicated
        experts new tensors, views into one buffer per expert as in `sparse_all_gather`; the given tensors
        themselves for experts without replicas). Non-owners get {}.
    """
    topology, rank, local = _common(shard, placement, topology, group, SPRS)
    owners_E, holds_E, owned_rep_E, replica_E = local.owners_E, local.holds_E, local.replicated_E, local.added_E
    missing = [e for e in (*owned_rep_E, *replica_E) if e not in grads]
    if missing:
        raise ValueError(f"{SPRS} of layer {layer!r}: rank {rank} holds experts {missing} in P' "
                         f"(replicated or replicas) but `grads` lacks them")
    extra = [e for e in grads if int(e) not in holds_E]
    if extra:
        raise ValueError(f"{SPRS} of layer {layer!r}: `grads` holds experts {extra} that rank {rank} does "
                         f"not hold in P'")
    layouts = _resolve_layouts(spec, shard.num_experts, grads, bool(owned_rep_E or replica_E),
                               f"{SPRS} of layer {layer!r}")
    layout_known = layouts is not None
    if layouts is None:       # this rank holds nothing: any layout gives it an empty plan
        layouts = ChunkLayout.from_spec([])
    for e in (*owned_rep_E, *replica_E):
        layout = _layout_of(layouts, e)
        layout.check(grads[e], f"{SPRS} of layer {layer!r}: gradient of expert {e}")
        if any(dt == torch.bool for dt in layout.dtypes):
            raise ValueError(f"{SPRS} of layer {layer!r}: cannot sum bool gradients of expert {e}")
    plan = plan_sparse_reduce_scatter(placement, shard, topology, layouts)
    handle = SpRSHandle(SPRS, layer, plan, rank, timeout_s, layout_known)

    # Owned experts without replicas are already complete.
    result: dict[int, list[torch.Tensor]] = {int(e): list(g) for e, g in grads.items()
                                              if owners_E[int(e)] == rank and int(e) not in owned_rep_E}
    schedule = _schedule(plan, layouts, rank)
    if not schedule.posts:
        for e in owned_rep_E:               # zero-size chunks: nothing to add
            result[e] = [g.clone() for g in grads[e]]
        handle._result = result
        handle._done.set()
        return handle

    # Step 1: accumulators: the owner's result (its own gradient, to which the others are added) and, on
    # a replica that combines a piece for its node, that piece of its own gradient (the rest of the
    # buffer is never read). They are flat (`ChunkLayout.empty`), so a partial sum spanning several
    # tensors leaves without a copy.
    # They are filled from the own gradient when the first contribution arrives (`fill`), not before
    # the first messages leave: off the path of the transfers.
    device = _default_device(group, grads)
    src_bytes = {e: [_flat_bytes(g) for g in grads[e]] for e in replica_E}
    pieces_E = {e: ranges for e, ranges in schedule.first_stage_ranges.items() if e not in owned_rep_E}
    acc = {e: _layout_of(layouts, e).empty(device) for e in (*owned_rep_E, *pieces_E)}
    acc_flat = {e: [a.reshape(-1) for a in ts] for e, ts in acc.items()}
    acc_bytes = {e: [a.view(torch.uint8) for a in ts] for e, ts in acc_flat.items()}
    unfilled = set(acc)

    def fill(e: int) -> None:
        unfilled.discard(e)
        if e in pieces_E:
            for i, lo, hi in pieces_E[e]:
                acc_bytes[e][i][lo:hi].copy_(src_bytes[e][i][lo:hi])
        else:
            for a, g in zip(acc[e], grads[e]):
                a.copy_(g.detach())

    def send_view(stage: int, key: tuple[int, int]) -> torch.Tensor:
        e, i = key
        last = stage == len(plan.stages) - 1          # the gather to the owners sends partial sums
        return acc_bytes[e][i] if last and e in acc else src_bytes[e][i]

    def on_recv(run: _Run, buf: torch.Tensor) -> None:
        pos = 0
        for (e, i), lo, hi in run:
            if e in unfilled:
                fill(e)
            dt = _layout_of(layouts, e).dtypes[i]
            acc_flat[e][i][lo // dt.itemsize:hi // dt.itemsize].add_(_typed(buf[pos:pos + hi - lo], dt))
            pos += hi - lo

    deadline = time.monotonic() + handle.timeout_s

    def body() -> dict[int, list[torch.Tensor]]:
        handle._run_stages(group, deadline, device, schedule, send_view, None, on_recv)
        for e in list(unfilled):             # an owner that received nothing for e (zero-size pieces)
            fill(e)
        for e in owned_rep_E:
            result[e] = acc[e]
        return result

    _launch(handle, group, body, device)
    return handle
