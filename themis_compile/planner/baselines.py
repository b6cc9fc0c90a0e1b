"""Placement policies behind one interface: Themis and the baselines of §5.1.

A `Policy` is asked once per MoE layer and iteration for a `PolicyStep`::

    step = policy.plan(layer, predicted_load_E, actual_tokens_ED)
    step.placement   # P' the tokens are dispatched against this iteration (⊇ step.shard)
    step.shard       # owners: where parameters' optimizer state lives
    step.traffic     # `DispatchTraffic`: per-device totals of the dispatch plan (load, intra/inter-node)
    step.R           # [E, D, D] int64 dispatch plan, Σ_d2 R[e, d, d2] == actual_tokens_ED[e, d]
    step.bytes_moved # dict[str, int] bytes per category (below), totals over all devices

``predicted_load_E`` is what the policy may know before the gate runs (e.g. `LoadPredictor.predict`);
``actual_tokens_ED`` is the gate's output, which policies that act after gating (FasterMoE, calibration)
may use. Layers are planned in order 0..L-1 within an iteration; each policy counts iterations per
layer itself.

Byte categories (``BYTE_CATEGORIES``; every step reports all of them, in bytes, summed over devices):

* ``spag``: SparseAllGather of ΔP = P' \\ P before the layer, overlapped with attention (Eq. 4, |ΔP|·Ψ).
* ``spag_calibration``: the extra SpAG the calibration stage adds after gating (on the critical path).
* ``spag_remat``: the re-materialization SpAG before the layer's backward (Themis-RM only).
* ``sprs``: SparseReduceScatter of the replicas' gradients in backward, |ΔP|·Ψ.
* ``broadcast`` / ``reduce``: FasterMoE's shadow-expert parameter broadcast and gradient reduce,
  (D-1)·Ψ per shadowed expert each (critical path).
* ``allreduce``: per-iteration gradient AllReduce of persistent replicas, Σ 2(|D_i|-1)·Ψ (Eq. 5).
* ``migration``: persistent placement changes: Ψ per newly placed copy plus the optimizer-state bytes
  when the copy carries optimizer state (a moved owner, or a FlexMoE replica).
* ``reshard``: Themis's Alg. 2 re-sharding: (Ψ + optimizer-state bytes) per expert that changes owner,
  all layers, charged on the step of layer 0 of the re-sharding iteration.
* ``a2a``: token bytes of the dispatch all-to-all leaving their source device (the combine all-to-all
  mirrors it); ``a2a_inter``: the part of ``a2a`` that crosses nodes. Zero unless ``token_bytes`` > 0.

A step keeps its plan sparse: ``traffic`` comes from `dispatch.dispatch_traffic` in O(E·D), and the dense
plan ``R`` (O(E·D²): 32 GiB at 1,024 devices) is built only when read, from the placement and the
dispatched tokens (``step.tokens_ED``, the gate's unless the policy changes the routing).

Legend: E experts, D devices, N nodes, L layers.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from themis_compile.planner.cost import PlanCost, fluid_device_load
from themis_compile.planner.dispatch import DispatchTraffic, check_tokens, dispatch_traffic, topology_aware_dispatch
from themis_compile.planner.materialize import calibrate, check_count, check_loads, sparse_materialization
from themis_compile.planner.placement import Placement
from themis_compile.planner.sharding import heterogeneous_sharding, homogeneous_sharding
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = [
    "BYTE_CATEGORIES", "POLICY_NAMES", "PolicyStep", "Policy", "ThemisPolicy", "EPPolicy", "UniformPolicy",
    "FasterMoEPolicy", "SmartMoEPolicy", "FlexMoEPolicy", "EPLBPolicy", "make_policy",
]

BYTE_CATEGORIES = ("spag", "spag_calibration", "spag_remat", "sprs", "broadcast", "reduce", "allreduce",
                   "migration", "reshard", "a2a", "a2a_inter")


@dataclass(frozen=True)
class PolicyStep:
    """One layer's plan for one iteration (see the module docstring)."""

    placement: Placement
    shard: Placement
    traffic: DispatchTraffic
    bytes_moved: dict[str, int]
    info: dict[str, object] = field(default_factory=dict)
    tokens_ED: np.ndarray | None = field(default=None, repr=False, compare=False)   # the dispatched counts
    dispatch_topology: Topology | None = field(default=None, repr=False)          # the plan's (Alg. 3) nodes

    @functools.cached_property
    def R(self) -> np.ndarray:
        """The dense [E, D, D] int64 plan, built when first read (O(E·D²): for small clusters and tests;
        the simulator reads `traffic`)."""
        return topology_aware_dispatch(self.placement, self.tokens_ED, self.dispatch_topology)


