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

Legend: E experts, D devices, N nodes, J materializable experts (the top t).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from themis_compile.planner.cost import PlanCost
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["sparse_materialization", "calibrate", "check_count", "check_loads"]


# --------------------------------------------------------------------------------------- validation
def check_loads(load_E: np.ndarray, num_experts: int, what: str = "load") -> np.ndarray:
    """Return ``load_E`` as float64 [E]; ValueError for a wrong shape, NaN/inf or negative entries."""
    load_E = np.asarray(load_E, dtype=np.float64)
    if load_E.shape != (num_experts,):
        raise ValueError(f"{what} must have shape [{num_experts}] (one entry per expert), got {load_E.shape}")
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
    shard.require_shard_placement("shard")
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
    kmax = int(room_J.max(initial=0))
    if J == 0 or kmax == 0 or total_slots <= 0:
        return np.zeros(J, dtype=np.int64)
    k_K = np.arange(1, kmax + 1, dtype=np.float64)
    quot_JK = load_J[:, None] / (copies_J[:, None] + k_K[None, :])
    quot_JK[k_K[None, :] > room_J[:, None]] = -1.0  # no device left for that copy
    flat = quot_JK.ravel()
    # Stable sort of the negated quotients: ties go to the earlier expert of J (row-major order).
    order = np.argsort(-flat, kind="stable")[:total_slots]
    order = order[flat[order] > 0]
    return np.bincount(order // kmax, minlength=J).astype(np.int64)


def _holder_shares(row_D: np.ndarray, load: float, topology: Topology) -> np.ndarray:
    """[D] modeled tokens of one expert at each of its holders (``row_D``), as in
    `themis_compile.planner.cost.fluid_device_load`: uniform sources, Alg. 3 routing."""
    D = row_D.size
    k_N = np.asarray(topology.devices_per_node, dtype=np.float64)
    holders_N = np.bincount(topology.node_ids[row_D], minlength=topology.num_nodes)
    copies = max(int(holders_N.sum()), 1)
    uncovered = float(k_N[holders_N == 0].sum())
    node_term_N = np.divide(k_N, holders_N, out=np.zeros_like(k_N), where=holders_N > 0)
    return (load / D) * (node_term_N[topology.node_ids] + uncovered / copies) * row_D


def _place_replicas(mask_ED: np.ndarray, load_E: np.ndarray, experts_J: np.ndarray,
                    slots_D: np.ndarray, topology: Topology) -> None:
    """Alg. 1 l.7-11 (the LPT branch), in place on ``mask_ED``; ``slots_D`` is the free replica
    budget of every device (decremented as replicas are placed).

    l.10 concretely: a replica goes to the node with the fewest holders of e per device (so nodes that
    lack e come first and replicas spread over nodes), ties by the load of the node's best candidate,
    then node id; inside the node to the candidate device with the least modeled load, then more free
    slots, then lower id. Candidates hold no copy of e and have a free slot.
    """
    if experts_J.size == 0 or not slots_D.any():
        return
    from themis_compile.planner.cost import fluid_device_load

    N = topology.num_nodes
    node_of = topology.node_ids.tolist()
    k_N = topology.devices_per_node
    copies_E = mask_ED.sum(axis=1)
    dev_load_D = fluid_device_load(Placement._trusted(mask_ED.copy()), load_E, topology)
    # l.9 (for all experts of J at once): replica counts by load.
    room_J = mask_ED.shape[1] - copies_E[experts_J]
    n_J = _assign_slots_by_load(load_E[experts_J], copies_E[experts_J], room_J, int(slots_D.sum()))
    # l.8: experts by load, descending (experts_J is already in that order).
    for e, n in zip(experts_J.tolist(), n_J.tolist()):
        if n == 0:
            continue
        cand = np.flatnonzero(~mask_ED[e] & (slots_D > 0))
        if cand.size == 0:
            continue
        # Candidates ranked by (modeled load, more free slots, id); lexsort is stable, so ids break ties.
        cand = cand[np.lexsort((-slots_D[cand], dev_load_D[cand]))]
        per_node: list[list[int]] = [[] for _ in range(N)]
        for d in cand.tolist():
            per_node[node_of[d]].append(d)
        # l.10: the order replicas would take: the node with the fewest holders of e per device first
        # (nodes lacking e come first, then replicas spread evenly), then that node's best candidate.
        holders_N = np.bincount(topology.node_ids[mask_ED[e]], minlength=N).tolist()
        taken = [0] * N
        sequence: list[int] = []
        for _ in range(min(n, cand.size)):
            k = min(((holders_N[k] + taken[k]) / k_N[k], float(dev_load_D[per_node[k][taken[k]]]), k)
                    for k in range(N) if taken[k] < len(per_node[k]))[2]
            sequence.append(per_node[k][taken[k]])
            taken[k] += 1
        # LPT guard: place the first k of them, k <= n chosen to minimize the hottest device among e's
        # holders (plain even split F_e / copies); k = 0 when no replica cools that device.
        seq = np.asarray(sequence, dtype=np.int64)
        copies = int(copies_E[e])
        share_K = float(load_E[e]) / (copies + np.arange(seq.size + 1))
        hottest = float(dev_load_D[mask_ED[e]].max())
        peak_K = np.maximum(hottest - share_K[0] + share_K,
                            np.concatenate([[-np.inf], np.maximum.accumulate(dev_load_D[seq])]) + share_K)
        peak_K[0] = hottest
        k = int(np.argmin(peak_K))
        if k == 0:
            continue
        chosen = seq[:k]
        # l.11: P' ← P' ∪ P^e; update the modeled load of every holder of e.
        dev_load_D -= _holder_shares(mask_ED[e], float(load_E[e]), topology)
        mask_ED[e, chosen] = True
        slots_D[chosen] -= 1
        copies_E[e] += k
        dev_load_D += _holder_shares(mask_ED[e], float(load_E[e]), topology)


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
    load_E = check_loads(load_E, E)
    t = min(check_count("overlap_degree", overlap_degree), E)          # l.1
    m = min(check_count("materialization_budget", materialization_budget), t)
    top_J = _top_experts(load_E, t)                                      # l.3
    if top_J.size == 0 or m == 0:
        return shard
    mask_ED = shard.mask.copy()                                          # l.2
    if t <= m:                                                           # l.4
        mask_ED[top_J, :] = True                                         # l.5
    else:
        slots_D = np.full(D, m, dtype=np.int64)                          # l.7 (totSlots = D·m)
        _place_replicas(mask_ED, load_E, top_J, slots_D, topology)       # l.8-11
    return Placement._trusted(mask_ED)


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
    the loads split evenly over holders.
    """
    _check_shard(shard, topology)
    E, D = shard.shape
    if not isinstance(materialized, Placement) or materialized.shape != shard.shape:
        raise ValueError("materialized must be a Placement with the shard's shape")
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
    _place_replicas(mask_ED, actual_load_E, experts_J, slots_D, topology)
    merged = Placement._trusted(mask_ED)
    if merged == materialized:
        return materialized
    # Step 2: adopt only when the gain pays for the extra critical-path transfer.
    extra_s = cost.transfer_time(materialized, merged)
    if extra_s > cost.calibration_budget_s:
        return materialized
    if tokens_ED is not None:
        from themis_compile.planner.dispatch import topology_aware_dispatch

        before_s = cost.compute_time(topology_aware_dispatch(materialized, tokens_ED, topology))
        after_s = cost.compute_time(topology_aware_dispatch(merged, tokens_ED, topology))
    else:
        before_s = cost.fluid_compute_time(materialized, actual_load_E)
        after_s = cost.fluid_compute_time(merged, actual_load_E)
    if before_s - after_s > extra_s and math.isfinite(extra_s):
        logger.debug("calibration adopted: %.3g s -> %.3g s for %.3g s of transfer", before_s, after_s, extra_s)
        return merged
    return materialized
