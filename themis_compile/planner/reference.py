"""The readable reference of Alg. 1 (sparse materialization), its calibration (§4.2) and Alg. 3
(topology-aware dispatch, §4.4): the paper's pseudo-code, one rule per line, loops where the paper loops.

This is the definition the planner is held to. The planner's own modules run two faster versions of the
same rules, the vectorised numpy code (`materialize`, `dispatch`) and the compiled core (`_cplan.c`, chosen
by `backend`), and both must give plans bit-identical to these functions on every input
(tests/planner/test_fast_paths.py, tests/planner/test_cplan.py). So the tie-breaks and the floating-point
order here are the planner's contract: every rank and every implementation builds the same plan.

Nothing here is on the training path (it is the slow one: Python loops over experts, devices, replicas).

Legend: E experts, D devices (d source, d2 destination), N nodes, J materializable experts.
"""

from __future__ import annotations

import math

import numpy as np

from themis_compile.planner.cost import PlanCost, fluid_device_load
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

__all__ = ["assign_slots_by_load", "calibrate", "holder_shares", "place_replicas", "sparse_materialization",
           "top_experts", "topology_aware_dispatch"]


# ============================================================================================ Alg. 1
def top_experts(load_E: np.ndarray, t: int) -> np.ndarray:
    """Alg. 1 l.3: the t most loaded experts, ties to the lower id, zero-load experts dropped."""
    top_J = np.argsort(-load_E, kind="stable")[:t]
    return top_J[load_E[top_J] > 0]


def assign_slots_by_load(load_J: np.ndarray, copies_J: np.ndarray, room_J: np.ndarray,
                         total_slots: int) -> np.ndarray:
    """Alg. 1 l.9 (for all experts of J at once): highest averages, one slot at a time — the next slot
    goes to the expert with the largest per-copy load F_j / (copies_j + n_j + 1) that still has room;
    ties to the lower position in J."""
    n_J = np.zeros(load_J.size, dtype=np.int64)
    for _ in range(total_slots):
        best, best_j = 0.0, -1
        for j in range(load_J.size):
            if n_J[j] < room_J[j]:
                quot = float(load_J[j]) / float(copies_J[j] + n_J[j] + 1)
                if quot > best:
                    best, best_j = quot, j
        if best_j < 0:
            break
        n_J[best_j] += 1
    return n_J


def holder_shares(row_D: np.ndarray, load: float, topology: Topology) -> np.ndarray:
    """[D] the load of one expert each of its holders ``row_D`` computes under the fluid model of Alg. 3
    (`cost.fluid_device_load` for one expert): a source's tokens stay on its node when a holder is there
    (split over the node's holders), else spread over all holders."""
    D = row_D.size
    k_N = np.asarray(topology.devices_per_node, dtype=np.float64)
    holders_N = np.bincount(topology.node_ids[row_D], minlength=topology.num_nodes)
    copies = max(int(holders_N.sum()), 1)
    uncovered = float(k_N[holders_N == 0].sum())
    node_term_N = np.divide(k_N, holders_N, out=np.zeros_like(k_N), where=holders_N > 0)
    return (load / D) * (node_term_N[topology.node_ids] + uncovered / copies) * row_D


def place_replicas(mask_ED: np.ndarray, load_E: np.ndarray, experts_J: np.ndarray, slots_D: np.ndarray,
                   topology: Topology) -> None:
    """Alg. 1 l.7-11 in place: replicas of ``experts_J`` (in load order) into the free ``slots_D``.

    Writes ``mask_ED`` and ``slots_D``. An expert takes only as many of its n replicas as lower the
    modeled peak device load (a replica that would not relieve its hottest holder is not placed).
    """
    if experts_J.size == 0 or not slots_D.any():
        return
    N = topology.num_nodes
    node_of = topology.node_ids.tolist()
    k_N = topology.devices_per_node
    copies_E = mask_ED.sum(axis=1)
    dev_load_D = fluid_device_load(Placement(mask_ED), load_E, topology)
    room_J = mask_ED.shape[1] - copies_E[experts_J]
    # l.7, l.9: totSlots = the free slots; n per expert by highest averages.
    n_J = assign_slots_by_load(load_E[experts_J], copies_E[experts_J], room_J, int(slots_D.sum()))
    for e, n in zip(experts_J.tolist(), n_J.tolist()):                        # l.8
        if n == 0:
            continue
        # l.10 candidates: devices without e with a free slot; least loaded, then more slots, then id.
        cand = np.flatnonzero(~mask_ED[e] & (slots_D > 0))
        if cand.size == 0:
            continue
        cand = cand[np.lexsort((-slots_D[cand], dev_load_D[cand]))]
        per_node = [[] for _ in range(N)]
        for d in cand.tolist():
            per_node[node_of[d]].append(d)
        # l.10 "nodes without e first": the node with the fewest holders of e per device, then the
        # least-loaded candidate there, then the lower node id.
        holders_N = np.bincount(topology.node_ids[mask_ED[e]], minlength=N).tolist()
        taken = [0] * N
        sequence = []
        for _ in range(min(n, cand.size)):
            k = min(((holders_N[k] + taken[k]) / k_N[k], float(dev_load_D[per_node[k][taken[k]]]), k)
                    for k in range(N) if taken[k] < len(per_node[k]))[2]
            sequence.append(per_node[k][taken[k]])
            taken[k] += 1
        seq = np.asarray(sequence, dtype=np.int64)
        # Keep the prefix of the sequence that minimizes the modeled peak load (k = 0: place none).
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
        # l.11: P' ← P' ∪ P^e; the modeled loads follow.
        dev_load_D -= holder_shares(mask_ED[e], float(load_E[e]), topology)
        mask_ED[e, chosen] = True
        slots_D[chosen] -= 1
        copies_E[e] += k
        dev_load_D += holder_shares(mask_ED[e], float(load_E[e]), topology)


