"""The costs every policy is charged with: `LayerCost`, what one MoE layer costs in one iteration, and
`Coster`, the collective times beyond the planner's own formulas (data-parallel and replica AllReduce,
migration of persistent state). The all-to-all and sparse-collective times are `planner.cost`'s."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from themis_compile.sim.setup import SimSetup

__all__ = ["LayerCost", "Coster"]


@dataclass
class LayerCost:
    """Seconds one MoE layer costs one policy in one iteration (the engine's timeline reads these)."""

    a2a_s: float = 0.0             # one all-to-all (each of the four per layer)
    comp_mean_s: float = 0.0       # forward expert compute, representative (mean) device
    comp_max_s: float = 0.0        # forward expert compute, straggler
    spag_s: float = 0.0            # predicted SparseAllGather (overlapped with attention forward)
    calib_s: float = 0.0           # calibration SpAG (critical path)
    sprs_s: float = 0.0            # SparseReduceScatter (overlapped with attention backward)
    remat_s: float = 0.0           # re-materialization SpAG (Themis-RM)
    bcast_s: float = 0.0           # FasterMoE shadow broadcast (critical path)
    reduce_s: float = 0.0          # FasterMoE shadow gradient reduce (critical path)
    replica_ar_s: float = 0.0      # AllReduce of persistent replicas' gradients (Eq. 5)
    a2a_bytes: int = 0
    a2a_inter_bytes: int = 0


class Coster:
    """The collective times of `engine` beyond `planner.cost`: AllReduces and migrations of a setup."""

    def __init__(self, setup: SimSetup) -> None:
        self.setup = setup
        self.topo = setup.topology()
        self.intra_bw = setup.cluster.effective_intra_bw
        self.inter_bw = setup.cluster.effective_inter_bw
        self.offsets = self.topo.node_offsets[:-1]
        self.multi_node = self.topo.num_nodes > 1
        self.grad_psi = setup.expert_params * setup.precision.grad_bytes

    def replica_allreduce_time(self, placement_mask_ED: np.ndarray) -> float:
        """Bottleneck device time of the per-iteration AllReduce of replicated experts (Eq. 5)."""
        copies_E = placement_mask_ED.sum(axis=1)
        rep_E = copies_E > 1
        if not rep_E.any():
            return 0.0
        mask_XD = placement_mask_ED[rep_E]
        nodes_X = np.logical_or.reduceat(mask_XD, self.offsets, axis=1).sum(axis=1)
        per_dev_inter = self.inter_bw / self.setup.cluster.devices_per_node
        bw_X = np.where(nodes_X > 1, per_dev_inter, self.intra_bw)
        c_X = copies_E[rep_E]
        per_X = 2.0 * (c_X - 1) / c_X * self.grad_psi / bw_X
        return float((mask_XD * per_X[:, None]).sum(axis=0).max())

    def allreduce_time(self, nbytes: float) -> float:
        """Hierarchical ring AllReduce of ``nbytes`` over all devices (data parallelism)."""
        if nbytes <= 0:
            return 0.0
        k, N = self.setup.cluster.devices_per_node, self.topo.num_nodes
        t = 2.0 * (k - 1) / k * nbytes / self.intra_bw
        if N > 1:
            t += 2.0 * (N - 1) / N * nbytes / self.inter_bw
        return t + self.setup.cluster.collective_latency_s

    def migration_time(self, nbytes: float, new_copies_LED: list[np.ndarray]) -> float:
        """Time to move ``nbytes`` of persistent state whose new copies are ``new_copies_LED`` (per layer
        [E, D] bool): the bottleneck device's and node's share of the bytes over their links."""
        if nbytes <= 0:
            return 0.0
        D = self.topo.num_devices
        recv_D = np.zeros(D)
        recv_N = np.zeros(self.topo.num_nodes)
        for new_ED, prev_node_EN in new_copies_LED:
            recv_D += new_ED.sum(axis=0)
            if self.multi_node:
                new_node_EN = np.logical_or.reduceat(new_ED, self.offsets, axis=1) & ~prev_node_EN
                recv_N += new_node_EN.sum(axis=0)
        total = recv_D.sum()
        if total == 0:
            return nbytes / (D * self.intra_bw)
        t = recv_D.max() / total * nbytes / self.intra_bw
        if self.multi_node:
            t = max(t, recv_N.max() / total * nbytes / self.inter_bw)
        return float(t)
