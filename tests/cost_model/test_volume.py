"""The §3.3 volume formulas of the sparse collectives, on hand-checked placements and random ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.cost_model.volume import (
    SPAG,
    SPRS,
    chunk_bytes,
    lower_bound_time,
    sparse_all_gather_volume,
    sparse_reduce_scatter_volume,
)
from themis_compile.planner import PlanCost, Placement, Topology
from themis_compile.planner.cost import sparse_transfer_time

TWO_BY_TWO = Topology((2, 2), intra_node_bw=100.0, inter_node_bw=10.0)


def _fig6() -> tuple[Placement, Placement]:
    """E0 owned by d0 and replicated on d1 (same node), d2 and d3 (other node); E1 owned by d3, added on
    d2; E2 owned by d1, no replica."""
    shard = Placement.from_owners([0, 3, 1], 4)
    mask = shard.mask.copy()
    mask[0, [1, 2, 3]] = True
    mask[1, 2] = True
    return shard, Placement(mask)


def test_spag_volume_by_hand() -> None:
    shard, placement = _fig6()
    vol = sparse_all_gather_volume(shard, placement, 10, TWO_BY_TWO)
    assert vol.collective == SPAG
    assert vol.total_bytes == 4 * 10                         # |ΔP| = 4 pairs (Eq. 4)
    assert vol.recv_bytes_D == (0, 10, 20, 10)
    assert vol.fixed_bytes_D == vol.recv_bytes_D
    assert vol.send_bytes_D == (10, 0, 0, 10)                # owners of replicated chunks send ≥ Ψ each
    assert vol.inter_node_bytes == 10                        # E0 newly reaches node 1 once; E1 stays inside
    assert vol.node_ingress_bytes_N == (0, 10)
    assert vol.node_egress_bytes_N == (10, 0)


def test_sprs_volume_mirrors_spag() -> None:
    shard, placement = _fig6()
    ag = sparse_all_gather_volume(shard, placement, 10, TWO_BY_TWO)
    rs = sparse_reduce_scatter_volume(placement, shard, 10, TWO_BY_TWO)
    assert rs.collective == SPRS
    assert rs.send_bytes_D == ag.recv_bytes_D == rs.fixed_bytes_D
    assert rs.recv_bytes_D == ag.send_bytes_D
    assert rs.total_bytes == ag.total_bytes and rs.inter_node_bytes == ag.inter_node_bytes
    assert rs.node_egress_bytes_N == ag.node_ingress_bytes_N
    assert rs.as_dict()["send_bytes_D"] == [0, 10, 20, 10]


def test_lower_bound_time() -> None:
    shard, placement = _fig6()
    # Device 2 receives 2Ψ = 20 B at 100 B/s (0.2 s); node 1 takes in 10 B at 10 B/s (1 s).
    assert lower_bound_time(shard, placement, 10, TWO_BY_TWO) == pytest.approx(1.0)
    assert lower_bound_time(shard, placement, 10, TWO_BY_TWO, inter_node_bw=1000.0) == pytest.approx(0.2)
    one_node = Topology((4,), intra_node_bw=100.0)
    assert lower_bound_time(shard, placement, 10, one_node) == pytest.approx(0.2)
    assert lower_bound_time(shard, shard, 10, TWO_BY_TWO) == 0.0
    with pytest.raises(ValueError):
        lower_bound_time(shard, placement, 10, TWO_BY_TWO, device_bw=0.0)


def test_receive_side_time_is_the_planners_and_never_above_the_bound() -> None:
    """`sparse_transfer_time` (calibration's and the simulator's charge) counts the receiving side only;
    `lower_bound_time` adds the owners' side on the same `bottleneck_time` formula."""
    shard, placement = _fig6()
    # Receiving side alone: device 2 takes 20 B (0.2 s), node 1 takes in 10 B (1 s); the same as the
    # full bound here (no owner sends more than the busiest receiver takes).
    assert sparse_transfer_time(shard, placement, 10, TWO_BY_TWO) == pytest.approx(1.0)
    # d0 owns three chunks that each gain one replica on another device: it must send 30 B, while each
    # receiver takes 10 B. Only the full bound sees the owner.
    one_node = Topology((4,), intra_node_bw=100.0)
    hub = Placement.from_owners([0, 0, 0, 1], 4)
    mask = hub.mask.copy()
    mask[0, 1], mask[1, 2], mask[2, 3] = True, True, True
    fanned = Placement(mask)
    assert sparse_transfer_time(hub, fanned, 10, one_node) == pytest.approx(0.1)
    assert lower_bound_time(hub, fanned, 10, one_node) == pytest.approx(0.3)
    rng = np.random.default_rng(0)
    for _ in range(50):
        topo = Topology(tuple(int(k) for k in rng.integers(1, 4, size=int(rng.integers(1, 4)))),
                        intra_node_bw=float(rng.choice([10.0, 100.0])), inter_node_bw=float(rng.choice([1.0, 10.0])))
        D, E = topo.num_devices, int(rng.integers(1, 8))
        shard = Placement.from_owners(rng.integers(0, D, size=E).tolist(), D)
        target = shard | Placement(rng.random((E, D)) < 0.3)
        psi = int(rng.integers(1, 100))
        assert sparse_transfer_time(shard, target, psi, topo) <= lower_bound_time(shard, target, psi, topo)
        assert sparse_transfer_time(shard, target, psi, topo) == PlanCost(1e-6, psi, topo).transfer_time(shard, target)