def sparse_materialization(shard: Placement, load_E: np.ndarray, t: int, m: int, topology: Topology) -> Placement:
    """Alg. 1: the ephemeral placement P' ⊇ P for (predicted) loads ``load_E``, overlap degree t and
    materialization budget m (`materialize.sparse_materialization` without its input checks)."""
    E, D = shard.shape
    t = min(t, E)                                                             # l.1
    m = min(m, t)
    top_J = top_experts(load_E, t)                                            # l.3
    if top_J.size == 0 or m == 0:
        return shard
    mask_ED = shard.mask.copy()                                               # l.2
    if t <= m:                                                                # l.4
        mask_ED[top_J, :] = True                                              # l.5
    else:
        place_replicas(mask_ED, load_E, top_J, np.full(D, m, dtype=np.int64), topology)   # l.6-11
    return Placement(mask_ED)                                                 # l.12


# ============================================================================================ calibration
def calibrate(shard: Placement, materialized: Placement, load_E: np.ndarray, t: int, m: int,
              topology: Topology, cost: PlanCost, tokens_ED: np.ndarray | None = None) -> Placement:
    """§4.2 calibration on the actual loads (`materialize.calibrate` without its input checks).

    Step 1: Alg. 1 again from ``materialized`` with the remaining budget and overlap degree.
    Step 2: adopt the merged placement only when the modeled straggler-time reduction exceeds the extra
    SpAG time and that time fits ``cost.calibration_budget_s``.
    """
    E, D = shard.shape
    t = min(t, E)
    m = min(m, t)
    # Step 1: the remaining budget (slots per device) and overlap degree (new experts allowed).
    added_ED = materialized.mask & ~shard.mask
    slots_D = np.maximum(m - added_ED.sum(axis=0), 0).astype(np.int64)
    replicated_E = added_ED.any(axis=1)
    new_allowed = t - int(replicated_E.sum())
    if not slots_D.any() or new_allowed < 0:
        return materialized
    order_E = np.argsort(-load_E, kind="stable")
    eligible_E = replicated_E.copy()
    eligible_E[order_E[~replicated_E[order_E]][:new_allowed]] = True
    experts_J = order_E[eligible_E[order_E] & (load_E[order_E] > 0)]
    mask_ED = materialized.mask.copy()
    place_replicas(mask_ED, load_E, experts_J, slots_D, topology)
    merged = Placement(mask_ED)
    if merged == materialized:
        return materialized
    # Step 2: the gain must pay for the extra transfer, which must fit the budget.
    extra_s = cost.transfer_time(materialized, merged)
    if extra_s > cost.calibration_budget_s:
        return materialized
    if tokens_ED is not None:
        before_s = cost.compute_time(topology_aware_dispatch(materialized, tokens_ED, topology))
        after_s = cost.compute_time(topology_aware_dispatch(merged, tokens_ED, topology))
    else:
        before_s = cost.fluid_compute_time(materialized, load_E)
        after_s = cost.fluid_compute_time(merged, load_E)
    if before_s - after_s > extra_s and math.isfinite(extra_s):
        return merged
    return materialized


# ============================================================================================ Alg. 3
def topology_aware_dispatch(placement: Placement, tokens_ED: np.ndarray, topology: Topology) -> np.ndarray:
    """Alg. 3 source by source: R[e, d, d2], with `dispatch`'s even split and its rotating remainder."""
    E, D = placement.shape
    mask_ED = placement.mask
    node_of = topology.node_ids
    R_EDD = np.zeros((E, D, D), dtype=np.int64)                               # l.1
    for e in range(E):                                                        # l.2
        holders = np.flatnonzero(mask_ED[e])                                  # l.3
        for d in range(D):
            tokens = int(tokens_ED[e, d])
            if mask_ED[e, d]:                                                 # l.4
                R_EDD[e, d, d] = tokens                                       # l.5
                continue
            local = holders[node_of[holders] == node_of[d]]                   # l.7-8
            targets = local if local.size else holders                        # l.9-12
            if targets.size == 0:
                continue
            q, r = divmod(tokens, targets.size)
            for j, d2 in enumerate(targets.tolist()):
                R_EDD[e, d, d2] = q + (1 if (j - (e + d)) % targets.size < r else 0)
    return R_EDD                                                              # l.13
