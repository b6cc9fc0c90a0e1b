"""A small, pure cost interface for planning (§3.3): compute time of a dispatch plan, transfer time of a
sparse collective and time of the token all-to-all.

The planner needs only a handful of numbers to weigh a placement: the time one expert takes per token,
Ψ (one expert's parameter bytes) and the link bandwidths of the `Topology`. The full, profiled cost
model with the paper's symbolic forms lives in ``themis_compile.cost_model``; it can hand the planner a
`PlanCost` built from its measurements.

This module is the one home of the two communication-time formulas: `sparse_transfer_time` (SpAG /
SpRS) and `all_to_all_time` (the token all-to-all of a dispatch plan). The planner's calibration (§4.2)
weighs its transfers with the first, and the simulator charges both collectives with the same functions,
so what the planner trades off is what the simulator bills.

Legend: E experts, D devices (d = source, d2 = destination), N nodes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from themis_compile.planner.dispatch import DispatchTraffic
from themis_compile.planner.placement import Placement, run_starts, sorted_members
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["PlanCost", "all_to_all_time", "bottleneck_time", "device_compute_load", "fluid_device_load",
           "replicas_pay", "sparse_transfer_time", "straggler_time"]

# A replica's compute saving counts forward and backward (backward ≈ 2× forward); its cost is the SpAG of
# its parameters before the layer and the SpRS of its gradient after it.
COMPUTE_PASSES, TRANSFER_PASSES = 3.0, 2.0


def _check_plan(R_EDD: np.ndarray) -> np.ndarray:
    R_EDD = np.asarray(R_EDD)
    if R_EDD.ndim != 3 or R_EDD.shape[1] != R_EDD.shape[2]:
        raise ValueError(f"a dispatch plan R must have shape [E, D, D], got {R_EDD.shape}")
    return R_EDD


def device_compute_load(R_EDD: np.ndarray) -> np.ndarray:
    """[D] int64: tokens each device computes under plan R (sum over experts and sources)."""
    R_EDD = _check_plan(R_EDD)
    # Experts first (contiguous [D, D] slabs), then sources: exact integer sums, several times faster
    # than one reduction over (0, 1).
    return R_EDD.sum(axis=0, dtype=np.int64).sum(axis=0, dtype=np.int64)


def fluid_device_load(placement: Placement, load_E: np.ndarray, topology: Topology | None = None) -> np.ndarray:
    """[D] float64: modeled tokens each device computes when only per-expert loads are known.

    Sources are taken as uniform (each device originates load_E[e] / D tokens of expert e) and tokens
    follow Alg. 3: a node that holds e keeps its tokens on its own holders, split evenly; tokens of nodes
    without e split evenly over all holders. A holder d of e on node n therefore computes
    ``load_E[e] / D · (k_n / h_en + U_e / c_e)`` with k_n devices on n, h_en holders of e on n, c_e all
    holders and U_e the devices on nodes without e. Without a topology (or on one node) this is the
    plain even split ``load_E[e] / c_e``.

    On several nodes every device's terms are added in ascending expert order (a weighted bincount over
    the (expert, holder) pairs), at any size: the compiled planner core adds them in the same order, so
    both compute the same floats (numpy's column sums over a dense [E, D] array would switch to pairwise
    summation at large E·D, and cost O(E·D) where the pairs are O(E + replicas)).
    """
    load_E = np.asarray(load_E, dtype=np.float64)
    E, D = placement.shape
    if load_E.shape != (E,):
        raise ValueError(f"load must have shape [{E}], got {load_E.shape}")
    copies_E = placement.copy_counts()
    if ((copies_E == 0) & (load_E > 0)).any():
        raise ValueError("an expert with load has no holder in the placement")
    if placement.is_sparse:
        if topology is not None:
            topology.validate(D)
        return _fluid_load_of_pairs(placement.flat_ids(), copies_E, load_E, D, topology)
    mask_ED = placement.mask
    safe_E = np.maximum(copies_E, 1)
    if topology is None or topology.num_nodes == 1:
        return (load_E / safe_E) @ mask_ED
    topology.validate(D)
    # The terms of the (expert, holder) pairs, pairs in ascending expert order.
    N = topology.num_nodes
    k_N = topology.devices_per_node_f
    e_P, d_P = np.nonzero(mask_ED)
    n_P = topology.node_ids[d_P]
    holders_EN = np.bincount(e_P * N + n_P, minlength=E * N).reshape(E, N)
    uncovered_E = ((holders_EN == 0) * k_N).sum(axis=1)
    node_term_EN = np.divide(k_N, holders_EN, out=np.zeros(holders_EN.shape), where=holders_EN > 0)
    per_holder_P = node_term_EN[e_P, n_P] + (uncovered_E / safe_E)[e_P]
    return np.bincount(d_P, weights=(load_E / D)[e_P] * per_holder_P, minlength=D)


def _fluid_load_of_pairs(flat_X: np.ndarray, copies_E: np.ndarray, load_E: np.ndarray, D: int,
                         topology: Topology | None) -> np.ndarray:
    """`fluid_device_load` from the pairs (ascending flat ids), O(|P| + E) with no [E, D] or [E, N] array;
    on several nodes the same floats as the dense form (the same terms, added in the same order). The
    compiled core's calibration from the pairs (``fluid_load_of_pairs`` in ``_cplan.c``) adds the same
    terms in the same order."""
    e_P, d_P = np.divmod(flat_X, D)
    safe_E = np.maximum(copies_E, 1)
    if topology is None or topology.num_nodes == 1:
        return np.bincount(d_P, weights=(load_E / safe_E)[e_P], minlength=D)
    N = topology.num_nodes
    k_N = topology.devices_per_node_f
    n_P = topology.node_ids[d_P]
    key_P = e_P * N + n_P                      # ascending: pairs by expert, then device, nodes are runs
    first_G = run_starts(key_P)
    count_G = np.diff(first_G, append=key_P.size)
    holders_P = np.repeat(count_G, count_G)
    covered_E = np.bincount(e_P[first_G], weights=k_N[n_P[first_G]], minlength=copies_E.size)
    uncovered_E = float(D) - covered_E
    per_holder_P = k_N[n_P] / holders_P + (uncovered_E / safe_E)[e_P]
    return np.bincount(d_P, weights=(load_E / D)[e_P] * per_holder_P, minlength=D)


def straggler_time(device_load_D: np.ndarray, time_per_token_s: float) -> float:
    """Seconds until the slowest device finishes: max_d load_d * time_per_token_s."""
    device_load_D = np.asarray(device_load_D)
    if device_load_D.size == 0:
        return 0.0
    return float(device_load_D.max()) * float(time_per_token_s)


def bottleneck_time(device_bytes_D: np.ndarray, node_bytes_N: np.ndarray, topology: Topology, *,
                    device_bw: float | None = None, inter_node_bw: float | None = None) -> float:
    """Seconds no realization of a collective can beat (§3.3): it finishes no sooner than its busiest
    device link or node link, ``max(max_d bytes_d / device_bw, max_n bytes_n / inter_node_bw)``.

    ``device_bytes_D`` are what each device's link must carry, ``node_bytes_N`` what each node's network
    must carry. Bandwidths (bytes/s) default to the topology's.
    """
    device_bw = topology.intra_node_bw if device_bw is None else float(device_bw)
    inter_node_bw = topology.inter_node_bw if inter_node_bw is None else float(inter_node_bw)
    if not (device_bw > 0 and inter_node_bw > 0):
        raise ValueError(f"bandwidths must be > 0, got device_bw={device_bw}, inter_node_bw={inter_node_bw}")
    device_s = float(np.max(device_bytes_D, initial=0)) / device_bw
    node_s = float(np.max(node_bytes_N, initial=0)) / inter_node_bw
    return max(device_s, node_s)


def sparse_transfer_time(base: Placement, target: Placement, psi: float, topology: Topology, *,
                         device_bw: float | None = None, inter_node_bw: float | None = None) -> float:
    """Lower-bound time of SpAG(base, target) (and of the mirror SpRS(target, base)), §3.3.

    A device that receives r chunks needs r·Ψ/bw_intra; a node that a chunk newly enters needs one
    inter-node transfer per such chunk, Ψ/bw_inter each (then a broadcast inside the node). The
    collective finishes no sooner than its bottleneck device or node (`bottleneck_time`). ``base`` may be
    any placement contained in ``target`` (a shard placement, or a materialized one that calibration
    extends): only the receiving side is fixed by the two placements, since any holder may send.
    """
    topology.validate(target.num_devices)
    if not base.issubset(target):
        raise ValueError("transfer_time: the base placement is not a subset of the target placement")
    # What receive_counts and new_node_entries give, counted directly (one subset check, no
    # intermediate placements); from the pairs where either placement is held as pairs.
    D, N = target.num_devices, topology.num_nodes
    if base.is_sparse or target.is_sparse:
        expert_X, device_X = np.divmod(target.added_over(base), D)
        if not expert_X.size:
            return 0.0
        recv_D = np.bincount(device_X, minlength=D)
        if N == 1:
            entries_N = np.zeros(1, dtype=np.int64)
        else:   # (expert, node) keys ascend with the flat ids: nodes are runs of devices
            base_e, base_d = np.divmod(base.flat_ids(), D)
            keys_X = expert_X * N + topology.node_ids[device_X]
            keys_X = keys_X[run_starts(keys_X)]
            new_X = keys_X[~sorted_members(keys_X, base_e * N + topology.node_ids[base_d])]
            entries_N = np.bincount(new_X % N, minlength=N)
    else:
        recv_D = np.count_nonzero(target.mask & ~base.mask, axis=0)
        if not recv_D.any():
            return 0.0
        entries_N = np.count_nonzero(target.node_mask(topology) & ~base.node_mask(topology), axis=0)
    psi = float(psi)
    return bottleneck_time(recv_D * psi, entries_N * psi, topology, device_bw=device_bw,
                           inter_node_bw=inter_node_bw)


def all_to_all_time(R_EDD: np.ndarray | DispatchTraffic, token_bytes: float, topology: Topology) -> float:
    """Lower-bound time of the token all-to-all of plan R (dispatch direction; combine mirrors it).

    Every device's intra-node ingress and egress over its link (``intra_node_bw``), and with several
    nodes every node's inter-node ingress and egress over the node's network (``inter_node_bw``); the
    slower of the two. Tokens a device routes to itself do not move.

    ``R_EDD``: the dense plan, or its per-device totals (`dispatch.dispatch_traffic`, classified on
    ``topology``'s nodes), which give the same time at any size.
    """
    if isinstance(R_EDD, DispatchTraffic):
        traffic = R_EDD
        topology.validate(traffic.load_D.size)
    else:
        R_EDD = _check_plan(R_EDD)
        topology.validate(R_EDD.shape[1])
        traffic = DispatchTraffic.from_plan(R_EDD, topology)
    t = max(traffic.intra_in_D.max(initial=0), traffic.intra_out_D.max(initial=0)) * token_bytes \
        / topology.intra_node_bw
    if topology.num_nodes > 1:
        offsets = topology.node_offsets[:-1]
        node_in_N = np.add.reduceat(traffic.inter_in_D, offsets)
        node_out_N = np.add.reduceat(traffic.inter_out_D, offsets)
        t = max(t, max(node_in_N.max(), node_out_N.max()) * token_bytes / topology.inter_node_bw)
    return float(t)


def replicas_pay(load_E: np.ndarray, owners_E: np.ndarray, added_X: np.ndarray, cost: "PlanCost") -> bool:
    """Whether the replicas ΔP (flat ids ``e·D + d``) that Alg. 1 chose for the predicted loads ``load_E``
    are worth their transfers: the modeled straggler compute they save (forward and backward, each
    expert's load split evenly over its holders) must exceed the SpAG of their parameters plus the SpRS of
    their gradients (`bottleneck_time` of the chunks each device receives and each node newly gets).

    Alg. 1 replicates the top-t predicted experts whatever the loads; at even loads that only moves work
    between devices and pays two transfers for it. O(E + D + |ΔP|), deterministic: every rank decides alike.
    """
    added_X = np.asarray(added_X, dtype=np.int64)
    if not added_X.size:
        return False
    topology = cost.topology
    D = topology.num_devices
    load_E = np.asarray(load_E, dtype=np.float64)
    owners_E = np.asarray(owners_E, dtype=np.int64)
    e_X, d_X = added_X // D, added_X % D
    share_E = load_E / (1 + np.bincount(e_X, minlength=load_E.size))
    before_D = np.bincount(owners_E, weights=load_E, minlength=D)
    after_D = np.bincount(owners_E, weights=share_E, minlength=D) + np.bincount(d_X, weights=share_E[e_X], minlength=D)
    saving_s = COMPUTE_PASSES * (float(before_D.max()) - float(after_D.max())) * cost.time_per_token_s
    node_D = topology.node_ids
    entering_X = node_D[d_X] != node_D[owners_E[e_X]]
    # A chunk enters each node without its owner once (then spreads inside the node), §3.3.
    entries_N = np.bincount(np.unique(e_X[entering_X] * topology.num_nodes + node_D[d_X[entering_X]])
                            % topology.num_nodes, minlength=topology.num_nodes)
    recv_D = np.bincount(d_X, minlength=D)
    transfer_s = TRANSFER_PASSES * bottleneck_time(recv_D * cost.expert_bytes, entries_N * cost.expert_bytes, topology)
    return saving_s > transfer_s


@dataclass(frozen=True)
class PlanCost:
    """What planning decisions cost, in seconds (§3.3).

    Attributes:
        time_per_token_s: compute time of one token through one expert (forward; the ratio of gain to
            cost is what matters for planning, so forward-only is consistent as long as both sides use it).
        expert_bytes: Ψ, the parameter bytes of one expert (one chunk).
        topology: devices, nodes and bandwidths.
        calibration_budget_s: profiled latency budget that a calibration transfer (§4.2) may add to the
            critical path; ``inf`` means no limit beyond "gain must exceed cost".
    """

    time_per_token_s: float
    expert_bytes: float
    topology: Topology
    calibration_budget_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("time_per_token_s", "expert_bytes"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"PlanCost.{name} must be a finite number >= 0, got {value}")
        if not self.calibration_budget_s >= 0:
            raise ValueError(f"PlanCost.calibration_budget_s must be >= 0, got {self.calibration_budget_s}")

    # ----------------------------------------------------------------------------------- compute
    def compute_time(self, R_EDD: np.ndarray) -> float:
        """Straggler compute time of plan R (the slowest device)."""
        return straggler_time(device_compute_load(R_EDD), self.time_per_token_s)

    def fluid_compute_time(self, placement: Placement, load_E: np.ndarray) -> float:
        """Straggler compute time of the modeled loads of `fluid_device_load` (topology-aware)."""
        return straggler_time(fluid_device_load(placement, load_E, self.topology), self.time_per_token_s)

    # ----------------------------------------------------------------------------------- transfers
    def transfer_time(self, shard: Placement, placement: Placement) -> float:
        """`sparse_transfer_time` of SpAG(shard, placement) with this cost's Ψ and topology."""
        return sparse_transfer_time(shard, placement, self.expert_bytes, self.topology)
