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