def test_per_expert_psi_and_chunk_bytes() -> None:
    shard, placement = _fig6()
    vol = sparse_all_gather_volume(shard, placement, [10, 1, 1000], TWO_BY_TWO)
    assert vol.recv_bytes_D == (0, 10, 11, 10) and vol.total_bytes == 31
    spec = [((6, 10), torch.float32), ((3,), torch.bfloat16), ((0, 4), torch.int64), ((), np.float64)]
    assert chunk_bytes(spec) == 240 + 6 + 0 + 8


def test_bad_input() -> None:
    shard, placement = _fig6()
    with pytest.raises(ValueError, match="shard placement"):
        sparse_all_gather_volume(placement, placement, 10, TWO_BY_TWO)
    with pytest.raises(ValueError, match="contain"):
        sparse_all_gather_volume(shard, Placement.from_owners([1, 3, 1], 4), 10, TWO_BY_TWO)
    with pytest.raises(ValueError, match="psi"):
        sparse_all_gather_volume(shard, placement, [1, 2], TWO_BY_TWO)
    with pytest.raises(ValueError, match="devices"):
        sparse_all_gather_volume(shard, placement, 10, Topology((2,)))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1,), (4,), (2, 2), (3, 1, 2)]), st.integers(1, 9), st.integers(0, 2**31 - 1),
       st.integers(0, 4096))
def test_random_placements_satisfy_eq4(dpn, num_experts, seed, psi) -> None:
    topology = Topology(dpn)
    D = topology.num_devices
    rng = np.random.default_rng(seed)
    shard = Placement.from_owners(rng.integers(0, D, num_experts), D)
    placement = shard.union(Placement(rng.random((num_experts, D)) < 0.4))
    vol = sparse_all_gather_volume(shard, placement, psi, topology)
    delta = placement.delta(shard)
    assert vol.total_bytes == len(delta) * psi == sum(vol.recv_bytes_D)
    assert vol.recv_bytes_D == tuple(int(c) * psi for c in placement.receive_counts(shard))
    new_EN = placement.new_node_entries(shard, topology)
    assert vol.inter_node_bytes == int(new_EN.sum()) * psi == sum(vol.node_ingress_bytes_N)
    assert sum(vol.send_bytes_D) <= vol.total_bytes          # the owners' minimum never exceeds the total
    if topology.num_nodes == 1:
        assert vol.inter_node_bytes == 0
