"""The message plan of SparseAllGather and SparseReduceScatter (§3.2, §3.3): pure, no communication.

``plan_sparse_all_gather(P, P', topology, layouts)`` says which bytes of which expert chunk move from
which device to which, in which stage; ``plan_sparse_reduce_scatter`` is its mirror image. Both are
functions of (P, P', topology, chunk layouts) only, computed identically on every rank and cached by
content; `rank_schedule` cuts one rank's part of a plan into messages and runs. `runtime/collectives.py`
executes them (threads, posting, handles).

Realization:

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
pieces are bucketed into one buffer, large ones travel alone, so that a run whose bytes lie back to back
in memory can be sent from or received into that memory without a copy (`ChunkLayout.empty` allocates
chunks that way).

Chunk layout. A chunk is an expert's list of parameter tensors (any dtype/shape mix, zero-size allowed),
e.g. SwiGLU ``[w1, w2, w3]``, described by a `ChunkLayout`.

Legend: E experts, D devices (ranks of the group), N nodes.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from themis_compile.cost_model.volume import SPAG, SPRS, CollectiveVolume
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

__all__ = [
    "DIRECT",
    "BoundedCache",
    "ChunkLayout",
    "ChunkSpec",
    "CommPlan",
    "RankSchedule",
    "Run",
    "Segment",
    "Transfer",
    "check_placements",
    "layout_of",
    "plan_sparse_all_gather",
    "plan_sparse_reduce_scatter",
    "rank_schedule",
    "require_placements",
]

ChunkSpec = Sequence[tuple[Sequence[int], torch.dtype]]


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
class Transfer(NamedTuple):
    """Bytes [start, stop) of expert ``expert``'s flat chunk move from device ``src`` to ``dst``;
    ``slice``: the pipeline slice it belongs to, `DIRECT` when no relay depends on it (see
    `plan_sparse_all_gather`). A named tuple: plans hold thousands of them at thousands of ranks, and
    tuples are built and sorted (by src, dst, expert, start) several times faster than dataclasses."""

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
    # Per rank, its part of the plan cut into messages and runs (`rank_schedule`); not part of the plan's value.
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


def require_placements(shard: Placement, placement: Placement) -> None:
    """ValueError unless both are `Placement` objects (checked before anything reads them)."""
    if not isinstance(shard, Placement) or not isinstance(placement, Placement):
        raise ValueError("shard and placement must be themis_compile.planner.Placement objects")


def check_placements(shard: Placement, placement: Placement, topology: Topology) -> None:
    require_placements(shard, placement)
    shard.require_shard_placement("the shard placement P")
    if shard.shape != placement.shape:
        raise ValueError(f"P and P' have different shapes {shard.shape} and {placement.shape}")
    if not shard.issubset(placement):
        raise ValueError("the ephemeral placement P' must contain the shard placement P (P ⊆ P')")
    topology.validate(shard.num_devices)


class BoundedCache:
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
_PLAN_CACHE = BoundedCache(_PLAN_CACHE_SIZE)


def _plan_key(collective: str, shard: Placement, placement: Placement, topology: Topology,
              layouts: ChunkLayout | Sequence[ChunkLayout]) -> tuple:
    # The cutting constants are part of the wire format (every rank must cut alike): part of the key. One
    # layout for all experts is keyed as itself (hashing E copies of it costs O(E) per call).
    layout_key = layouts if isinstance(layouts, ChunkLayout) else tuple(layouts)
    return (collective, shard.digest(), placement.digest(), topology.devices_per_node, layout_key,
            _SLICE_BYTES, _MAX_SLICES)


def plan_sparse_all_gather(shard: Placement, placement: Placement, topology: Topology,
                           layouts: ChunkLayout | Sequence[ChunkLayout]) -> CommPlan:
    """The two-stage, topology-aware message plan of SpAG(P=shard, P'=placement) (see module docstring).

    ``layouts`` is one `ChunkLayout` for all experts or one per expert. Pure and deterministic: every rank
    computes the same plan.
    """
    require_placements(shard, placement)
    E, D = shard.shape
    layout_E = [layouts] * E if isinstance(layouts, ChunkLayout) else list(layouts)
    if len(layout_E) != E:
        raise ValueError(f"need one chunk layout per expert ({E}), got {len(layout_E)}")
    key = _plan_key(SPAG, shard, placement, topology, layouts)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:                         # validated when it was planned
        return cached
    check_placements(shard, placement, topology)
    owners_E = shard.owners()
    node_ids = topology.node_ids
    delta_ED = placement.mask & ~shard.mask
    sent = [0.0] * D                                   # bytes each device sends so far (for balancing)
    stage0: list[Transfer] = []
    stage1: list[Transfer] = []
    # Largest total transfers first, so that later (smaller) ones even out the load they leave (only experts
    # with replicas move anything: the others are never visited).
    added_E = delta_ED.sum(axis=1)
    moving = np.flatnonzero(added_E).tolist()
    order_E = sorted(moving, key=lambda e: (-layout_E[e].nbytes * int(added_E[e]), e))
    for e in order_E:
        added = np.flatnonzero(delta_ED[e])
        psi = layout_E[e].nbytes
        if psi == 0:
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
    key = _plan_key(SPRS, shard, placement, topology, layouts)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:
        return cached
    stages = tuple(tuple(sorted(Transfer(t.dst, t.src, t.expert, t.start, t.stop, t.slice) for t in stage))
                   for stage in reversed(spag.stages))
    plan = CommPlan(SPRS, stages, spag.node_ids, spag.num_nodes)
    _PLAN_CACHE.put(key, plan)
    return plan


# ============================================================================================ one rank's part
Segment = tuple[Any, int, int]       # (where, lo, hi): bytes [lo, hi) of one tensor of a chunk
_ZERO_COPY_BYTES = 1 << 20           # segments at least this large travel as their own message
_BUCKET_BYTES = 64 << 10             # transfers smaller than this share a message with their neighbours


def _runs(per_transfer: list[list[Segment]]) -> list[list[Segment]]:
    """Cut one message (the segments of each of its transfers, in order) into runs, one buffer each.

    - A transfer of at least ``_BUCKET_BYTES`` forms its own runs, so that where its bytes lie back to back
      in memory (chunks allocated by `ChunkLayout.empty`) the run is that memory itself, with no copy;
      within it, a segment of at least ``_ZERO_COPY_BYTES`` travels alone (no copy even when the chunk's
      tensors are separate allocations).
    - Smaller transfers are bucketed with their neighbours: one message instead of many.

    Depends only on the transfer and segment sizes, which sender and receiver share, so both cut alike;
    each side then decides on its own whether a run needs a copy (`collectives._span`).
    """
    runs: list[list[Segment]] = []
    bucket: list[Segment] = []
    for segs in per_transfer:
        if sum(hi - lo for _, lo, hi in segs) < _BUCKET_BYTES:
            bucket += segs
            continue
        if bucket:
            runs.append(bucket)
            bucket = []
        part: list[Segment] = []
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


Run = tuple[Segment, ...]            # segments ((expert, tensor), lo, hi) that travel as one buffer


@dataclass(frozen=True)
class RankSchedule:
    """One rank's part of a plan, cut into runs once and cached with the plan (`rank_schedule`).

    Attributes:
        posts: per (stage, slice) this rank takes part in: its receives as ``(src, runs)`` and its sends
            as ``(dst, runs, crosses_nodes)``, in the order both sides post them.
        first_stage_ranges: per expert, the distinct byte ranges ``(tensor, lo, hi)`` this rank receives
            in stage 0 (in SpRS: the piece it combines for its node).
    """

    posts: dict[tuple[int, int], tuple[tuple[tuple[int, tuple[Run, ...]], ...],
                                       tuple[tuple[int, tuple[Run, ...], bool], ...]]]

    first_stage_ranges: dict[int, tuple[tuple[int, int, int], ...]]


def rank_schedule(plan: CommPlan, layouts: ChunkLayout | list[ChunkLayout], rank: int) -> RankSchedule:
    """``rank``'s `RankSchedule` of ``plan`` (whose chunk layouts are ``layouts``); cached on the plan."""
    key = (rank, _ZERO_COPY_BYTES, _BUCKET_BYTES)      # the cutting constants, as in the plan cache
    cached = plan._schedules.get(key)
    if cached is not None:
        return cached

    def runs(transfers: list[Transfer]) -> tuple[Run, ...]:
        return tuple(tuple(run) for run in _runs([
            [((t.expert, i), lo, hi) for i, lo, hi in layout_of(layouts, t.expert).segments(t.start, t.stop)]
            for t in transfers]))

    posts = {}
    for stage in range(len(plan.stages)):
        # This rank's transfers of the stage, in plan order, bucketed per (slice, (src, dst)) in one pass.
        by_slice: dict[int, dict[tuple[int, int], list[Transfer]]] = {}
        for t in plan.stages[stage]:
            if t.src == rank or t.dst == rank:
                by_slice.setdefault(t.slice, {}).setdefault((t.src, t.dst), []).append(t)
        for slice_ in (DIRECT, *range(plan.num_slices)):
            msgs = sorted(by_slice.get(slice_, {}).items())
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
    schedule = plan._schedules[key] = RankSchedule(posts, {e: tuple(r) for e, r in ranges.items()})
    return schedule


def layout_of(layouts: ChunkLayout | list[ChunkLayout], e: int) -> ChunkLayout:
    return layouts if isinstance(layouts, ChunkLayout) else layouts[e]
