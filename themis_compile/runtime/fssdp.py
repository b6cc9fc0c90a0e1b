"""The FSSDP executor: one MoE layer's per-iteration workflow (paper §3.1, Fig. 5; §4.2-§4.4).

Forward of layer l, iteration i:
  1. plan   P'_l = Alg1(P_l, predicted load F_l, t, m)            (same on every rank: integer inputs)
  2. start  SpAG(P_l, P'_l)                                        (``start_materialization``; a scheduling
                                                                     pass may call it before attention l)
  3. router -> top-k -> local counts T[:, rank], all-reduced into per-expert totals (the same on every
     rank; O(E) per rank — the whole T[e, d] is all-gathered only under ``ThemisConfig.full_stats``)
  4. (calibration) re-plan on the actual loads with the remaining budget; gather the extra replicas
  5. wait SpAG; this rank's row R[:, rank, :] = Alg3(P'_l, T[:, rank]) as entries (it needs only the rank's
     own counts): every pair gets a destination holding its expert; each holder learns what every source
     sends it from the sources (the held experts' counts only, `exchange.exchange_held_counts`)
  6. permute -> all-to-all -> experts (owned + materialized) -> all-to-all -> combine
  7. record the actual loads for the predictor and the load statistics (`StatsLog`, bounded in bytes)
Backward of layer l:
  8. gradients of every copy land in per-iteration leaf tensors; once all are computed, start
     SpRS(P'_l, P_l), which sums each expert's copies into its owner
  9. at the end of the backward pass wait for every SpRS and accumulate into the owned parameters' .grad
     (scaled by 1/world size, like EP, once on the owner after the sum; dense parameters are averaged by DDP)
Frozen expert tensors (``requires_grad=False`` on the owner, agreed by every rank through the count
all-reduce of step 3) get no gradient: their copies are no autograd leaves, the SpRS carries only
trainable tensors, and an expert frozen whole has no replica in it (P restricted to it).
Experts without tokens: where the user's experts module runs only the experts that receive tokens
(``skips_empty_experts``, found by detection), an expert whose global count is 0 gets no gradient
from that forward, as in one process (where AdamW then skips it: no momentum step, no weight decay): it
is reduced like an expert frozen whole for that forward, so its ``.grad`` stays None unless another
forward before the optimizer step routed a token to it.
Re-materialization (themis-rm): replicas' storage is released after step 6 and gathered again (same P')
just before the layer's backward, prefetched when the next layer's backward finishes (§3.1).

Activation checkpointing (torch's non-reentrant ``checkpoint`` around a block, ``apply_activation_checkpointing``,
HF ``gradient_checkpointing_enable()``): the recomputation inside backward replays the forward it pairs with
(``_replay``): the same realized P', own counts and dispatch row, the same held tensors (re-gathered first under
re-materialization); no planning, no count all-gather, no predictor or statistics update, no second SpRS. Only
the token all-to-alls run again, on every rank, because every rank recomputes the same blocks in the same order.

Invariants: owned parameters are only read in forward and only written by the optimizer; replicas carry
no optimizer state; a misprediction costs speed, never correctness (every pair is served by a holder).

Shape suffixes: T tokens, K top-k, H d_model, E experts, D devices (ranks).
"""

from __future__ import annotations

import logging
import math
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.profiler import record_function

from themis_compile.cost_model.volume import SPAG, SPRS
from themis_compile.planner import (
    LoadPredictor,
    Placement,
    PlanCost,
    Topology,
    calibrate,
    dispatch_device_load,
    materialize_pairs,
    own_row_entries,
    replicas_pay,
)
from themis_compile.planner.placement import merge_sorted
from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import sparse_all_gather, sparse_reduce_scatter
from themis_compile.runtime.comm_plan import ChunkLayout, rank_plan
from themis_compile.runtime.ep import ShardedExperts, uniform_ids
from themis_compile.runtime.exchange import dispatch_compute_combine, exchange_held_counts
from themis_compile.runtime.experts import ExpertBank

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LayerStats:
    """Load statistics of one layer in one iteration (what logging, the demo and the benchmarks read).

    Bounded in bytes by default: O(E + D + |ΔP|) per record, as numpy arrays (a summary). The full
    matrices ``tokens_per_device_expert`` [D][E] exist only under ``ThemisConfig.full_stats`` (which
    also makes every rank all-gather the whole count table, O(E·D) per layer and step); without it
    they are None. ``placement`` (P' as [E][D] lists) is rebuilt on demand from the owners and ΔP.
    """

    iteration: int
    layer: str
    tokens_per_expert: np.ndarray               # [E] int64 global tokens per expert
    device_load: np.ndarray                     # [D] int64 rows each rank computed under the realized plan
    delta_p: int                                # |ΔP| = replicas added this iteration
    owners_E: np.ndarray                        # [E] int64 shard owners (read-only, shared until re-sharding)
    added_X: np.ndarray                         # [X] int64 ΔP as ascending flat ids e·D + d
    imbalance: float                            # max / mean rows computed per device (1.0 = balanced)
    calibrated: bool = False
    tokens_per_device_expert: list[list[int]] | None = None   # [D][E], only under ThemisConfig.full_stats

    @property
    def placement(self) -> list[list[bool]]:
        """The realized P' as [E][D] booleans (built on every call: O(E·D))."""
        return _placement_of(Placement.from_owners(self.owners_E, self.device_load.size), self.added_X).mask.tolist()

    def held_on(self, rank: int) -> int:
        """How many experts ``rank`` held in P' (owned and replicas)."""
        D = self.device_load.size
        return int(np.count_nonzero(self.owners_E == rank) + np.count_nonzero(self.added_X % D == rank))

    @property
    def nbytes(self) -> int:
        """Bytes this record holds of its own (the shared owners array is not counted)."""
        full = 0 if self.tokens_per_device_expert is None else \
            sys.getsizeof(self.tokens_per_device_expert) + sum(sys.getsizeof(r) + 8 * len(r)
                                                               for r in self.tokens_per_device_expert)
        return _RECORD_OVERHEAD + self.tokens_per_expert.nbytes + self.device_load.nbytes + self.added_X.nbytes + full


# What a LayerStats costs besides its arrays (the object, its dict, three array headers), roughly.
_RECORD_OVERHEAD = 1024


