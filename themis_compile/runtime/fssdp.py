"""The FSSDP executor: one MoE layer's per-iteration workflow (paper §3.1, Fig. 5; §4.2-§4.4).

Forward of layer l, iteration i:
  1. plan   P'_l = Alg1(P_l, predicted load F_l, t, m)            (same on every rank: integer inputs)
  2. start  SpAG(P_l, P'_l)                                        (``start_materialization``; a scheduling
                                                                     pass may call it before attention l)
  3. router -> top-k -> local counts, all-gathered into T[e, d]    (every rank holds the same T)
  4. (calibration) re-plan on the actual loads with the remaining budget; gather the extra replicas
  5. wait SpAG; R = Alg3(P'_l, T); every pair gets a destination holding its expert (and every rank reads
     off R what it receives: the token exchange needs no count all-to-all)
  6. permute -> all-to-all -> experts (owned + materialized) -> all-to-all -> combine
  7. record the actual loads for the predictor and the load statistics
Backward of layer l:
  8. gradients of every copy land in per-iteration leaf tensors; once all are computed, start
     SpRS(P'_l, P_l), which sums each expert's copies into its owner
  9. at the end of the backward pass wait for every SpRS and accumulate into the owned parameters' .grad
     (scaled by 1/world size, like EP, once on the owner after the sum; dense parameters are averaged by DDP)
Frozen expert tensors (``requires_grad=False`` on the owner, agreed by every rank through the count
all-gather of step 3) get no gradient: their copies are no autograd leaves, the SpRS carries only
trainable tensors, and an expert frozen whole has no replica in it (P restricted to it).
Experts without tokens: where the user's experts module runs only the experts that receive tokens
(``skips_empty_experts``, found by detection), an expert whose global count in T is 0 gets no gradient
from that forward, as in one process (where AdamW then skips it: no momentum step, no weight decay): it
is reduced like an expert frozen whole for that forward, so its ``.grad`` stays None unless another
forward before the optimizer step routed a token to it.
Re-materialization (themis-rm): replicas' storage is released after step 6 and gathered again (same P')
just before the layer's backward, prefetched when the next layer's backward finishes (§3.1).

Activation checkpointing (torch's non-reentrant ``checkpoint`` around a block, ``apply_activation_checkpointing``,
HF ``gradient_checkpointing_enable()``): the recomputation inside backward replays the forward it pairs with
(``_replay``): the same realized P', T and dispatch splits, the same held tensors (re-gathered first under
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

from themis_compile import kernels
from themis_compile.planner import (
    LoadPredictor,
    Placement,
    PlanCost,
    Topology,
    calibrate,
    dispatch_device_load,
    dispatch_rows,
    sparse_materialization,
    topology_aware_dispatch,
)
from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import sparse_all_gather, sparse_reduce_scatter
from themis_compile.runtime.ep import ShardedExperts
from themis_compile.runtime.exchange import dispatch_compute_combine, exchange_counts
from themis_compile.runtime.experts import ExpertBank

logger = logging.getLogger(__name__)


@dataclass
class LayerStats:
    """Load statistics of one layer in one iteration (what logging, the demo and the simulator read)."""

    iteration: int
    layer: str
    tokens_per_device_expert: list[list[int]]   # [D][E]: tokens each rank's router sent to each expert
    tokens_per_expert: list[int]                # [E] global
    device_load: list[int]                      # [D] rows each rank computed under the realized plan
    delta_p: int                                # |ΔP| = replicas added this iteration
    placement: list[list[bool]]                 # realized P' as [E][D]
    calibrated: bool = False

    @property
    def imbalance(self) -> float:
        """max / mean rows computed per device (1.0 = perfectly balanced)."""
        mean = sum(self.device_load) / max(len(self.device_load), 1)
        return max(self.device_load) / mean if mean else 1.0


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
    budget_controller: Any = None         # applies profiled t, m (runtime/budgets.py)
    layers: list = field(default_factory=list)   # every FSSDP layer of the model (set by optimize)
    layer_order: list["FSSDPExperts"] = field(default_factory=list)
    pending: list[tuple["FSSDPExperts", Any]] = field(default_factory=list)
    callback_queued: bool = False
    stats: deque = field(default_factory=lambda: deque(maxlen=10000))

    def queue_finish(self) -> None:
        """Make sure ``finish_backward`` runs once at the end of the current backward pass."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        self.callback_queued = False
        pending, self.pending = self.pending, []
        for layer, handle in pending:
            layer.accumulate_reduced(handle)


