"""Alg. 2 heterogeneous sharding (§4.3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import Placement, Topology, heterogeneous_sharding, homogeneous_sharding


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([Topology((1,)), Topology((4,)), Topology((2, 2)), Topology((3, 2)), Topology((2, 2, 3))]),
       st.integers(1, 4), st.integers(1, 9), st.integers(0, 10), st.data())
def test_alg2_equal_slots_and_shard_placements(topo, L, E, t, data):
    loads = np.array(data.draw(st.lists(st.integers(0, 100), min_size=L * E, max_size=L * E)), float).reshape(L, E)
    plan = heterogeneous_sharding(loads, t, topo)
    assert len(plan) == L and all(p.is_shard_placement() and p.shape == (E, topo.num_devices) for p in plan)
    slots = sum(p.slots() for p in plan)
    assert slots.sum() == L * E and slots.max() - slots.min() <= (0 if L * E % topo.num_devices == 0 else 1)


def test_alg2_spreads_underloaded_experts_over_nodes():
    topo = Topology.uniform(2, 2)
    loads = np.array([[100.0, 90.0, 5.0, 4.0, 3.0, 2.0, 1.0, 1.0]])
    (plan,) = heterogeneous_sharding(loads, 2, topo)
    owners = plan.owners()
    under = owners[2:]
    per_node = np.bincount(topo.node_ids[under], minlength=2)
    assert per_node.tolist() == [3, 3]
    assert np.bincount(owners, minlength=4).tolist() == [2, 2, 2, 2]


def test_homogeneous_sharding_is_contiguous():
    plan = homogeneous_sharding(3, 8, 4)
    assert len(plan) == 3 and all(p == Placement.contiguous(8, 4) for p in plan)


@pytest.mark.parametrize("loads, t", [(np.array([[1.0, -2.0]]), 1), (np.ones(4), 1), (np.ones((2, 2)), -1),
                                       (np.array([[np.inf, 1.0]]), 1)])
def test_alg2_bad_input(loads, t):
    with pytest.raises(ValueError):
        heterogeneous_sharding(loads, t, Topology((2,)))


def _alg2_by_scanning(load_LE: np.ndarray, t: int, topology: Topology) -> list[np.ndarray]:
    """Alg. 2 as it reads, every minimum a scan over the candidates (what `heterogeneous_sharding`'s heaps
    must pick too): the owners of every layer."""
    from themis_compile.planner.sharding import slots_per_device

    L, E = load_LE.shape
    t = min(t, E)
    D, N = topology.num_devices, topology.num_nodes
    devices_of = [list(topology.devices_of_node(n)) for n in range(N)]
    order_LE = np.argsort(-load_LE, axis=1, kind="stable")
    top_LJ, rest_LJ = order_LE[:, :t], order_LE[:, t:]
    slots = slots_per_device(L * E, D).tolist()
    node_slots = [sum(slots[d] for d in devices_of[n]) for n in range(N)]
    owners_LE = np.full((L, E), -1, dtype=np.int64)
    loads = load_LE.tolist()
    max_rest_L = load_LE[np.arange(L)[:, None], rest_LJ].max(axis=1) if rest_LJ.size else np.zeros(L)
    dev_load_LD = [[0.0] * D for _ in range(L)]
    for l in np.argsort(-max_rest_L, kind="stable").tolist():
        dev_load, node_load = dev_load_LD[l], [0.0] * N
        for e in rest_LJ[l].tolist():
            n = min((node_load[k], node_slots[k], k) for k in range(N) if node_slots[k] > 0)[2]
            d = min((dev_load[x], slots[x], x) for x in devices_of[n] if slots[x] > 0)[2]
            owners_LE[l, e] = d
            slots[d] -= 1
            node_slots[n] -= 1
            dev_load[d] += loads[l][e]
            node_load[n] += loads[l][e]
    for l in range(L):
        dev_load = dev_load_LD[l]
        for e in top_LJ[l].tolist():
            d = min((dev_load[x], slots[x], x) for x in range(D) if slots[x] > 0)[2]
            owners_LE[l, e] = d
            slots[d] -= 1
            dev_load[d] += loads[l][e]
    return list(owners_LE)


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([Topology((1,)), Topology((4,)), Topology((2, 2)), Topology((3, 2)), Topology((2, 2, 3)),
                        Topology.uniform(4, 2)]),
       st.integers(1, 4), st.integers(1, 24), st.integers(0, 10), st.booleans(), st.data())
def test_alg2_heaps_pick_what_scanning_picks(topo, L, E, t, ties, data):
    """Ties included (small integer loads): the heaps break them as the scans' (load, slots, id) keys do."""
    values = st.integers(0, 3) if ties else st.floats(0, 1e4, allow_nan=False)
    loads = np.array(data.draw(st.lists(values, min_size=L * E, max_size=L * E)), float).reshape(L, E)
    got = [p.owners() for p in heterogeneous_sharding(loads, t, topo)]
    assert all(np.array_equal(a, b) for a, b in zip(got, _alg2_by_scanning(loads, t, topo)))


def test_alg2_heaps_at_cluster_size():
    topo = Topology.uniform(32, 8)
    loads = np.random.default_rng(0).lognormal(0, 1.5, (3, 1024))
    got = [p.owners() for p in heterogeneous_sharding(loads, 23, topo)]
    assert all(np.array_equal(a, b) for a, b in zip(got, _alg2_by_scanning(loads, 23, topo)))
