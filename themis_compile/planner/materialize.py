"""Alg. 1 sparse materialization and its calibration stage (§4.2).

Given the shard placement P of one MoE layer and its (predicted) expert loads F, choose the ephemeral
placement P' ⊇ P that SparseAllGather materializes for this iteration, under two caps:

* the overlap degree t: at most t distinct experts get replicas (so the collective fits the attention
  window, t = ⌊T_attn·bw/Ψ⌋);
* the materialization budget m: at most m added replicas per device (spare memory).

Pseudo-code (Alg. 1, with this module's concrete choices in brackets)::

    1  t ← min(t, |E|); m ← min(m, t)
    2  P' ← P
    3  E_topT ← top t experts by load F            [ties: lower expert id; zero-load experts dropped]
    4  if t ≤ m:
    5      P' ← P' ∪ (E_topT × D)                  [every device holds every top expert]
    6  else:
    7      totSlots ← |D|·m
    8      for e in E_topT by load, descending:
    9          n ← assignSlotsByLoad(e, totSlots, F)
                                                   [highest-averages apportionment: the next slot always
                                                    goes to the expert with the largest per-copy load
                                                    F_e / copies_e — LPT over replica "pieces"]
    10         P^e ← n replicas of e: nodes without e first, then devices by available slots
                                                   [candidates: devices without e and with a free slot;
                                                    node with the fewest holders of e per device first
                                                    (nodes lacking e come first, then replicas spread
                                                    evenly); inside it the least-loaded candidate (the
                                                    modeled load of `cost.fluid_device_load`), then
                                                    more free slots, then lower id]
    11         P' ← P' ∪ P^e
    12 return P'

A device never receives two copies of an expert (P' is a set). Everything is ordered by integer keys or
by floats computed in one fixed order, so every rank and every process builds the same plan.

Backends: the compiled core (``_cplan``, see `planner/backend.py`) runs l.3-11 when it is built,
and calibration in one call (both steps: with token counts, or from the pairs under the fluid model);
the numpy code below is its reference and the fallback (``THEMIS_PLANNER_NUMPY=1`` forces it). Both
make the same floating-point operations in the same order, so they build the same plans and take the
same decisions bit for bit.

Legend: E experts, D devices, N nodes, J materializable experts (the top t).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from themis_compile.planner.backend import compiled_core
from themis_compile.planner.cost import PlanCost, fluid_device_load, straggler_time
from themis_compile.planner.dispatch import dispatch_device_load
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["sparse_materialization", "materialize_pairs", "calibrate", "check_count", "check_loads"]


# --------------------------------------------------------------------------------------- validation
def check_loads(load_E: np.ndarray, num_experts: int, what: str = "load") -> np.ndarray:
    """Return ``load_E`` as float64 [E]; ValueError for a wrong shape, NaN/inf or negative entries."""
    load_E = np.asarray(load_E, dtype=np.float64)
    if load_E.shape != (num_experts,):
        raise ValueError(f"{what} must have shape [{num_experts}] (one entry per expert), got {load_E.shape}")
    # Fast accept (two reductions; NaN fails both comparisons); anything else gets the precise checks.
    if num_experts and load_E.min() >= 0 and load_E.max() < math.inf:
        return load_E
    if not np.isfinite(load_E).all():
        raise ValueError(f"{what} contains NaN or infinite entries")
    if (load_E < 0).any():
        raise ValueError(f"{what} contains negative entries (expert {int(np.flatnonzero(load_E < 0)[0])})")
    return load_E


def check_count(name: str, value: int) -> int:
    """Return ``value`` as int; ValueError unless it is an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_shard(shard: Placement, topology: Topology) -> None:
    if not isinstance(shard, Placement):
        raise ValueError(f"shard must be a Placement, got {type(shard).__name__}")
    shard.require_shard_placement("shard")       # cached on the (immutable) placement
    topology.validate(shard.num_devices)