_MAX_PENDING_FORWARDS = 64
# Up to this many entries E·D·D, every rank computes the whole Alg. 3 plan R[e, d, d'] and reads off what
# it receives (no count all-to-all); beyond, it computes only its own rows and exchanges the counts.
_FULL_PLAN_MAX_ENTRIES = 1 << 16


@dataclass(eq=False)
class _TrainableReduction:
    """A started SpRS of the trainable tensors only; ``wait()`` -> {owned expert: [gradient or None]} with
    one entry per chunk tensor, None where the tensor is frozen."""

    handle: Any
    trainable_E: list[list[int]]     # per expert: indices of its trainable chunk tensors
    owned: list[int]
    num_tensors: int

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
    (after calibration), the global counts T, this rank's dispatch rows R[:, rank, :] and the very tensors
    the experts ran with (owned aliases and replicas: the leaves the SpRS hook watches).
    """

    placement: Placement
    tokens_ED: np.ndarray
    splits_ED: torch.Tensor
    recv_counts_SE: torch.Tensor | None
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
        self._planned: Placement | None = None
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
        with record_function("themis::plan"):
            load_E = self.predictor.predict(0)
            planned = sparse_materialization(self.shard_placement, load_E, self.overlap_degree,
                                             self.materialization_budget, self.state.topology)
        self._planned = planned
        with record_function("themis::spag"):
            self._spag = self._gather(planned)

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
    def _global_tokens(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> np.ndarray:
        """All-gather each rank's tokens per expert into T[e, d]; raise on every rank if any router
        produced non-finite weights (so no rank is left waiting in a collective)."""
        E = self.num_experts
        local = torch.zeros(2 * E + 2, dtype=torch.int64)
        bad_ids = self._routing_error(ids_TK)
        if not bad_ids:
            local[:E].scatter_add_(0, ids_TK.reshape(-1).cpu(), torch.ones(ids_TK.numel(), dtype=torch.int64))
        local[E] = int(not bool(torch.isfinite(weights_TK).all()))
        local[E + 1] = int(bad_ids)
        for e, params in self.local_chunks().items():     # the owner's frozen tensors, for every rank
            local[E + 2 + e] = sum(1 << i for i, p in enumerate(params) if not p.requires_grad)
        if self.world_size > 1:
            local = local.to(ids_TK.device)     # the group's device (NCCL needs CUDA tensors)
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            deadline.all_gather(parts, local, group=self.group, timeout_s=self.timeout_s,
                                purpose="tokens per expert and router flags", layer=self.layer)
            gathered = torch.stack(parts).cpu()
        else:
            gathered = local[None]
        bad = torch.nonzero(gathered[:, E]).flatten().tolist()
        if bad:
            raise FloatingPointError(f"MoE layer {self.layer!r}: non-finite router output on ranks {bad} "
                                     f"(iteration {self.iteration})")
        bad = torch.nonzero(gathered[:, E + 1]).flatten().tolist()
        if bad:
            raise ValueError(f"MoE layer {self.layer!r}: router chose an expert id outside [0, {E}) on ranks "
                             f"{bad} (iteration {self.iteration})")
        self._frozen_E = gathered[:, E + 2:].sum(0).tolist()    # only the owner's entry is non-zero
        return gathered[:, :E].t().numpy().copy()          # [E, D]

    # ------------------------------------------------------------------ forward (steps 3-7)
    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
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
            tokens_ED = self._global_tokens(ids_TK, weights_TK.detach())
        load_E = tokens_ED.sum(axis=1)
        replicas = self._consume_materialization()
        placement = self._planned
        calibrated = False
        if self.state.calibrate:
            with record_function("themis::calibrate"):
                merged = calibrate(self.shard_placement, placement, load_E, self.overlap_degree,
                                   self.materialization_budget, self.state.topology, self.cost, tokens_ED)
            if merged != placement:
                # Gather exactly the pairs calibration adds: SpAG(P, P ∪ (P'' \ P')).
                extra = Placement(self.shard_placement.mask | (merged.mask & ~placement.mask))
                with record_function("themis::spag_calibration"):
                    replicas.update(self._gather(extra).wait())
                placement, calibrated = merged, True
        if self.state.check_plans:
            self._check_plan_digest(placement)
        with record_function("themis::dispatch_plan"):
            splits_ED, recv_counts_SE = self._dispatch_plan(placement, tokens_ED, ids_TK.device)
        dest_TK = kernels.assign_destinations(ids_TK, splits_ED.to(ids_TK.device), backend=self.kernels_backend)

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
            kernels_backend=self.kernels_backend, recv_counts_SE=recv_counts_SE,
        )
        # Global condition (ΔP is the same on every rank), so that every rank issues the re-gather. The
        # last layer keeps its replicas: its backward starts right away, so releasing them would only put
        # a re-gather on the critical path (at most one layer's replicas are alive at a time either way).
        last = self.layer_index == len(self.state.layers) - 1
        released = None
        if track and self.state.rematerialize and placement != self.shard_placement and not last:
            released = self._release_replicas(held, replicas, placement, out_TH)
        if ckpt.mode == "forward":
            self._remember(ckpt, _ForwardRecord(placement, tokens_ED, splits_ED, recv_counts_SE, held, released))
        # Only training forwards feed the load predictor (evaluation must not steer the next plans).
        self._record(tokens_ED, load_E if track else None, placement, calibrated)
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
        if not np.array_equal(local_E.numpy(), record.tokens_ED[:, self.rank]):
            raise RuntimeError(f"themis_compile: MoE layer {self.layer!r}: the activation-checkpoint "
                               "recomputation routed tokens differently from the forward (is the router "
                               "non-deterministic, or did its state change before backward?)")
        if record.released is not None:
            with record_function("themis::rematerialize_for_recompute"):
                self._rematerialize(record.released)
        held = record.held
        dest_TK = kernels.assign_destinations(ids_TK, record.splits_ED.to(ids_TK.device),
                                              backend=self.kernels_backend)
        return dispatch_compute_combine(
            x_TH, ids_TK, weights_TK, dest_TK, self.num_experts,
            lambda rows, counts: self.run_experts(held, rows, counts),
            group=self.group, world_size=self.world_size, kernels_backend=self.kernels_backend,
            recv_counts_SE=record.recv_counts_SE,
        )

    def _dispatch_plan(self, placement: Placement, tokens_ED: np.ndarray,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Alg. 3 for this rank: ``(splits_ED, recv_counts_SE)``.

        ``splits_ED`` = R[:, rank, :], where this rank's pairs of every expert go. ``recv_counts_SE`` =
        R[:, :, rank]ᵀ, what every source sends this rank: every rank computes the same plan R from the
        same T, so the token exchange needs no count all-to-all (one blocking collective less per layer
        forward). The whole [E, D, D] plan is computed for it only while it is small
        (``_FULL_PLAN_MAX_ENTRIES``); beyond that only the rank's own rows, and ``recv_counts_SE`` is None:
        the exchange then all-to-alls the counts. With ``check_plans`` the derived counts are checked
        against that all-to-all.
        """
        topology, rank, D = self.state.topology, self.rank, self.world_size
        if self.num_experts * D * D > _FULL_PLAN_MAX_ENTRIES:
            return torch.from_numpy(np.ascontiguousarray(dispatch_rows(placement, tokens_ED, topology, rank))), None
        R_EDD = topology_aware_dispatch(placement, tokens_ED, topology)
        splits_ED = torch.from_numpy(np.ascontiguousarray(R_EDD[:, rank, :]))
        recv_counts_SE = torch.from_numpy(np.ascontiguousarray(R_EDD[:, :, rank].T))
        if self.state.check_plans:
            # (On the group's device: NCCL needs CUDA tensors.)
            exchanged_SE = exchange_counts(splits_ED.t().contiguous().to(device), self.group, D, layer=self.layer,
                                           timeout_s=self.timeout_s).cpu()
            if not torch.equal(exchanged_SE, recv_counts_SE):
                raise RuntimeError(f"MoE layer {self.layer!r}: the rows rank {rank} receives under the plan "
                                   f"({recv_counts_SE.tolist()}) differ from what the ranks send "
                                   f"({exchanged_SE.tolist()})")
        return splits_ED, recv_counts_SE

    def _check_plan_digest(self, placement: Placement) -> None:
        digests = deadline.all_gather_object(placement.digest(), group=self.group, timeout_s=self.timeout_s,
                                             purpose="plan digest", layer=self.layer)
        if len(set(digests)) != 1:
            raise RuntimeError(f"MoE layer {self.layer!r}: ranks disagree on the plan P' (digests {digests})")

    def _record(self, tokens_ED, load_E, placement: Placement, calibrated: bool) -> None:
        if load_E is not None:
            self.predictor.update(0, load_E)
        load_E = tokens_ED.sum(axis=1)
        self.state.stats.append(LayerStats(
            iteration=self.iteration, layer=self.layer,
            tokens_per_device_expert=tokens_ED.T.tolist(), tokens_per_expert=load_E.tolist(),
            device_load=dispatch_device_load(placement, tokens_ED, self.state.topology).tolist(),
            delta_p=int(placement.delta(self.shard_placement).num_pairs()),
            placement=placement.mask.tolist(), calibrated=calibrated,
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
        trainable_E = [[i for i in range(n) if not frozen >> i & 1] for frozen in self._frozen_E]
        if self.skips_empty_experts:
            trainable_E = [[] if load_E[e] == 0 else t for e, t in enumerate(trainable_E)]
        spec: Any = self.bank.spec
        if any(len(t) < n for t in trainable_E):
            frozen_whole_E = np.array([not t for t in trainable_E])[:, None]
            placement = Placement(np.where(frozen_whole_E, self.shard_placement.mask, placement.mask))
            spec = {e: [self.bank.spec[i] for i in t] for e, t in enumerate(trainable_E)}
        experts = sorted(e for e in held if trainable_E[e])
        if not experts:
            return        # holds nothing trainable: this rank has no part in this layer's SpRS
        leaves = [held[e][i] for e in experts for i in trainable_E[e]]
        owned = sorted(self.local_chunks())
        state = self.state
        scale = 1.0 / self.world_size

        def on_grads(grads: Sequence[torch.Tensor | None]) -> None:
            it = iter(grads)
            per_expert = {}
            for e in experts:
                per_expert[e] = [g if g is not None else torch.zeros_like(held[e][i])
                                 for i, g in zip(trainable_E[e], it)]
            with record_function("themis::sprs"):
                # Scaled by 1/world size on the owner, once, after the sum: the copies travel unscaled.
                handle = sparse_reduce_scatter(per_expert, placement, self.shard_placement, state.topology,
                                               state.comm_group, spec=spec, layer=self.layer,
                                               timeout_s=state.timeout_s, scale=scale)
            state.pending.append((self, _TrainableReduction(handle, trainable_E, owned, n)))
            state.queue_finish()
            self._prefetch_previous_layer()

        torch.autograd.graph.register_multi_grad_hook(leaves, on_grads, mode="all")

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
        """Wait for this layer's pending SpRS now (a scheduling pass may call this early)."""
        keep = []
        for layer, handle in self.state.pending:
            if layer is self:
                layer.accumulate_reduced(handle)
            else:
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