class StatsLog:
    """The newest ``LayerStats`` of a model, oldest first, bounded in records and in bytes.

    A deque that drops its oldest records once more than ``max_records`` are kept or their
    ``nbytes`` exceed ``max_bytes``: at thousands of ranks a record of E per-expert totals is tens of
    KB, so a record count alone would let the log grow to GBs. Iterable, sized and indexable like the
    deque it replaces.
    """

    def __init__(self, max_records: int = 10000, max_bytes: int = 16 << 20) -> None:
        self.max_records, self.max_bytes = int(max_records), int(max_bytes)
        self._records: deque[LayerStats] = deque()
        self.nbytes = 0

    def append(self, record: LayerStats) -> None:
        self._records.append(record)
        self.nbytes += record.nbytes
        while len(self._records) > 1 and (len(self._records) > self.max_records or self.nbytes > self.max_bytes):
            self.nbytes -= self._records.popleft().nbytes

    def clear(self) -> None:
        self._records.clear()
        self.nbytes = 0

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> LayerStats:
        return self._records[i]

    def __bool__(self) -> bool:
        return bool(self._records)


class CountExchange:
    """The two count exchanges of one FSSDP layer step, as collectives on the layer's group.

    ``layer_counts`` (step 3) sums every rank's counts and flags (`FSSDPExperts._global_tokens`), or
    gathers every rank's row under ``full_stats``; ``receive_counts`` (step 6) tells every holder how many
    rows of each expert it holds each source sends (`exchange.exchange_held_counts`). A benchmark that
    runs one rank of N on a fake process group (whose collectives carry no data) replaces this object on
    `FSSDPState` to feed the planner the counts a real job would see (`bench/scale.py`).
    """

    def layer_counts(self, layer: "FSSDPExperts", local_C: torch.Tensor) -> torch.Tensor:
        """``local_C`` [2E + 2] int64 -> the sum over the ranks [2E + 2], or [D, 2E + 2] under full_stats."""
        if not layer.state.full_stats:
            deadline.all_reduce(local_C, group=layer.group, timeout_s=layer.timeout_s,
                                purpose="tokens per expert and router flags", layer=layer.layer)
            return local_C
        parts = [torch.empty_like(local_C) for _ in range(layer.world_size)]
        deadline.all_gather(parts, local_C, group=layer.group, timeout_s=layer.timeout_s,
                            purpose="tokens per expert and router flags", layer=layer.layer)
        return torch.stack(parts)

    def receive_counts(self, layer: "FSSDPExperts", send_P: torch.Tensor, send_splits_W: list[int],
                       held_H: np.ndarray) -> torch.Tensor:
        """[S, H] rows of each expert of ``held_H`` that every source sends this rank."""
        return exchange_held_counts(send_P, send_splits_W, int(held_H.size), layer.group, layer.world_size,
                                    layer=layer.layer, timeout_s=layer.timeout_s)


@dataclass
class FSSDPState:
    """State shared by all FSSDP layers of one model on one rank."""

    rank: int
    world_size: int
    group: Any                    # the model's group (all-to-all, counts)
    comm_group: Any               # a dedicated group for the sparse collectives
    topology: Topology
    rematerialize: bool
    calibrate: bool
    timeout_s: float
    check_plans: bool
    cost_benefit: bool = True     # replicas only where they pay (planner.cost.replicas_pay)
    budget_controller: Any = None         # applies profiled t, m (runtime/budgets.py)
    layers: list = field(default_factory=list)   # every FSSDP layer of the model (set by optimize)
    layer_order: list["FSSDPExperts"] = field(default_factory=list)
    pending: list[tuple["FSSDPExperts", Any]] = field(default_factory=list)
    callback_queued: bool = False
    fired_hooks: list = field(default_factory=list)   # gradient hooks that fired in this backward (removed at its end)
    stats: StatsLog = field(default_factory=StatsLog)
    # ThemisConfig.full_stats: all-gather the whole count table T[e, d] every layer step and keep it in
    # the statistics (O(E·D) per rank); otherwise per-expert totals are all-reduced (O(E)).
    full_stats: bool = False
    counts: CountExchange = field(default_factory=CountExchange)   # the count exchanges of steps 3 and 6

    def configure_stats(self, full_stats: bool, max_bytes: int) -> None:
        """Adopt ``ThemisConfig.full_stats`` and ``stats_max_bytes`` (the records kept so far stay)."""
        self.full_stats = bool(full_stats)
        self.stats.max_bytes = int(max_bytes)

    def queue_finish(self) -> None:
        """Make sure ``finish_backward`` runs once at the end of the current backward pass."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        self.callback_queued = False
        pending, self.pending = self.pending, []
        fired, self.fired_hooks = self.fired_hooks, []
        for hook in fired:
            hook.remove()
        for layer, handle in pending:
            layer.accumulate_reduced(handle)


_MAX_PENDING_FORWARDS = 64


@dataclass(frozen=True, eq=False)
class _Holdings:
    """P' of one layer step as pairs, what the rank's own planning reads instead of the [E, D] mask.

    ``added_X``: ΔP = P' \\ P as ascending flat ids e·D + d; ``keys_P``: every (expert, holder) pair of
    P' as ascending keys holder·E + expert, ``expert_P`` / ``holder_P`` the same pairs split; ``splits_W``:
    pairs per holder; ``held_H``: the experts this rank holds, ascending. O(E + |ΔP|) to build and to keep.
    """

    added_X: np.ndarray
    keys_P: np.ndarray
    expert_P: np.ndarray
    holder_P: np.ndarray
    splits_W: list[int]
    held_H: np.ndarray

    @classmethod
    def of(cls, owners_E: np.ndarray, added_X: np.ndarray, num_devices: int, rank: int,
           shard_K: np.ndarray | None = None, owned_D: np.ndarray | None = None) -> "_Holdings":
        """``shard_K``: the shard's pairs as ascending keys holder·E + expert (`owner_keys`), and
        ``owned_D``: the experts each device owns, when known (both kept until re-sharding)."""
        E, D = owners_E.size, num_devices
        if shard_K is None:
            shard_K = owner_keys(owners_E)
        if owned_D is None:
            owned_D = np.bincount(owners_E, minlength=D)
        # ΔP by holder, then expert: a stable sort by holder of its expert-major ids (ΔP is small), merged
        # into the shard's keys; the holders follow from the counts per holder (no division of the keys).
        expert_X, holder_X = np.divmod(added_X, D)
        added_K = (holder_X * E + expert_X)[np.argsort(holder_X, kind="stable")]
        keys_P = merge_sorted(shard_K, added_K)
        count_D = owned_D + np.bincount(holder_X, minlength=D)
        holder_P = np.repeat(np.arange(D, dtype=np.int64), count_D)
        expert_P = keys_P - holder_P * E
        lo, hi = np.searchsorted(keys_P, [rank * E, (rank + 1) * E])
        return cls(added_X, keys_P, expert_P, holder_P, count_D.tolist(), expert_P[lo:hi])

    def device_load(self, load_E: np.ndarray, copies_E: np.ndarray) -> np.ndarray:
        """[D] int64 rows every device computes when each expert's tokens split evenly over its holders
        (Alg. 3 without the whole T; exact for experts with one holder); ``copies_E``: P''s holder counts."""
        share_P = (load_E / copies_E)[self.expert_P]
        return np.rint(np.bincount(self.holder_P, weights=share_P, minlength=len(self.splits_W))).astype(np.int64)


@dataclass(frozen=True, eq=False)
class _OwnRow:
    """This rank's row R[:, rank, :] of Alg. 3 as entries (`planner.own_row_entries`): expert e's pairs go
    to ``dest_Y[start_E[e]:start_E[e + 1]]`` (ascending) in the counts ``count_Y``. O(E + |ΔP|)."""

    start_E: np.ndarray
    dest_Y: np.ndarray
    count_Y: np.ndarray

    def counts_of(self, keys_P: np.ndarray, num_experts: int) -> np.ndarray:
        """[P] the rank's pairs for each pair of P', given as ascending keys holder·E + expert (0 where the
        row sends none). Every entry goes to a holder, so its key is among them: the row's entries (few:
        at most the rank's own pairs) are looked up in the pairs, O(Y log P + P)."""
        send_P = np.zeros(keys_P.size, dtype=np.int64)
        if self.count_Y.size:
            expert_Y = np.searchsorted(self.start_E, np.arange(self.count_Y.size), side="right") - 1
            send_P[np.searchsorted(keys_P, self.dest_Y * num_experts + expert_Y)] = self.count_Y
        return send_P

    def destinations(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """[T, K] destination of every pair: of expert e's pairs, in flattened pair order, the first
        ``count_Y[start_E[e]]`` go to ``dest_Y[start_E[e]]``, the next to the next entry, and so on (what
        `kernels.assign_destinations` makes of the dense row, without the [E, D] row)."""
        flat_N = ids_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)          # pairs by expert, then pair index
        # Entries are ordered by expert, and expert e's counts sum to its pairs: the q-th pair in that
        # order falls in the entry whose running total first exceeds q.
        ends_Y = torch.from_numpy(np.cumsum(self.count_Y)).to(ids_TK.device)
        entry_N = torch.searchsorted(ends_Y, torch.arange(flat_N.numel(), device=ids_TK.device), right=True)
        dest_N = torch.empty_like(flat_N)
        dest_N[order_N] = torch.from_numpy(self.dest_Y).to(ids_TK.device)[entry_N]
        return dest_N.view_as(ids_TK)