def _allreduce_bytes(placement: Placement, expert_bytes: float) -> int:
    """Eq. 5: Σ over replicated experts of 2(|D_i|-1)·Ψ."""
    extra_E = np.maximum(placement.copies() - 1, 0)
    return int(round(2 * int(extra_E.sum()) * expert_bytes))


class Policy:
    """Base class: holds the cluster description and fills in the byte accounting.

    Args:
        num_layers: L MoE layers.
        num_experts: E experts per layer.
        topology: the cluster.
        expert_bytes: Ψ, parameter bytes of one expert.
        optimizer_state_bytes: optimizer-state bytes of one expert (default 2·Ψ: Adam's two moments).
        token_bytes: bytes of one token in the all-to-all (0: not accounted).
        time_per_token_s: compute time of one token through one expert (for policies with a latency model).
    """

    name = "policy"

    def __init__(self, num_layers: int, num_experts: int, topology: Topology, expert_bytes: float = 1.0, *,
                 optimizer_state_bytes: float | None = None, token_bytes: float = 0.0,
                 time_per_token_s: float = 1e-6) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need num_layers >= 1 and num_experts >= 1, got {num_layers}, {num_experts}")
        if expert_bytes < 0 or token_bytes < 0 or time_per_token_s < 0:
            raise ValueError("expert_bytes, token_bytes and time_per_token_s must be >= 0")
        self.num_layers, self.num_experts, self.topology = int(num_layers), int(num_experts), topology
        self.num_devices = topology.num_devices
        self.expert_bytes = float(expert_bytes)
        self.optimizer_state_bytes = 2.0 * self.expert_bytes if optimizer_state_bytes is None \
            else float(optimizer_state_bytes)
        self.token_bytes = float(token_bytes)
        self.cost = PlanCost(time_per_token_s, self.expert_bytes, topology)
        self._iteration_L = [0] * self.num_layers

    # ----------------------------------------------------------------------------------- interface
    def plan(self, layer: int, predicted_load_E: np.ndarray, actual_tokens_ED: np.ndarray) -> PolicyStep:
        """Plan one layer for one iteration (see the module docstring)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range for {self.num_layers} MoE layers")
        predicted_load_E = check_loads(predicted_load_E, self.num_experts, "predicted_load_E")
        tokens_ED = check_tokens(actual_tokens_ED, self.num_experts, self.num_devices)
        step = self._plan(layer, self._iteration_L[layer], predicted_load_E, tokens_ED)
        self._iteration_L[layer] += 1
        return step

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        raise NotImplementedError

    # ----------------------------------------------------------------------------------- helpers
    def _step(self, placement: Placement, shard: Placement, tokens_ED: np.ndarray, info: dict | None = None, *,
              dispatch_topology: Topology | None = None, **bytes_moved: float) -> PolicyStep:
        """The step that dispatches ``tokens_ED`` against ``placement`` by Alg. 3 on ``dispatch_topology``
        (default: the cluster's), its traffic classified on the cluster's nodes."""
        moved = {name: 0 for name in BYTE_CATEGORIES}
        for name, value in bytes_moved.items():
            if name not in moved:
                raise ValueError(f"unknown byte category {name!r}")
            moved[name] = int(round(value))
        plan_topology = self.topology if dispatch_topology is None else dispatch_topology
        traffic = dispatch_traffic(placement, tokens_ED, plan_topology, links=self.topology, tokens_checked=True)
        if self.token_bytes > 0:
            moved["a2a"] = int(round(traffic.sent() * self.token_bytes))
            moved["a2a_inter"] = int(round(traffic.inter_node_sent() * self.token_bytes))
        return PolicyStep(placement, shard, traffic, moved, info or {}, tokens_ED, plan_topology)

    def _pairs_bytes(self, placement: Placement, shard: Placement) -> int:
        """Bytes of ΔP = placement \\ shard, |placement| - |shard| for shard ⊆ placement (checked, as
        `Placement.delta` does), without building ΔP."""
        if placement is shard:
            return 0
        if not shard.issubset(placement):
            raise ValueError("delta: the base placement is not a subset of this placement")
        return int(round((placement.num_pairs() - shard.num_pairs()) * self.expert_bytes))


# --------------------------------------------------------------------------------------- Themis
class ThemisPolicy(Policy):
    """Themis: Alg. 1 on the predicted load, calibration on the actual load, Alg. 3 dispatch, and Alg. 2
    re-sharding of all layers every ``reshard_interval`` iterations (0: never).

    ``rematerialize=True`` is Themis-RM: replicas are freed after forward and gathered again before
    backward (one more SpAG of the same volume, ``spag_remat``); pass the larger per-layer budget it
    affords as ``materialization_budget``.
    """

    name = "themis"

    def __init__(self, num_layers: int, num_experts: int, topology: Topology, expert_bytes: float = 1.0, *,
                 overlap_degree: int, materialization_budget: int, reshard_interval: int = 100,
                 calibration: bool = True, calibration_budget_s: float = math.inf,
                 rematerialize: bool = False, **kwargs: float) -> None:
        super().__init__(num_layers, num_experts, topology, expert_bytes, **kwargs)
        self.overlap_degree = check_count("overlap_degree", overlap_degree)
        self.materialization_budget = check_count("materialization_budget", materialization_budget)
        self.reshard_interval = check_count("reshard_interval", reshard_interval)
        self.calibration = calibration
        self.rematerialize = rematerialize
        self.cost = PlanCost(self.cost.time_per_token_s, self.expert_bytes, topology,
                             calibration_budget_s=calibration_budget_s)
        self.shards = homogeneous_sharding(self.num_layers, self.num_experts, self.num_devices)
        self._last_load_LE = np.ones((self.num_layers, self.num_experts), dtype=np.float64)
        if rematerialize:
            self.name = "themis-rm"

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        self._last_load_LE[layer] = predicted_load_E
        reshard_bytes = 0.0
        if layer == 0 and self.reshard_interval and iteration > 0 and iteration % self.reshard_interval == 0:
            new_shards = heterogeneous_sharding(self._last_load_LE, self.overlap_degree, self.topology)
            moved = sum(int((old.owners() != new.owners()).sum()) for old, new in zip(self.shards, new_shards))
            reshard_bytes = moved * (self.expert_bytes + self.optimizer_state_bytes)
            self.shards = new_shards
        shard = self.shards[layer]
        t, m = self.overlap_degree, self.materialization_budget
        materialized = sparse_materialization(shard, predicted_load_E, t, m, self.topology)   # Alg. 1
        placement = materialized
        if self.calibration:                                                               # §4.2
            placement = calibrate(shard, materialized, tokens_ED.sum(axis=1), t, m, self.topology,
                                  self.cost, tokens_ED=tokens_ED)
        spag = self._pairs_bytes(materialized, shard)
        calib = self._pairs_bytes(placement, materialized)
        total = spag + calib
        return self._step(placement, shard, tokens_ED, {"calibrated": placement is not materialized},  # Alg. 3
                          spag=spag, spag_calibration=calib, sprs=total,
                          spag_remat=total if self.rematerialize else 0, reshard=reshard_bytes)


# --------------------------------------------------------------------------------------- EP, Uniform
class EPPolicy(Policy):
    """Static expert parallelism: contiguous shards, no replicas."""

    name = "ep"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.shard = Placement.contiguous(self.num_experts, self.num_devices)

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        return self._step(self.shard, self.shard, tokens_ED)


class UniformPolicy(EPPolicy):
    """Reference: EP with a gate that spreads every device's tokens evenly over all experts.

    Device d's ``n_d`` routed tokens become ``q`` or ``q + 1`` per expert (``q, r = divmod(n_d, E)``;
    expert e gets the extra one when ``(e - d) mod E < r``). It changes the routing on purpose.
    """

    name = "uniform"

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        E, D = tokens_ED.shape
        q_D, r_D = np.divmod(tokens_ED.sum(axis=0), E)
        rot_ED = (np.arange(E)[:, None] - np.arange(D)[None, :]) % E
        uniform_ED = q_D[None, :] + (rot_ED < r_D[None, :])
        return self._step(self.shard, self.shard, uniform_ED, {"tokens_ED": uniform_ED})


# --------------------------------------------------------------------------------------- FasterMoE
class FasterMoEPolicy(EPPolicy):
    """FasterMoE: after gating, shadow (broadcast to every device) the experts its latency model says
    pay off; shadowed experts run locally on every device, their gradients are reduced to the owner.

    Latency model: greedy over experts by actual load, descending; shadowing one more expert is kept while
    it lowers ``compute_factor · time_per_token · (max device tokens) + 2 · k · Ψ / bw`` (k shadows
    broadcast and reduced over the bottleneck link, the inter-node one on several nodes).
    """

    name = "fastermoe"

    def __init__(self, *args: object, compute_factor: float = 3.0, max_shadows: int | None = None,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.compute_factor = float(compute_factor)
        self.max_shadows = self.num_experts if max_shadows is None else check_count("max_shadows", max_shadows)

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        E, D = tokens_ED.shape
        owners_E = self.shard.owners()
        load_E = tokens_ED.sum(axis=1)
        dev_load_D = np.bincount(owners_E, weights=load_E, minlength=D)   # exact: EP computes at owners
        bw = self.topology.inter_node_bw if self.topology.num_nodes > 1 else self.topology.intra_node_bw
        per_shadow_s = 2.0 * self.expert_bytes / bw
        tpt = self.compute_factor * self.cost.time_per_token_s
        best_s = dev_load_D.max(initial=0.0) * tpt
        shadows: list[int] = []
        for e in np.argsort(-load_E, kind="stable")[: self.max_shadows].tolist():
            trial_D = dev_load_D.copy()
            trial_D[owners_E[e]] -= load_E[e]
            trial_D += tokens_ED[e]
            trial_s = trial_D.max() * tpt + (len(shadows) + 1) * per_shadow_s
            if trial_s >= best_s or D == 1:
                break
            shadows.append(e)
            dev_load_D, best_s = trial_D, trial_s
        mask_ED = self.shard.mask.copy()
        mask_ED[shadows, :] = True
        placement = Placement(mask_ED)
        volume = len(shadows) * (D - 1) * self.expert_bytes
        return self._step(placement, self.shard, tokens_ED, {"shadows": shadows}, broadcast=volume, reduce=volume)


# --------------------------------------------------------------------------------------- SmartMoE
class SmartMoEPolicy(Policy):
    """SmartMoE: every ``swap_interval`` iterations, swap experts between the slots of the most and the
    least loaded devices (predicted load) while a swap lowers the larger of the two; each moved expert
    migrates its parameters and optimizer state. No replicas."""

    name = "smartmoe"

    def __init__(self, *args: object, swap_interval: int = 10, max_swaps: int | None = None,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.swap_interval = max(1, check_count("swap_interval", swap_interval))
        self.max_swaps = self.num_devices if max_swaps is None else check_count("max_swaps", max_swaps)
        contiguous = Placement.contiguous(self.num_experts, self.num_devices).owners()
        self.owners_LE = [contiguous.copy() for _ in range(self.num_layers)]

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        owners_E = self.owners_LE[layer]
        migrated = 0
        if iteration > 0 and iteration % self.swap_interval == 0:
            D = self.num_devices
            for _ in range(self.max_swaps):
                dev_load_D = np.bincount(owners_E, weights=predicted_load_E, minlength=D)
                hi, lo = int(np.argmax(dev_load_D)), int(np.argmin(dev_load_D))
                on_hi, on_lo = np.flatnonzero(owners_E == hi), np.flatnonzero(owners_E == lo)
                if hi == lo or on_hi.size == 0 or on_lo.size == 0:
                    break
                diff_AB = predicted_load_E[on_hi][:, None] - predicted_load_E[on_lo][None, :]
                new_max_AB = np.maximum(dev_load_D[hi] - diff_AB, dev_load_D[lo] + diff_AB)
                a, b = np.unravel_index(int(np.argmin(new_max_AB)), new_max_AB.shape)
                if new_max_AB[a, b] >= dev_load_D[hi]:
                    break
                owners_E[on_hi[a]], owners_E[on_lo[b]] = lo, hi
                migrated += 2
        shard = Placement.from_owners(owners_E, self.num_devices)
        return self._step(shard, shard, tokens_ED, migration=migrated * (self.expert_bytes + self.optimizer_state_bytes))


# --------------------------------------------------------------------------------------- FlexMoE
class FlexMoEPolicy(Policy):
    """FlexMoE: persistent replicas in ``replica_slots`` reserved slots per device. Each iteration whose
    predicted imbalance (max / mean modeled device load) exceeds ``threshold`` shrinks one replica of the
    expert with the smallest per-copy load (when no slot is free) and expands the expert with the largest
    per-copy load by one replica on the least-loaded device with a free slot. A new replica migrates
    parameters and optimizer state; replica gradients are all-reduced every iteration (Eq. 5). Tokens
    split evenly over all holders (no topology awareness)."""

    name = "flexmoe"

    def __init__(self, *args: object, replica_slots: int = 1, threshold: float = 1.1, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.replica_slots = check_count("replica_slots", replica_slots)
        if not threshold >= 1.0:
            raise ValueError(f"FlexMoE threshold must be >= 1, got {threshold}")
        self.threshold = float(threshold)
        self.shard = Placement.contiguous(self.num_experts, self.num_devices)
        self.masks_LED = [self.shard.mask.copy() for _ in range(self.num_layers)]
        self._one_node = Topology.single_node(self.num_devices)     # tokens split over all holders

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        mask_ED = self.masks_LED[layer]
        load_E = predicted_load_E
        migrated = 0
        dev_load_D = fluid_device_load(Placement.adopt(mask_ED.copy()), load_E)
        mean = dev_load_D.mean()
        if self.replica_slots and mean > 0 and dev_load_D.max() / mean > self.threshold:
            extra_ED = mask_ED & ~self.shard.mask
            copies_E = mask_ED.sum(axis=1)
            per_copy_E = load_E / copies_E
            free_D = self.replica_slots - extra_ED.sum(axis=0)
            hot = int(np.argmax(per_copy_E))
            if not (free_D > 0).any():
                # Shrink one unit: the replica of the expert with the smallest per-copy load.
                replicated = np.flatnonzero(extra_ED.any(axis=1) & (np.arange(self.num_experts) != hot))
                if replicated.size:
                    cold = int(replicated[np.argmin(per_copy_E[replicated])])
                    holders = np.flatnonzero(extra_ED[cold])
                    victim = int(holders[np.argmax(dev_load_D[holders])])
                    mask_ED[cold, victim] = False
                    free_D[victim] += 1
            # Expand one unit: a replica of the hottest expert on the least-loaded free device.
            cand = np.flatnonzero((free_D > 0) & ~mask_ED[hot])
            if cand.size:
                dev_load_D = fluid_device_load(Placement.adopt(mask_ED.copy()), load_E)
                target = int(cand[np.argmin(dev_load_D[cand])])
                mask_ED[hot, target] = True
                migrated += 1
        placement = Placement(mask_ED)
        return self._step(placement, self.shard, tokens_ED, dispatch_topology=self._one_node,   # even_dispatch
                          allreduce=_allreduce_bytes(placement, self.expert_bytes),
                          migration=migrated * (self.expert_bytes + self.optimizer_state_bytes))


# --------------------------------------------------------------------------------------- DeepSeek EPLB
class EPLBPolicy(Policy):
    """DeepSeek-EPLB-style hierarchical rebalancing with ``redundant_slots`` extra slots per device,
    every ``interval`` iterations, from the predicted load:

    1. pack experts onto nodes, heaviest first, to the node with the least load per device among nodes
       with room (each node holds at most its share of logical experts);
    2. inside each node, give its spare physical slots to replicas, one at a time to the expert with the
       largest per-copy load (at most one copy per device);
    3. pack each node's copies onto its devices, heaviest first, to the least-loaded device with a free
       slot that does not hold the expert.

    The owner of an expert (optimizer state) stays where it was when that device still holds it, else it
    is the lowest device holding it. Migration charges Ψ per new copy plus optimizer state per moved
    owner; replica gradients are all-reduced every iteration (Eq. 5). Dispatch is Alg. 3 (node-local
    replicas first), matching DeepSeek's node-limited routing.
    """

    name = "eplb"

    def __init__(self, *args: object, interval: int = 50, redundant_slots: int = 1, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.interval = max(1, check_count("interval", interval))
        self.redundant_slots = check_count("redundant_slots", redundant_slots)
        shard = Placement.contiguous(self.num_experts, self.num_devices)
        self.placements = [shard] * self.num_layers
        self.shards = [shard] * self.num_layers

    def _rebalance(self, load_E: np.ndarray, old_owners_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        topo, E = self.topology, self.num_experts
        slots_per_device = -(-E // self.num_devices) + self.redundant_slots
        dpn = topo.devices_per_node
        # Step 1: experts onto nodes (LPT by load per device, capped at each node's share of experts).
        cap_N = [-(-E * k // self.num_devices) for k in dpn]
        node_load = [0.0] * topo.num_nodes
        node_count = [0] * topo.num_nodes
        experts_of_node: list[list[int]] = [[] for _ in dpn]
        for e in np.argsort(-load_E, kind="stable").tolist():
            n = min((node_load[k] / dpn[k], k) for k in range(topo.num_nodes) if node_count[k] < cap_N[k])[1]
            experts_of_node[n].append(e)
            node_load[n] += float(load_E[e])
            node_count[n] += 1
        mask_ED = np.zeros((E, self.num_devices), dtype=bool)
        for n, experts in enumerate(experts_of_node):
            devices = list(topo.devices_of_node(n))
            # Step 2: replicas for the node's spare slots.
            copies = {e: 1 for e in experts}
            spare = len(devices) * slots_per_device - len(experts)
            for _ in range(spare):
                pick = [(-(float(load_E[e]) / copies[e]), e) for e in experts if copies[e] < len(devices)]
                if not pick or min(pick)[0] == 0:
                    break
                copies[min(pick)[1]] += 1
            # Step 3: pack copies onto the node's devices.
            items = sorted(((-(float(load_E[e]) / copies[e]), e) for e in experts for _ in range(copies[e])))
            dev_load = {d: 0.0 for d in devices}
            dev_free = {d: slots_per_device for d in devices}
            for neg_share, e in items:
                fits = [(dev_load[d], d) for d in devices if dev_free[d] > 0 and not mask_ED[e, d]]
                if not fits:
                    continue
                d = min(fits)[1]
                mask_ED[e, d] = True
                dev_load[d] -= neg_share
                dev_free[d] -= 1
        owners_E = np.where(mask_ED[np.arange(E), old_owners_E], old_owners_E, np.argmax(mask_ED, axis=1))
        return mask_ED, owners_E

    def _plan(self, layer: int, iteration: int, predicted_load_E: np.ndarray,
              tokens_ED: np.ndarray) -> PolicyStep:
        migration = 0.0
        if iteration > 0 and iteration % self.interval == 0:
            old, old_shard = self.placements[layer], self.shards[layer]
            mask_ED, owners_E = self._rebalance(predicted_load_E, old_shard.owners())
            new_shard = Placement.from_owners(owners_E, self.num_devices)
            new = Placement(mask_ED)
            new_copies = int((new.mask & ~old.mask).sum())
            moved_owners = int((owners_E != old_shard.owners()).sum())
            migration = new_copies * self.expert_bytes + moved_owners * self.optimizer_state_bytes
            self.placements[layer], self.shards[layer] = new, new_shard
        placement, shard = self.placements[layer], self.shards[layer]
        return self._step(placement, shard, tokens_ED, allreduce=_allreduce_bytes(placement, self.expert_bytes),
                          migration=migration)


# --------------------------------------------------------------------------------------- registry
POLICY_NAMES = ("themis", "themis-rm", "ep", "uniform", "fastermoe", "smartmoe", "flexmoe", "eplb")


def make_policy(name: str, num_layers: int, num_experts: int, topology: Topology, expert_bytes: float = 1.0,
                **kwargs: object) -> Policy:
    """Build a policy by name (one of ``POLICY_NAMES``); ``kwargs`` go to its constructor."""
    classes: dict[str, type[Policy]] = {
        "themis": ThemisPolicy, "themis-rm": ThemisPolicy, "ep": EPPolicy, "uniform": UniformPolicy,
        "fastermoe": FasterMoEPolicy, "smartmoe": SmartMoEPolicy, "flexmoe": FlexMoEPolicy, "eplb": EPLBPolicy,
    }
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")
    if name == "themis-rm":
        kwargs.setdefault("rematerialize", True)
    return classes[name](num_layers, num_experts, topology, expert_bytes, **kwargs)  # type: ignore[arg-type]