def _top_experts(load_E: np.ndarray, t: int) -> np.ndarray:
    """Alg. 1 l.3: the top-t experts by load, descending, ties by lower id; zero-load experts dropped
    (a replica of an idle expert balances nothing)."""
    order_E = np.argsort(-load_E, kind="stable")
    top_J = order_E[:t]
    return top_J[load_E[top_J] > 0]


# --------------------------------------------------------------------------------------- Alg. 1 core
def _assign_slots_by_load(load_J: np.ndarray, copies_J: np.ndarray, room_J: np.ndarray,
                          total_slots: int) -> np.ndarray:
    """Alg. 1 l.9 for all experts at once: how many replicas each of J experts gets.

    Highest-averages apportionment of ``total_slots``: slot after slot goes to the expert whose
    per-copy load ``load / copies`` is largest (ties: earlier expert in J, i.e. higher load / lower id),
    never more than ``room_J`` (devices that do not hold the expert yet). This minimizes the largest
    per-copy load — the LPT view of an expert split into equal pieces.
    """
    J = load_J.size
    # A row's quotients strictly decrease, so none beyond the total_slots-th of a row can be chosen.
    kmax = min(int(room_J.max(initial=0)), total_slots)
    if J == 0 or kmax <= 0:
        return np.zeros(J, dtype=np.int64)
    k_K = np.arange(1, kmax + 1, dtype=np.float64)
    neg_quot_JK = (-load_J)[:, None] / (copies_J[:, None] + k_K)     # -load / copies, exactly negated
    neg_quot_JK[k_K > room_J[:, None]] = 1.0                         # no device left for that copy
    flat = neg_quot_JK.ravel()
    # Stable sort of the negated quotients: ties go to the earlier expert of J (row-major order).
    order = np.argsort(flat, kind="stable")[:total_slots]
    order = order[flat[order] < 0]
    return np.bincount(order // kmax, minlength=J).astype(np.int64, copy=False)


def _shard_device_load(owners_E: np.ndarray, load_E: np.ndarray, topology: Topology) -> np.ndarray:
    """[D] `cost.fluid_device_load` of the shard placement ``owners_E``, bit for bit, in O(E).

    With one holder on node n the model's per-holder factor is ``k_n / 1 + (D - k_n) / 1`` = D exactly
    (small integers), and the model adds every device's terms in ascending expert order, as a weighted
    bincount does. On one node (the model is a matrix product there) the model itself is called.
    """
    D = topology.num_devices
    if topology.num_nodes == 1:
        return fluid_device_load(Placement.from_owners(owners_E, D), load_E, topology)
    return np.bincount(owners_E, weights=(load_E / D) * float(D), minlength=D)


def _place_replicas(mask_ED: np.ndarray, load_E: np.ndarray, experts_J: np.ndarray,
                    slots_D: np.ndarray, topology: Topology, copies_E: np.ndarray,
                    owners_E: np.ndarray | None = None) -> None:
    """Alg. 1 l.7-11 (the LPT branch), in place on ``mask_ED``; ``slots_D`` is the free replica
    budget of every device (decremented as replicas are placed) and ``copies_E`` the holder count of
    every expert (incremented likewise). ``owners_E``: when ``mask_ED`` is the shard placement itself,
    its owners (saves modeling the initial loads from the mask).

    l.10 concretely: a replica goes to the node with the fewest holders of e per device (so nodes that
    lack e come first and replicas spread over nodes), ties by the load of the node's best candidate,
    then node id; inside the node to the candidate device with the least modeled load, then more free
    slots, then lower id. Candidates hold no copy of e and have a free slot.

    Implementation (one expert = a fixed number of O(D) numpy calls, no loop over replicas): devices
    are sorted by (node, not a candidate, modeled load, more free slots, id), which lays out every
    node's candidates in l.10's order at fixed positions ``node_offsets[n] + j``. The node-by-node
    greedy of l.10 merges these per-node streams, whose keys ``((holders_n + j) / k_n, load, n)``
    strictly increase along each stream, so its first n picks are the n smallest keys: one more
    lexsort. The modeled loads (`cost.fluid_device_load`) change only at e's holders; they are updated
    there, in Python floats, with the model's own floating-point operations.
    """
    if experts_J.size == 0 or not slots_D.any():
        return
    core = compiled_core()
    if core is not None:
        # Same initial modeled loads as below (None: the core sums the model's pairs itself, in the
        # model's order); the compiled loop then makes the same float operations.
        if owners_E is not None:
            dev_load_D = np.ascontiguousarray(_shard_device_load(owners_E, load_E, topology))
        elif _bincount_is_the_model(mask_ED.shape[0], topology):
            dev_load_D = None
        else:
            dev_load_D = fluid_device_load(Placement.adopt(mask_ED.copy()), load_E, topology)
        core.place_replicas(topology.core_layout, mask_ED, np.ascontiguousarray(load_E, dtype=np.float64),
                            np.ascontiguousarray(experts_J, dtype=np.int64), slots_D, copies_E, dev_load_D,
                            None if owners_E is None else np.ascontiguousarray(owners_E, dtype=np.int64))
        return
    D = mask_ED.shape[1]
    N = topology.num_nodes
    total_devices = topology.num_devices
    node_D = topology.node_ids
    node_of = node_D.tolist()
    k_list = topology.devices_per_node
    rank_D = topology.local_ranks
    k_D = None if topology.is_uniform else topology.devices_per_node_f[node_D]
    single_level_ND = topology.single_holder_levels                 # [N, D] levels for one holder on n
    # Each expert's row is untouched until its turn, so with a shard placement its holder is its owner.
    owner_of = None if owners_E is None else owners_E.tolist()
    copies_J = copies_E[experts_J]
    if owners_E is not None:
        dev_load = _shard_device_load(owners_E, load_E, topology).tolist()
    else:
        dev_load = fluid_device_load(Placement.adopt(mask_ED.copy()), load_E, topology).tolist()
    # l.9 (for all experts of J at once): replica counts by load.
    n_J = _assign_slots_by_load(load_E[experts_J], copies_J, D - copies_J, int(slots_D.sum()))
    neg_slots_D = -slots_D                             # sort key "more free slots first"; >= 0: full
    # An expert's row is untouched until its turn: "neg_slots >= threshold" then says "no free slot, or
    # holds e" in one comparison (a holder's threshold is below any slot count).
    threshold_JD = np.where(mask_ED[experts_J], -2 ** 62, 0)
    # l.8: experts by load, descending (experts_J is already in that order).
    for i, (e, n, copies) in enumerate(zip(experts_J.tolist(), n_J.tolist(), copies_J.tolist())):
        if n == 0:
            continue
        row_D = mask_ED[e]
        # Not a candidate: no free slot, or holds e (as uint8: numpy sorts bool keys more slowly).
        blocked_D = (neg_slots_D >= threshold_JD[i]).view(np.uint8)
        num_cand = D - int(np.count_nonzero(blocked_D))
        if num_cand == 0:
            continue
        holders = [owner_of[e]] if owner_of is not None else np.flatnonzero(row_D).tolist()
        holders_N = [0] * N
        for d in holders:
            holders_N[node_of[d]] += 1
        # Every node's candidates in l.10's inner order (load, more free slots, id), at positions
        # node_offsets[n] + j; sorted position p therefore lies on node node_D[p] with rank rank_D[p].
        load_D = np.array(dev_load)
        order_D = np.lexsort((neg_slots_D, load_D, blocked_D, node_D))
        load_P = load_D[order_D]
        if len(holders) == 1:                                    # holders_n + j
            level_P = single_level_ND[node_of[holders[0]]]
        else:
            level_P = np.array(holders_N)[node_D] + rank_D
        if k_D is not None:   # one k for all nodes orders like the integer holders_n + j
            level_P = level_P / k_D
        # l.10: the order replicas would take: the node with the fewest holders of e per device first
        # (nodes lacking e come first, then replicas spread evenly), then that node's best candidate.
        pick_S = np.lexsort((node_D, load_P, level_P, blocked_D[order_D]))[:min(n, num_cand)]
        seq_S = order_D[pick_S]
        # LPT guard: place the first k of them, k <= n chosen to minimize the hottest device among e's
        # holders (plain even split F_e / copies); k = 0 when no replica cools that device. The peak
        # after j replicas is max(hottest - share_0, max load of the first j) + share_j; once that
        # bound with the smallest share cannot beat the best, no later j can (rounding is monotone).
        load_e = float(load_E[e])
        hottest = dev_load[holders[0]]
        for d in holders:
            if dev_load[d] > hottest:
                hottest = dev_load[d]
        base = hottest - load_e / copies
        share_last = load_e / (copies + pick_S.size)
        best, k, run = hottest, 0, -math.inf
        for j, x in enumerate(load_P[pick_S].tolist(), start=1):
            if x > run:
                run = x
            top = run if run > base else base     # max(base + s, run + s) = max(base, run) + s
            if top + share_last >= best:
                break
            peak = top + load_e / (copies + j)
            if peak < best:
                best, k = peak, j
        if k == 0:
            continue
        chosen = seq_S[:k]
        # l.11: P' ← P' ∪ P^e; update the modeled load of every holder of e (cost.fluid_device_load:
        # load/D · (k_n / h_n + U / c) at a holder on node n, U = devices on nodes without e).
        per_device = load_e / D
        uncovered = total_devices
        for kn, h in zip(k_list, holders_N):
            if h:
                uncovered -= kn
        term = uncovered / copies
        for d in holders:
            nd = node_of[d]
            dev_load[d] = dev_load[d] - per_device * (k_list[nd] / holders_N[nd] + term)
        row_D[chosen] = True
        neg_slots_D[chosen] += 1
        chosen_list = chosen.tolist()
        for d in chosen_list:
            nd = node_of[d]
            if not holders_N[nd]:
                uncovered -= k_list[nd]
            holders_N[nd] += 1
        holders += chosen_list
        copies_E[e] = copies + k
        term = uncovered / (copies + k)
        for d in holders:
            nd = node_of[d]
            dev_load[d] = dev_load[d] + per_device * (k_list[nd] / holders_N[nd] + term)
    slots_D[:] = -neg_slots_D


# --------------------------------------------------------------------------------------- public API
def sparse_materialization(shard: Placement, load_E: np.ndarray, overlap_degree: int,
                           materialization_budget: int, topology: Topology) -> Placement:
    """Alg. 1: the ephemeral placement P' ⊇ shard for one MoE layer and iteration.

    Args:
        shard: the layer's shard placement P (exactly one owner per expert).
        load_E: [E] predicted tokens per expert (>= 0).
        overlap_degree: t >= 0, the most distinct experts that get replicas.
        materialization_budget: m >= 0, the most replicas added to any one device.
        topology: must have D = shard.num_devices devices.

    Returns:
        P' with P ⊆ P', at most m added replicas per device and at most t experts replicated.
    """
    _check_shard(shard, topology)
    E, D = shard.shape
    core = compiled_core()
    if core is not None:
        return _materialize_compiled(core, shard, load_E, overlap_degree, materialization_budget, topology)
    load_E = check_loads(load_E, E)
    t = min(check_count("overlap_degree", overlap_degree), E)          # l.1
    m = min(check_count("materialization_budget", materialization_budget), t)
    top_J = _top_experts(load_E, t)                                      # l.3
    if top_J.size == 0 or m == 0:
        return shard
    mask_ED = shard.mask.copy()                                          # l.2
    copies_E = np.ones(E, dtype=np.int64)
    if t <= m:                                                           # l.4
        mask_ED[top_J, :] = True                                         # l.5
        copies_E[top_J] = D
    else:
        slots_D = np.full(D, m, dtype=np.int64)                          # l.7 (totSlots = D·m)
        _place_replicas(mask_ED, load_E, top_J, slots_D, topology, copies_E, shard.owners())   # l.8-11
    return Placement.adopt(mask_ED, copies_E)


def _materialize_compiled(core, shard: Placement, load_E: np.ndarray, overlap_degree: int,
                          materialization_budget: int, topology: Topology) -> Placement:
    """`sparse_materialization` through the compiled core (the shard is already checked): l.1-11 in one
    call, filling a copy of the shard mask and the holder counts in place."""
    E, D = shard.shape
    if type(load_E) is np.ndarray and load_E.dtype == np.float64 and load_E.shape == (E,):
        load_C = load_E if load_E.flags.c_contiguous else np.ascontiguousarray(load_E)
    else:
        load_C = np.ascontiguousarray(check_loads(load_E, E))
    try:
        t = min(check_count("overlap_degree", overlap_degree), E)      # l.1
        m = min(check_count("materialization_budget", materialization_budget), t)
    except ValueError:
        check_loads(load_E, E)                                           # bad loads are reported first
        raise
    mask_ED = shard.mask.copy()                                      # l.2
    copies_E = np.empty(E, dtype=np.int64)                               # the core writes ones first
    dev_load_D = None    # l.10's initial modeled loads: the core's bincount where that is the model's sum
    if t > m and m and not _bincount_is_the_model(E, topology):
        dev_load_D = np.ascontiguousarray(_shard_device_load(shard.owners(), load_C, topology))
    done = core.materialize(topology.core_layout, shard.owners(), load_C, t, m, mask_ED, copies_E, dev_load_D)
    if done < 0:
        check_loads(load_E, E)                                           # raises the precise ValueError
        raise AssertionError("compiled Alg. 1 rejected loads that pass validation")
    if done == 0:                                                        # no top expert, or m = 0
        return shard
    return Placement.adopt(mask_ED, copies_E)


def _bincount_is_the_model(num_experts: int, topology: Topology) -> bool:
    """Whether `_shard_device_load` takes its bincount branch (which the compiled core reproduces): on
    several nodes, at any number of experts."""
    return topology.num_nodes > 1


def calibrate(shard: Placement, materialized: Placement, actual_load_E: np.ndarray,
              overlap_degree: int, materialization_budget: int, topology: Topology, cost: PlanCost,
              tokens_ED: np.ndarray | None = None) -> Placement:
    """The calibration stage of §4.2, run after the gate produced the actual loads.

    Step 1: re-run Alg. 1 on the actual loads from ``materialized`` with the remaining budget (m minus
    the replicas each device already added) and the remaining overlap degree (already-materialized
    experts plus at most ``t - |materialized experts|`` new ones), merging into ``materialized``.
    Step 2: adopt the merged placement only when the modeled straggler-time reduction exceeds the extra
    SpAG time and that time fits ``cost.calibration_budget_s``; otherwise keep ``materialized``.

    The compute time is modeled from ``tokens_ED`` through Alg. 3 when given (exact dispatch), else from
    the loads split evenly over holders. With token counts and the compiled core both steps run in one
    core call (`_calibrate_compiled`); the numpy code below is its reference.
    """
    _check_shard(shard, topology)
    E, D = shard.shape
    if not isinstance(materialized, Placement) or materialized.shape != shard.shape:
        raise ValueError("materialized must be a Placement with the shard's shape")
    core = compiled_core()
    if core is None or tokens_ED is not None or not (shard.is_sparse or materialized.is_sparse):
        if _nothing_to_calibrate(shard, materialized, overlap_degree, materialization_budget):
            return materialized
    else:
        calibrated = _calibrate_pairs(core, shard, materialized, actual_load_E, overlap_degree,
                                      materialization_budget, topology, cost)
        if calibrated is not None:
            return calibrated
    if core is not None and tokens_ED is not None:       # the core also checks P ⊆ P'
        calibrated = _calibrate_compiled(core, shard, materialized, actual_load_E, overlap_degree,
                                         materialization_budget, topology, cost, tokens_ED)
        if calibrated is not None:
            return calibrated
    if not shard.issubset(materialized):
        raise ValueError("materialized placement does not contain the shard placement (P ⊄ P')")
    actual_load_E = check_loads(actual_load_E, E, "actual_load_E")
    t = min(check_count("overlap_degree", overlap_degree), E)
    m = min(check_count("materialization_budget", materialization_budget), t)
    # Step 1: remaining budget and remaining overlap degree.
    added_ED = materialized.mask & ~shard.mask
    slots_D = np.maximum(m - added_ED.sum(axis=0), 0).astype(np.int64)
    replicated_E = added_ED.any(axis=1)
    new_allowed = t - int(replicated_E.sum())
    if not slots_D.any() or new_allowed < 0:
        return materialized
    order_E = np.argsort(-actual_load_E, kind="stable")
    fresh = order_E[~replicated_E[order_E]][:new_allowed]
    eligible_E = replicated_E.copy()
    eligible_E[fresh] = True
    experts_J = order_E[eligible_E[order_E] & (actual_load_E[order_E] > 0)]
    mask_ED = materialized.mask.copy()
    copies_E = materialized.copy_counts().copy()
    _place_replicas(mask_ED, actual_load_E, experts_J, slots_D, topology, copies_E)
    merged = Placement.adopt(mask_ED, copies_E)
    if merged == materialized:
        return materialized
    # Step 2: adopt only when the gain pays for the extra critical-path transfer.
    extra_s = cost.transfer_time(materialized, merged)
    if extra_s > cost.calibration_budget_s:
        return materialized
    if tokens_ED is not None:
        # cost.compute_time of the Alg. 3 plans, from their device loads alone (same integers).
        before_s = straggler_time(dispatch_device_load(materialized, tokens_ED, topology), cost.time_per_token_s)
        after_s = straggler_time(dispatch_device_load(merged, tokens_ED, topology), cost.time_per_token_s)
    else:
        before_s = cost.fluid_compute_time(materialized, actual_load_E)
        after_s = cost.fluid_compute_time(merged, actual_load_E)
    if before_s - after_s > extra_s and math.isfinite(extra_s):
        logger.debug("calibration adopted: %.3g s -> %.3g s for %.3g s of transfer", before_s, after_s, extra_s)
        return merged
    return materialized


def _nothing_to_calibrate(shard: Placement, materialized: Placement, overlap_degree: Any,
                          materialization_budget: Any) -> bool:
    """Step 1's first exit, read from the pairs (O(E + |ΔP|), no [E, D] matrix): every device has used
    its budget m, or the overlap degree t is spent. False where the inputs are for the checks below to
    judge (bad counts, P ⊄ P')."""
    if type(overlap_degree) is not int or type(materialization_budget) is not int or overlap_degree < 0 \
            or materialization_budget < 0 or not shard.issubset(materialized):
        return False
    slots_D, _, new_allowed = _remaining_budget(shard, materialized, overlap_degree, materialization_budget)
    return new_allowed < 0 or not slots_D.any()


def _remaining_budget(shard: Placement, materialized: Placement, overlap_degree: int,
                      materialization_budget: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Step 1's remaining budget from the pairs: ``(slots_D, replicated_E, new_allowed)`` — the replicas
    each device may still add (m less those ΔP gave it), the experts ΔP replicates, and how many more
    experts the overlap degree t allows."""
    E, D = shard.shape
    t = min(overlap_degree, E)
    m = min(materialization_budget, t)
    expert_X, device_X = np.divmod(materialized.added_over(shard), D)
    slots_D = np.maximum(m - np.bincount(device_X, minlength=D), 0).astype(np.int64)
    replicated_E = np.zeros(E, dtype=np.bool_)
    replicated_E[expert_X] = True
    return slots_D, replicated_E, t - int(np.count_nonzero(replicated_E))


def _calibrate_pairs(core, shard: Placement, materialized: Placement, actual_load_E: np.ndarray,
                     overlap_degree: Any, materialization_budget: Any, topology: Topology,
                     cost: PlanCost) -> Placement | None:
    """`calibrate` with the fluid compute model (loads split over holders, `cost.fluid_device_load`) from
    the pairs, both steps in one compiled call (``_cplan.calibrate_pairs``): l.8-11 on the rows of the
    J <= t experts it may extend, the transfer of the new pairs, both placements' fluid loads —
    O(|P'| + t·D), never an [E, D] matrix (the runtime's path; 1,024 ranks: 4 MB per placement
    otherwise). The same decisions as the numpy code below with ``tokens_ED=None``. None where that code
    must judge instead (checks it makes, a `PlanCost` subclass, inputs the core declines)."""
    if type(cost) is not PlanCost or type(overlap_degree) is not int or type(materialization_budget) is not int \
            or overlap_degree < 0 or materialization_budget < 0:
        return None
    E, D = shard.shape
    load_E = actual_load_E
    if type(load_E) is not np.ndarray or load_E.shape != (E,) or load_E.dtype.kind not in "fiu":
        return None
    if load_E.dtype != np.float64 or not load_E.flags.c_contiguous:
        load_E = np.ascontiguousarray(load_E, dtype=np.float64)
    flat_P = materialized.flat_ids()
    m = min(materialization_budget, overlap_degree, E)
    added_X = np.empty(m * D, dtype=np.int64)
    copies_E = np.empty(E, dtype=np.int64)
    cost_topology = cost.topology
    code, added, before_s, after_s, extra_s = core.calibrate_pairs(
        topology.core_layout, cost_topology.core_layout, shard.owners(), flat_P, load_E, overlap_degree,
        materialization_budget, float(cost.expert_bytes), cost_topology.intra_node_bw, cost_topology.inter_node_bw,
        float(cost.calibration_budget_s), float(cost.time_per_token_s), added_X, copies_E)
    if code == 1:
        logger.debug("calibration adopted: %.3g s -> %.3g s for %.3g s of transfer", before_s, after_s, extra_s)
        return materialized.extended(added_X[:added], copies_E)     # it remembers P'' \ P' (and \ P)
    return materialized if code == 0 else None


def _calibrate_compiled(core, shard: Placement, materialized: Placement, actual_load_E: np.ndarray,
                        overlap_degree: int, materialization_budget: int, topology: Topology, cost: PlanCost,
                        tokens_ED: np.ndarray) -> Placement | None:
    """`calibrate` with the Alg. 3 compute model through the compiled core: both steps in one call,
    the merged mask and holder counts written into arrays allocated here. The shard and the
    materialized placement's type and shape are already checked.

    Returns None where the numpy code must decide instead: inputs of other types (a `PlanCost`
    subclass, a budget that is not a float, token counts that are not an int64 [E, D] array, loads that
    are not a numeric [E] array), or inputs the core declines (bad loads or counts, P ⊄ P', negative
    token counts, a cost topology of another size); the numpy code then gives the result or raises the
    precise ValueError, at the point where it would.
    """
    E, D = shard.shape
    if (type(cost) is not PlanCost or type(cost.calibration_budget_s) is not float
            or type(tokens_ED) is not np.ndarray or tokens_ED.dtype != np.int64 or tokens_ED.shape != (E, D)
            or type(actual_load_E) is not np.ndarray or actual_load_E.shape != (E,)
            or actual_load_E.dtype.kind not in "fiu"):
        return None
    t, m = overlap_degree, materialization_budget
    if not (type(t) is int and type(m) is int and t >= 0 and m >= 0):
        try:
            t, m = check_count("overlap_degree", t), check_count("materialization_budget", m)
        except ValueError:
            return None
    t = min(t, E)
    m = min(m, t)
    # The core reads float64 loads, or int64 loads that it converts as check_loads does (the runtime's
    # loads are int64 sums of the counts).
    load_C = actual_load_E
    if load_C.dtype != np.float64 and load_C.dtype != np.int64 or not load_C.flags.c_contiguous:
        load_C = np.ascontiguousarray(load_C, dtype=np.float64)
    dev_load_D = None    # l.10's starting loads: the core's own pair sum where that is the model's sum
    if not _bincount_is_the_model(E, topology):
        load_C = np.ascontiguousarray(load_C, dtype=np.float64)
        try:
            dev_load_D = np.ascontiguousarray(fluid_device_load(materialized, load_C, topology))
        except ValueError:
            return None
    mask_ED = np.empty((E, D), dtype=np.bool_)
    copies_E = np.empty(E, dtype=np.int64)
    cost_topology = cost.topology
    code, before_s, after_s, extra_s = core.calibrate(
        topology.core_layout, cost_topology.core_layout, shard.mask, materialized.mask, load_C,
        load_C.dtype == np.int64, t, m, tokens_ED, dev_load_D, cost.expert_bytes, cost_topology.intra_node_bw,
        cost_topology.inter_node_bw, cost.calibration_budget_s, cost.time_per_token_s, mask_ED, copies_E)
    if code == 1:
        logger.debug("calibration adopted: %.3g s -> %.3g s for %.3g s of transfer", before_s, after_s, extra_s)
        return Placement.adopt(mask_ED, copies_E)
    return materialized if code == 0 else None


# --------------------------------------------------------------------------------------- sparse form
def materialize_pairs(shard: Placement, load_E: np.ndarray, overlap_degree: int, materialization_budget: int,
                      topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 1 in sparse form: P' of `sparse_materialization` as ``(full_J, replicas_X)``, int64, both
    ascending: the experts every device holds in P' (none on one device), and the other added replicas
    ΔP as flat ids ``e·D + d``. P' = shard ∪ (full_J × D) ∪ replicas_X, bit for bit.

    With the compiled core it is built from the shard's owners without an [E, D] mask (O(E + t·D) and
    O(E) in the "top-t everywhere" branch; at 1,024 devices the mask alone is 4 MB), for callers that
    keep P' sparse (`dispatch.own_row_entries`).
    """
    _check_shard(shard, topology)
    E, D = shard.shape
    core = compiled_core()
    if core is not None:
        load_C = np.ascontiguousarray(check_loads(load_E, E))
        t = min(check_count("overlap_degree", overlap_degree), E)
        m = min(check_count("materialization_budget", materialization_budget), t)
        full_J = np.empty(max(t, 1), dtype=np.int64)
        pairs_X = np.empty(max(m * D, 1) if t > m else 1, dtype=np.int64)
        copies_E = np.empty(E, dtype=np.int64)
        counts = core.materialize_pairs(topology.core_layout, shard.owners(), load_C, t, m, full_J, pairs_X,
                                        copies_E)
        if counts is None:
            raise AssertionError("compiled Alg. 1 rejected loads that pass validation")
        return full_J[:counts[0]], pairs_X[:counts[1]]
    placed = sparse_materialization(shard, load_E, overlap_degree, materialization_budget, topology)
    added_ED = placed.mask & ~shard.mask
    full_E = (placed.copies() == D) & added_ED.any(axis=1)
    added_ED[full_E] = False
    return np.flatnonzero(full_E).astype(np.int64, copy=False), np.flatnonzero(added_ED).astype(np.int64, copy=False)