def owner_keys(owners_E: np.ndarray) -> np.ndarray:
    """A shard placement's pairs as ascending keys owner·E + expert (what `_Holdings` merges ΔP into)."""
    keys_E = owners_E * owners_E.size + np.arange(owners_E.size, dtype=np.int64)
    keys_E.sort()
    return keys_E


def _added_pairs(owners_E: np.ndarray, full_J: np.ndarray, replicas_X: np.ndarray, num_devices: int) -> np.ndarray:
    """ΔP as ascending flat ids e·D + d, from Alg. 1's sparse form (`materialize_pairs`): the experts
    every device holds (less their owners) and the other replicas."""
    if not full_J.size:
        return replicas_X
    D = num_devices
    full_JD = full_J[:, None] * D + np.arange(D, dtype=np.int64)
    full_X = full_JD[np.arange(D) != owners_E[full_J][:, None]]
    return np.sort(np.concatenate([full_X, replicas_X]))


def _placement_of(shard: Placement, added_X: np.ndarray) -> Placement:
    """P' = shard ∪ ΔP as the Placement the sparse collectives take; it remembers ΔP, so that the plans'
    ``added_over(shard)`` and ``issubset`` checks cost nothing."""
    return shard.extended(added_X)


@dataclass(frozen=True, eq=False)
class _Trainable:
    """Per expert, the indices of its trainable chunk tensors: all ``n`` but for the experts in
    ``partial`` (some frozen, or none where the experts module skips experts without tokens). Built in
    O(E) numpy and O(experts with frozen tensors) Python: the common case, nothing frozen, is one list."""

    full: list[int]
    partial: dict[int, list[int]]

    @classmethod
    def of(cls, frozen_E: list[int], empty_E: np.ndarray | None, n: int) -> "_Trainable":
        frozen = np.asarray(frozen_E, dtype=np.int64)
        special = np.flatnonzero(frozen != 0 if empty_E is None else (frozen != 0) | empty_E).tolist()
        partial = {e: [] if empty_E is not None and empty_E[e] else
                   [i for i in range(n) if not frozen_E[e] >> i & 1] for e in special}
        return cls(list(range(n)), {e: t for e, t in partial.items() if len(t) < n})

    def __getitem__(self, e: int) -> list[int]:
        return self.partial.get(e, self.full)


@dataclass(eq=False)
class _TrainableReduction:
    """A started SpRS of the trainable tensors only; ``wait()`` -> {owned expert: [gradient or None]} with
    one entry per chunk tensor, None where the tensor is frozen."""

    handle: Any
    trainable_E: _Trainable          # per expert: indices of its trainable chunk tensors
    owned: list[int]
    num_tensors: int

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def wait(self) -> dict[int, list[torch.Tensor | None]]:
        reduced = self.handle.wait()
        out = {}
        for e in self.owned:
            grads: list[torch.Tensor | None] = [None] * self.num_tensors
            for i, g in zip(self.trainable_E[e], reduced[e] if self.trainable_E[e] else ()):
                grads[i] = g
            out[e] = grads
        return out


@dataclass(eq=False)
class _Released:
    """Replicas of one forward whose storage was released (re-materialization), and their re-gather."""

    leaves: dict[int, list[torch.Tensor]]
    nbytes: dict[int, list[int]]
    placement: Placement
    handle: Any = None


# ---------------------------------------------------------------------- activation checkpointing
@dataclass(frozen=True)
class _CheckpointContext:
    """Where torch's non-reentrant activation checkpoint stands on this thread.

    ``mode`` is "forward" inside a checkpointed forward, "recompute" inside its recomputation (during
    backward), None elsewhere. ``frame`` is the checkpoint call's ``_CheckpointFrame``: the forward and
    its recomputation share it, so it pairs them exactly, whatever the number of forwards before one
    backward. ``hook`` is the saved-tensor pack hook, new for every recomputation of a frame.
    """

    mode: str | None = None
    frame: Any = None
    hook: Any = None


_NO_CHECKPOINT = _CheckpointContext()
_CHECKPOINT_FRAME = getattr(torch_checkpoint, "_CheckpointFrame", None)


def _closure_frame(fn: Any, depth: int = 3) -> Any:
    """The ``_CheckpointFrame`` a checkpoint hook closes over (directly or through a weak reference,
    possibly behind wrappers such as dynamo's disable), or None."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:      # an empty cell
            continue
        if isinstance(value, weakref.ref):
            value = value()
        if _CHECKPOINT_FRAME is not None and isinstance(value, _CHECKPOINT_FRAME):
            return value
        if depth and callable(value):
            found = _closure_frame(value, depth - 1)
            if found is not None:
                return found
    return None


def _checkpoint_context() -> _CheckpointContext:
    """Tell a checkpointed forward, its recomputation and a plain forward apart.

    torch's non-reentrant checkpoint installs saved-tensor hooks for the forward (``_checkpoint_hook``)
    and others for the recomputation (``_recomputation_hook``); the innermost pair on this thread says
    which one runs. (torch.utils.checkpoint internals, stable since torch 2.1.)
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if not hooks:
        return _NO_CHECKPOINT
    pack = hooks[0]
    inner = pack
    while hasattr(inner, "__wrapped__"):      # a decorated hook (e.g. dynamo's disable) keeps its original
        inner = inner.__wrapped__
    name = getattr(inner, "__qualname__", "")
    if name.startswith("_checkpoint_hook."):
        mode = "forward"
    elif name.startswith("_recomputation_hook."):
        mode = "recompute"
    else:
        return _NO_CHECKPOINT
    return _CheckpointContext(mode, _closure_frame(pack), pack)


def _in_reentrant_checkpoint() -> bool:
    """True inside the forward of ``torch.utils.checkpoint(..., use_reentrant=True)``."""
    code = torch_checkpoint.CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@dataclass(eq=False)
class _ForwardRecord:
    """What one forward of a layer decided, for its recomputation under activation checkpointing.

    The recomputation must save tensors of exactly the forward's shapes, so it reuses the realized P'
    (after calibration), this rank's counts T[:, rank], its dispatch rows R[:, rank, :] and the very tensors
    the experts ran with (owned aliases and replicas: the leaves the SpRS hook watches).
    """

    placement: Placement
    local_E: np.ndarray                      # this rank's tokens per expert, T[:, rank]
    row: _OwnRow                             # this rank's row of Alg. 3
    recv_counts_SE: torch.Tensor             # [S, H] rows of each held expert every source sends
    recv_experts_H: list[int]                # the experts this rank holds in P'
    held: dict[int, list[torch.Tensor]]
    released: _Released | None = None       # themis-rm: the replicas' storage to gather again first


@dataclass(eq=False)
class _FrameRecords:
    """The forwards of one layer inside one checkpoint frame, in order, and how far each recomputation
    (keyed by its pack hook) has replayed them."""

    records: list[_ForwardRecord] = field(default_factory=list)
    replayed: dict[Any, int] = field(default_factory=dict)


class FSSDPExperts(ShardedExperts):
    """Sharded experts of one layer under FSSDP: ephemeral load-balancing replicas every iteration."""

    def __init__(self, bank: ExpertBank, experts: nn.Module, shard: Placement, *, state: FSSDPState,
                 layer_index: int, overlap_degree: int, materialization_budget: int,
                 cost: PlanCost, predictor_window: int = 5, layer: str = "",
                 skips_empty_experts: bool = False) -> None:
        super().__init__(bank, experts, shard, rank=state.rank, world_size=state.world_size, group=state.group,
                         layer=layer, scale_grads=False, timeout_s=state.timeout_s,
                         skips_empty_experts=skips_empty_experts)
        self.state = state
        self.layer_index = layer_index
        self.overlap_degree = int(overlap_degree)
        self.materialization_budget = int(materialization_budget)
        self.cost = cost
        self.predictor = LoadPredictor(1, self.num_experts, window=predictor_window)
        self.iteration = 0
        # Host time of this layer's planning in its latest iteration, ns: Alg. 1 and the SpAG / SpRS message
        # plans (step 1), calibration and the rank's row of Alg. 3 (4-5) and the statistics (7); starting and
        # waiting for collectives and running the experts are not in it.
        self.plan_ns = 0
        self.comm_plan_ns = 0     # the part of plan_ns spent on the SpAG / SpRS message plans
        self._planned: Placement | None = None
        self._owner_keys: tuple[Placement, np.ndarray, np.ndarray] | None = None
        self._planned_added = np.zeros(0, dtype=np.int64)        # ΔP of _planned, flat ids
        self._spag = None
        self._replicas: dict[int, list[torch.Tensor]] | None = None
        self._released: list[_Released] = []
        # Checkpoint frame -> the forwards its recomputation replays; an entry lives as long as the frame
        # (that is, as long as the autograd graph that may still recompute it).
        self._checkpointed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if len(bank.spec) > 62:
            raise ValueError(f"MoE layer {layer!r}: an expert of {len(bank.spec)} tensors; at most 62 are supported "
                             "(their frozen flags travel as the bits of one int64)")
        # Per expert, bit i set: chunk tensor i is frozen on the owner (agreed by the last count all-gather).
        self._frozen_E = [0] * self.num_experts

    def _shard_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """`owner_keys` of the current shard placement and the experts each device owns, kept until the
        shard placement changes (re-sharding)."""
        shard = self.shard_placement
        if self._owner_keys is None or self._owner_keys[0] is not shard:
            owners_E = shard.owners()
            self._owner_keys = (shard, owner_keys(owners_E), np.bincount(owners_E, minlength=self.world_size))
        return self._owner_keys[1], self._owner_keys[2]

    def set_shard_placement(self, shard: Placement) -> None:
        super().set_shard_placement(shard)
        self._planned, self._spag, self._replicas = None, None, None

    # ------------------------------------------------------------------ materialization (steps 1-2)
    def start_materialization(self) -> None:
        """Plan P' for this iteration and start SpAG; idempotent until the layer's forward consumed it.
        A no-op inside an activation-checkpoint recomputation (it replays the forward's plan)."""
        if self._spag is not None or _checkpoint_context().mode == "recompute":
            return
        if self.layer_index == 0 and self.state.budget_controller is not None:
            # Iteration start on every rank: adopt a finished cost-model profile (collective).
            self.state.budget_controller.maybe_update()
        start_ns = time.perf_counter_ns()
        with record_function("themis::plan"):
            load_E = self.predictor.predict(0)
            shard = self.shard_placement
            full_J, replicas_X = materialize_pairs(shard, load_E, self.overlap_degree,
                                                   self.materialization_budget, self.state.topology)
            added_X = _added_pairs(shard.owners(), full_J, replicas_X, self.world_size)
            if self.state.cost_benefit and not replicas_pay(load_E, shard.owners(), added_X, self.cost):
                full_J, added_X = full_J[:0], added_X[:0]       # replicas that cannot pay: none this step
            planned = _placement_of(shard, added_X)
        self._planned, self._planned_added = planned, added_X
        spag_ns = time.perf_counter_ns()
        self._plan_collectives(planned)
        end_ns = time.perf_counter_ns()
        self.plan_ns, self.comm_plan_ns = end_ns - start_ns, end_ns - spag_ns
        with record_function("themis::spag"):
            self._spag = self._gather(planned)

    def _plan_collectives(self, placement: Placement) -> None:
        """The message plans of this layer step's SpAG and SpRS, and this rank's part of each, computed
        here (the collectives find them in their plan cache) so that `plan_ns` holds them apart from
        starting the collectives. The SpRS plan is the one of trainable experts' full chunks, the common
        case; a layer with frozen tensors plans its own when it reduces."""
        if placement is self.shard_placement:
            return
        layout = ChunkLayout.from_spec(self.bank.spec)
        for collective in (SPAG, SPRS):
            rank_plan(collective, self.shard_placement, placement, self.state.topology, layout, self.rank)

    def _gather(self, placement: Placement, out=None):
        chunks = {e: [p.detach() for p in c] for e, c in self.local_chunks().items()}
        return sparse_all_gather(chunks, self.shard_placement, placement, self.state.topology,
                                 self.state.comm_group, spec=self.bank.spec, layer=self.layer, out=out,
                                 timeout_s=self.state.timeout_s)

    def wait_materialization(self) -> dict[int, list[torch.Tensor]]:
        """Wait for this iteration's SpAG; idempotent until the layer's forward consumed the replicas."""
        if self._spag is None:
            self.start_materialization()
        if self._replicas is None:
            with record_function("themis::spag_wait"):
                self._replicas = self._spag.wait()
        return self._replicas

    def _consume_materialization(self) -> dict[int, list[torch.Tensor]]:
        replicas = self.wait_materialization()
        self._spag, self._replicas = None, None
        return replicas

    # ------------------------------------------------------------------ global token counts (step 3)
    def _global_tokens(self, ids_TK: torch.Tensor,
                       weights_TK: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Step 3: ``(local_E, load_E, tokens_ED)``, this rank's tokens per expert, their sum over the
        ranks (the same on every rank) and, under ``full_stats``, the whole table T[e, d] (else None).

        One collective carries the counts, the router flags and the owners' frozen bits, so that every rank
        raises together when any router produced non-finite weights or an expert id out of range (no rank
        is left waiting in a collective): an all-reduce of [2E + 2] int64 by default, O(E) per rank
        whatever the world size; an all-gather of [D, 2E + 2] under ``full_stats``.
        """
        E = self.num_experts
        local = torch.zeros(2 * E + 2, dtype=torch.int64)
        bad_ids = self._routing_error(ids_TK)
        if not bad_ids:
            local[:E].scatter_add_(0, ids_TK.reshape(-1).cpu(), torch.ones(ids_TK.numel(), dtype=torch.int64))
        local[E] = int(not bool(torch.isfinite(weights_TK).all()))
        local[E + 1] = int(bad_ids)
        for e, params in self.local_chunks().items():     # the owner's frozen tensors, for every rank
            local[E + 2 + e] = sum(1 << i for i, p in enumerate(params) if not p.requires_grad)
        local_E = local[:E].numpy().copy()
        flags_2 = local[E:E + 2].clone()          # the exchange may sum into ``local`` in place
        if self.world_size == 1:
            exchanged = local[None] if self.state.full_stats else local
        else:   # (on the group's device: NCCL needs CUDA tensors)
            exchanged = self.state.counts.layer_counts(self, local.to(ids_TK.device)).cpu()
        summed = exchanged.sum(0) if exchanged.dim() == 2 else exchanged
        if summed[E] or summed[E + 1]:
            self._raise_router_error(exchanged, flags_2, int(summed[E]) > 0)
        self._frozen_E = summed[E + 2:].tolist()           # only the owner's entry is non-zero
        tokens_ED = exchanged[:, :E].t().numpy().copy() if exchanged.dim() == 2 else None   # [E, D]
        return local_E, summed[:E].numpy().copy(), tokens_ED

    def _raise_router_error(self, exchanged: torch.Tensor, flags_2: torch.Tensor, non_finite: bool) -> None:
        """Raise on every rank, naming the ranks whose router failed (the sum says only that some did; an
        all-gather of the two flags, on this failure path only, says which)."""
        E = self.num_experts
        if exchanged.dim() == 2:
            flags_D2 = exchanged[:, E:E + 2]
        elif self.world_size > 1 and type(self.state.counts) is CountExchange:
            flags_D2 = torch.tensor(deadline.all_gather_object(
                flags_2.tolist(), group=self.group, timeout_s=self.timeout_s, purpose="router flags",
                layer=self.layer))
        else:
            flags_D2 = flags_2[None]
        if non_finite:
            bad = torch.nonzero(flags_D2[:, 0]).flatten().tolist()
            raise FloatingPointError(f"MoE layer {self.layer!r}: non-finite router output on ranks {bad} "
                                     f"(iteration {self.iteration})")
        bad = torch.nonzero(flags_D2[:, 1]).flatten().tolist()
        raise ValueError(f"MoE layer {self.layer!r}: router chose an expert id outside [0, {E}) on ranks "
                         f"{bad} (iteration {self.iteration})")

    # ------------------------------------------------------------------ forward (steps 3-7)
    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if self.uniform_routing:
            # The "uniform" policy: the force-balanced reference, every expert the same number of pairs.
            ids_TK = uniform_ids(ids_TK, self.num_experts)
        ckpt = _checkpoint_context()
        if ckpt.mode == "recompute":
            return self._replay(ckpt, x_TH, ids_TK, weights_TK)
        self._check_forward_context(ckpt)
        # (Expert ids are checked inside the all-gather of the counts: one collective, every rank fails.)
        if self.layer_index == 0 or not self.state.layer_order:
            self.state.layer_order.clear()
            if self.state.callback_queued and torch._C._current_graph_task_id() == -1:
                # The last backward raised before its end: its reductions never reached the owners.
                logger.warning("themis_compile: a backward pass did not complete; dropping its %d pending "
                               "gradient reductions", len(self.state.pending))
                for _, handle in self.state.pending:
                    handle.wait()
                self.state.pending, self.state.callback_queued = [], False
                for layer in self.state.layers:
                    layer.drop_released()
        self.state.layer_order.append(self)
        self.start_materialization()
        # Detached: the finiteness check must not record autograd ops (a checkpoint would save them).
        with record_function("themis::token_counts"):
            local_E, load_E, tokens_ED = self._global_tokens(ids_TK, weights_TK.detach())
        replicas = self._consume_materialization()
        placement, added_X = self._planned, self._planned_added
        calibrated = False
        start_ns = time.perf_counter_ns()
        if self.state.calibrate:
            with record_function("themis::calibrate"):
                # The compute model is Alg. 3 on T under full_stats, else the fluid model (every source with
                # an equal share of each expert's tokens, split over its holders), from the pairs: no [E, D].
                merged = calibrate(self.shard_placement, placement, load_E, self.overlap_degree,
                                   self.materialization_budget, self.state.topology, self.cost, tokens_ED)
            if merged != placement:
                placement, calibrated = merged, True
                added_X = merged.added_over(self.shard_placement)
                self._plan_collectives(merged)
                self.plan_ns += time.perf_counter_ns() - start_ns
                # Gather exactly the pairs calibration adds: SpAG(P, P ∪ (P'' \ P')).
                extra = self.shard_placement.extended(merged.added_over(self._planned))
                with record_function("themis::spag_calibration"):
                    replicas.update(self._gather(extra).wait())
                start_ns = time.perf_counter_ns()
        if self.state.check_plans:
            self._check_plan_digest(placement)
        with record_function("themis::dispatch_plan"):
            holdings = _Holdings.of(self.shard_placement.owners(), added_X, self.world_size, self.rank,
                                    *self._shard_keys())
            row = self._dispatch_plan(added_X, placement.copy_counts(), local_E)
            send_P = row.counts_of(holdings.keys_P, self.num_experts)
        self.plan_ns += time.perf_counter_ns() - start_ns
        recv_counts_SE = self.state.counts.receive_counts(self, torch.from_numpy(send_P).to(ids_TK.device),
                                                          holdings.splits_W, holdings.held_H).cpu()
        held_H = holdings.held_H.tolist()
        dest_TK = row.destinations(ids_TK)

        owned = self.local_chunks()
        # Decided the same way on every rank: a rank holding only replicas (it may own no expert of this
        # layer after re-sharding) must still take part in the SpRS.
        track = torch.is_grad_enabled()
        if track:
            held = {e: [p.detach().requires_grad_(p.requires_grad) for p in c] for e, c in owned.items()}
            for e, c in replicas.items():
                held[e] = [t.requires_grad_(not self._frozen_E[e] >> i & 1) for i, t in enumerate(c)]
            self._register_reduction(held, placement, load_E)
        else:
            held = {**owned, **replicas}
        out_TH = dispatch_compute_combine(
            x_TH, ids_TK, weights_TK, dest_TK, self.num_experts,
            lambda rows, counts: self.run_experts(held, rows, counts),
            group=self.group, world_size=self.world_size, layer=self.layer, timeout_s=self.timeout_s,
            kernels_backend=self.kernels_backend, recv_counts_SE=recv_counts_SE, recv_experts_H=held_H,
        )
        # Global condition (ΔP is the same on every rank), so that every rank issues the re-gather. The
        # last layer keeps its replicas: its backward starts right away, so releasing them would only put
        # a re-gather on the critical path (at most one layer's replicas are alive at a time either way).
        last = self.layer_index == len(self.state.layers) - 1
        released = None
        if track and self.state.rematerialize and placement != self.shard_placement and not last:
            released = self._release_replicas(held, replicas, placement, out_TH)
        if ckpt.mode == "forward":
            self._remember(ckpt, _ForwardRecord(placement, local_E, row, recv_counts_SE, held_H, held,
                                                released))
        # Only training forwards feed the load predictor (evaluation must not steer the next plans).
        start_ns = time.perf_counter_ns()
        self._record(load_E, tokens_ED, track, placement, holdings, calibrated)
        self.plan_ns += time.perf_counter_ns() - start_ns
        self.iteration += 1
        return out_TH

    # ------------------------------------------------------------------ activation checkpointing
    def _check_forward_context(self, ckpt: _CheckpointContext) -> None:
        """Raise, naming the variant, where a forward could not be replayed exactly (on every rank alike:
        the condition is the same program state everywhere, so no rank is left in a collective)."""
        variant = None
        if ckpt.mode == "forward" and ckpt.frame is None:
            variant = "this torch version's non-reentrant checkpoint (its frame is not recognised)"
        elif torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            variant = ("a forward run inside a backward pass that is not a recomputation of torch's "
                       "non-reentrant checkpoint (a nested checkpoint, or a reentrant one)")
        elif not torch.is_grad_enabled() and _in_reentrant_checkpoint():
            variant = "torch.utils.checkpoint(..., use_reentrant=True)"
        if variant is not None:
            raise RuntimeError(
                f"themis_compile: MoE layer {self.layer!r} (policy themis/themis-rm) cannot run under {variant}: "
                "its recomputation could not replay the forward's plan. Use torch.utils.checkpoint(..., "
                "use_reentrant=False), apply_activation_checkpointing (non-reentrant by default) or HF "
                "gradient_checkpointing_enable() (non-reentrant by default).")

    def _remember(self, ckpt: _CheckpointContext, record: _ForwardRecord) -> None:
        entry = self._checkpointed.get(ckpt.frame)
        if entry is None:
            entry = self._checkpointed[ckpt.frame] = _FrameRecords()
        entry.records.append(record)

    def _replay(self, ckpt: _CheckpointContext, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                weights_TK: torch.Tensor) -> torch.Tensor:
        """Recompute a checkpointed forward inside backward, exactly as it ran.

        Contract: the forward's realized P', T, dispatch rows and held tensors are reused, so every
        saved tensor has the forward's shape; the load predictor, the statistics and the iteration counter
        are untouched; no SpRS is registered (the forward's hook receives the gradients, which flow
        through the forward's graph); no collective but the token all-to-alls of the exchange, which
        every rank issues because every rank recomputes the same blocks in the same order. Under
        re-materialization the released replicas are gathered again first (or their prefetch waited for).
        """
        entry = self._checkpointed.get(ckpt.frame) if ckpt.frame is not None else None
        index = entry.replayed.get(ckpt.hook, 0) if entry is not None else 0
        if entry is None or index >= len(entry.records):
            raise RuntimeError(f"themis_compile: MoE layer {self.layer!r} is recomputed by activation "
                               "checkpointing, but no forward of this checkpoint region is left to replay")
        entry.replayed[ckpt.hook] = index + 1
        record = entry.records[index]
        local_E = torch.zeros(self.num_experts, dtype=torch.int64)
        local_E.scatter_add_(0, ids_TK.reshape(-1).cpu(), torch.ones(ids_TK.numel(), dtype=torch.int64))
        if not np.array_equal(local_E.numpy(), record.local_E):
            raise RuntimeError(f"themis_compile: MoE layer {self.layer!r}: the activation-checkpoint "
                               "recomputation routed tokens differently from the forward (is the router "
                               "non-deterministic, or did its state change before backward?)")
        if record.released is not None:
            with record_function("themis::rematerialize_for_recompute"):
                self._rematerialize(record.released)
        held = record.held
        dest_TK = record.row.destinations(ids_TK)
        return dispatch_compute_combine(
            x_TH, ids_TK, weights_TK, dest_TK, self.num_experts,
            lambda rows, counts: self.run_experts(held, rows, counts),
            group=self.group, world_size=self.world_size, kernels_backend=self.kernels_backend,
            recv_counts_SE=record.recv_counts_SE, recv_experts_H=record.recv_experts_H,
        )

    def _dispatch_plan(self, added_X: np.ndarray, copies_E: np.ndarray, local_E: np.ndarray) -> _OwnRow:
        """Alg. 3 for this rank: R[:, rank, :], where this rank's pairs of every expert go, as entries.

        The row depends only on P' and the rank's own counts T[:, rank] (Alg. 3 splits every source's
        tokens by itself), so no rank needs the others' counts and none builds the [E, D, D] plan or even
        an [E, D] array; what every source sends this rank comes from the sources
        (`CountExchange.receive_counts`).
        """
        owners_E, D = self.shard_placement.owners(), self.world_size      # copies_E: P''s holder counts
        full_J = np.flatnonzero(copies_E == D) if D > 1 else np.zeros(0, dtype=np.int64)
        replicas_X = added_X[copies_E[added_X // D] < D] if full_J.size else added_X
        start_E, dest_Y, count_Y = own_row_entries(owners_E, full_J, replicas_X, local_E, self.state.topology,
                                                   self.rank)
        return _OwnRow(start_E, dest_Y, count_Y)

    def _check_plan_digest(self, placement: Placement) -> None:
        digests = deadline.all_gather_object(placement.digest(), group=self.group, timeout_s=self.timeout_s,
                                             purpose="plan digest", layer=self.layer)
        if len(set(digests)) != 1:
            raise RuntimeError(f"MoE layer {self.layer!r}: ranks disagree on the plan P' (digests {digests})")

    def _record(self, load_E: np.ndarray, tokens_ED: np.ndarray | None, track: bool, placement: Placement,
                holdings: _Holdings, calibrated: bool) -> None:
        """Step 7: feed the predictor (training forwards only: evaluation must not steer the next plans)
        and append this layer step's `LayerStats`: O(E + |ΔP|), or the whole T under ``full_stats``."""
        if track:
            self.predictor.update(0, load_E)
        if tokens_ED is not None:
            device_load_D = dispatch_device_load(placement, tokens_ED, self.state.topology)
        else:
            device_load_D = holdings.device_load(load_E, placement.copy_counts())
        mean = device_load_D.sum() / max(self.world_size, 1)
        self.state.stats.append(LayerStats(
            iteration=self.iteration, layer=self.layer, tokens_per_expert=load_E, device_load=device_load_D,
            delta_p=int(holdings.added_X.size), owners_E=self.shard_placement.owners(), added_X=holdings.added_X,
            imbalance=float(device_load_D.max() / mean) if mean else 1.0, calibrated=calibrated,
            tokens_per_device_expert=None if tokens_ED is None else tokens_ED.T.tolist(),
        ))

    # ------------------------------------------------------------------ backward (steps 8-9)
    def _register_reduction(self, held: dict[int, list[torch.Tensor]], placement: Placement,
                            load_E: np.ndarray) -> None:
        # Only trainable tensors are reduced; the frozen flags are the same on every rank, and so are the
        # SpRS placement and chunk layouts derived from them. Where the user's experts module skips experts
        # without tokens, an expert no token of the global batch reached (load_E, the same on every rank)
        # gets no gradient from this forward, as in one process: it is reduced like a frozen one (no
        # replica in the SpRS, nothing accumulated on the owner), so its .grad stays None unless another
        # forward before the optimizer step (gradient accumulation) routed tokens to it.
        n = len(self.bank.spec)
        trainable_E = _Trainable.of(self._frozen_E, load_E == 0 if self.skips_empty_experts else None, n)
        spec: Any = self.bank.spec
        if trainable_E.partial:
            # Experts frozen whole keep only their owner's pair (from the pairs: no [E, D] matrix).
            frozen_whole_E = np.zeros(self.num_experts, dtype=np.bool_)
            frozen_whole_E[[e for e, t in trainable_E.partial.items() if not t]] = True
            D = self.world_size
            flat_X = placement.flat_ids()
            expert_X = flat_X // D
            keep_X = ~frozen_whole_E[expert_X] | (flat_X % D == self.shard_placement.owners()[expert_X])
            placement = Placement.from_pairs(flat_X[keep_X], *placement.shape)
            spec = {e: [self.bank.spec[i] for i in trainable_E[e]] for e in range(self.num_experts)}
        experts = sorted(e for e in held if trainable_E[e])
        if not experts:
            return        # holds nothing trainable: this rank has no part in this layer's SpRS
        leaves = [held[e][i] for e in experts for i in trainable_E[e]]
        # The hook keeps the leaves' shapes, not the leaves, and is removed at the end of the backward that
        # fired it: torch's multi-grad hook holds the leaves' gradient accumulators, which hold the leaves,
        # which hold the hook (a cycle through C++ the garbage collector cannot see): every step's held
        # tensors would stay alive.
        like = [(t.shape, t.dtype, t.device) for t in leaves]
        registered = []
        owned = sorted(self.local_chunks())
        state = self.state
        scale = 1.0 / self.world_size

        def on_grads(grads: Sequence[torch.Tensor | None]) -> None:
            it = iter(zip(grads, like))
            per_expert = {}
            for e in experts:
                per_expert[e] = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                                 for _, (g, (shape, dtype, device)) in zip(trainable_E[e], it)]
            with record_function("themis::sprs"):
                # Scaled by 1/world size on the owner, once, after the sum: the copies travel unscaled.
                handle = sparse_reduce_scatter(per_expert, placement, self.shard_placement, state.topology,
                                               state.comm_group, spec=spec, layer=self.layer,
                                               timeout_s=state.timeout_s, scale=scale)
            state.pending.append((self, _TrainableReduction(handle, trainable_E, owned, n)))
            state.fired_hooks += registered
            state.queue_finish()
            self._prefetch_previous_layer()

        registered.append(torch.autograd.graph.register_multi_grad_hook(leaves, on_grads, mode="all"))

    def accumulate_reduced(self, handle) -> None:
        with record_function("themis::sprs_wait"):
            reduced = handle.wait()
        # Every reduced tensor is this layer's own (the scaled gradient of an unreplicated expert, a fresh
        # accumulator of a replicated one): it becomes .grad without a copy.
        for e, params in self.local_chunks().items():
            for p, g in zip(params, reduced[e]):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g

    def wait_reduction(self) -> None:
        """Take this layer's finished SpRS now (the scheduling pass calls this at the end of the preceding
        attention's backward): accumulate it into the owners' ``.grad``. One still in flight is not waited
        for here: the end of the backward waits for it (only the optimizer reads these gradients, and
        blocking here would stall the rest of the backward). A layer's reductions are taken in issue
        order, so ``.grad`` sums them in the same order either way."""
        keep = []
        blocked = False
        for layer, handle in self.state.pending:
            if layer is self and not blocked and handle.is_completed():
                layer.accumulate_reduced(handle)
            else:
                blocked = blocked or layer is self
                keep.append((layer, handle))
        self.state.pending = keep

    # ------------------------------------------------------------------ re-materialization (§3.1)
    def _release_replicas(self, held, replicas, placement: Placement, out_TH: torch.Tensor) -> "_Released":
        leaves = {e: held[e] for e in replicas}
        rm = _Released(leaves, {e: [t.untyped_storage().nbytes() for t in ts] for e, ts in leaves.items()},
                       placement)
        for ts in leaves.values():
            for t in ts:
                t.untyped_storage().resize_(0)
        # One record per forward (several forwards may precede one backward); the newest is the one the
        # backward reaches first. Forwards whose graph was dropped without a backward leave their record
        # behind: keep a bounded number.
        self._released.append(rm)
        if len(self._released) > _MAX_PENDING_FORWARDS:
            self._released.pop(0)
            logger.warning("themis_compile: MoE layer %r: more than %d forwards without a backward under "
                           "re-materialization; the oldest is no longer prefetched", self.layer,
                           _MAX_PENDING_FORWARDS)

        def before_backward(grad: torch.Tensor) -> torch.Tensor:
            self._rematerialize(rm)
            return grad

        out_TH.register_hook(before_backward)
        return rm

    def drop_released(self) -> None:
        """Forget released replicas whose backward will not come (their re-gathers are waited for)."""
        for rm in self._released:
            if rm.handle is not None:
                rm.handle.wait()
        self._released.clear()

    def start_rematerialization(self) -> None:
        """Start re-gathering the most recent released replicas (prefetch); idempotent."""
        if self._released:
            self._start(self._released[-1])

    def _start(self, rm: "_Released") -> None:
        if rm.handle is not None:
            return
        for e, ts in rm.leaves.items():
            for t, n in zip(ts, rm.nbytes[e]):
                t.untyped_storage().resize_(n)
        # Receive straight into the leaves' storage through .data (no autograd version bump).
        out = {e: [t.data for t in ts] for e, ts in rm.leaves.items()}
        with record_function("themis::spag_rematerialize"):
            rm.handle = self._gather(rm.placement, out=out)

    def _rematerialize(self, rm: "_Released") -> None:
        self._start(rm)
        rm.handle.wait()
        if rm in self._released:
            self._released.remove(rm)

    def _prefetch_previous_layer(self) -> None:
        if not self.state.rematerialize:
            return
        order = self.state.layer_order
        if self in order:
            i = order.index(self)
            if i > 0:
                order[i - 1].start_rematerialization()


def default_budgets(num_experts: int, world_size: int, overlap_degree: int | None,
                    materialization_budget: int | None) -> tuple[int, int]:
    """t and m when the config gives none and no profile exists: every expert may be replicated, and
    each device may add as many replicas as it owns experts (one shard's worth of memory)."""
    t = num_experts if overlap_degree is None else overlap_degree
    m = math.ceil(num_experts / world_size) if materialization_budget is None else materialization_budget
    return int(t), int(m)
