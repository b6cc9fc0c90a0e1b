"""Alg. 1 sparse materialization and the calibration stage (§4.2)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import (
    PlanCost, Placement, Topology, calibrate, fluid_device_load, sparse_materialization,
)

topologies = st.sampled_from([Topology((1,)), Topology((3,)), Topology((2, 2)), Topology((3, 2)),
                              Topology((2, 2, 2)), Topology((4, 1))])


@st.composite
def cases(draw):
    topo = draw(topologies)
    D = topo.num_devices
    E = draw(st.integers(1, 10))
    owners = draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    load = draw(st.lists(st.integers(0, 1000), min_size=E, max_size=E))
    t = draw(st.integers(0, E + 2))
    m = draw(st.integers(0, E + 2))
    return topo, Placement.from_owners(owners, D), np.array(load, dtype=np.float64), t, m


@settings(max_examples=150, deadline=None)
@given(cases())
def test_alg1_invariants(case):
    topo, shard, load, t, m = case
    p = sparse_materialization(shard, load, t, m, topo)
    assert shard <= p                                              # P' ⊇ P
    added = p.mask & ~shard.mask
    t_eff = min(t, shard.num_experts)
    assert added.sum(axis=0).max() <= min(m, t_eff)               # at most m replicas per device
    replicated = np.flatnonzero(added.any(axis=1))
    assert replicated.size <= t_eff                               # at most t distinct experts
    assert (load[replicated] > 0).all()                           # idle experts get no replicas
    # Only top-t experts by load are replicated (ties may pick either of equal loads).
    if replicated.size:
        kth = np.sort(load)[::-1][t_eff - 1]
        assert (load[replicated] >= kth).all()


@settings(max_examples=100, deadline=None)
@given(cases())
def test_alg1_lpt_branch_never_worsens_the_straggler(case):
    topo, shard, load, t, m = case
    if not min(m, t) < min(t, shard.num_experts):
        return
    p = sparse_materialization(shard, load, t, m, topo)
    single = Topology.single_node(shard.num_devices)
    # In the plain even-split model on one node the LPT guard only lets replicas cool the hot holder.
    if topo.num_nodes == 1:
        assert fluid_device_load(p, load, single).max() <= fluid_device_load(shard, load, single).max() + 1e-9


def test_alg1_broadcast_branch_puts_top_t_everywhere():
    shard = Placement.contiguous(6, 3)
    load = np.array([5, 50, 1, 40, 3, 2], dtype=float)
    p = sparse_materialization(shard, load, overlap_degree=2, materialization_budget=5, topology=Topology((3,)))
    assert p.mask[[1, 3]].all()
    assert (p.mask[[0, 2, 4, 5]] == shard.mask[[0, 2, 4, 5]]).all()


def test_alg1_lpt_branch_prefers_new_nodes():
    # Expert 0 (hot) lives on node 0; with one replica allowed it must land on node 1.
    topo = Topology.uniform(2, 2)
    shard = Placement.from_owners([0, 1, 2, 3], 4)
    load = np.array([100.0, 1.0, 1.0, 1.0])
    p = sparse_materialization(shard, load, overlap_degree=2, materialization_budget=1, topology=topo)
    holders = p.holders(0)
    assert set(topo.node_ids[holders].tolist()) == {0, 1}
    assert p.copies()[0] >= 2


def test_alg1_tie_break_is_by_expert_id():
    shard = Placement.contiguous(4, 4)
    p = sparse_materialization(shard, np.ones(4), 2, 2, Topology((4,)))
    assert p.copies().tolist() == [4, 4, 1, 1]


def _brute_force_opt(shard, load, t, m):
    """min over all P' ⊇ P that add at most m replicas per device, of the top-t experts of Alg. 1 l.3
    only, of the max even-split device load."""
    E, D = shard.shape
    top = set(np.argsort(-load, kind="stable")[:t].tolist())
    free = [(e, d) for e in sorted(top) for d in range(D) if not shard.mask[e, d]]
    best = np.inf
    for bits in itertools.product((False, True), repeat=len(free)):
        mask = shard.mask.copy()
        for (e, d), b in zip(free, bits):
            mask[e, d] = b
        added = mask & ~shard.mask
        if added.sum(axis=0).max() > m or added.any(axis=1).sum() > t:
            continue
        best = min(best, fluid_device_load(Placement(mask), load).max())
    return best


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_alg1_within_lpt_bound_of_brute_force_optimum(data):
    D = data.draw(st.integers(2, 3))
    E = data.draw(st.integers(2, 5 if D == 2 else 3))
    owners = data.draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    load = np.array(data.draw(st.lists(st.integers(0, 30), min_size=E, max_size=E)), dtype=float)
    t = data.draw(st.integers(1, E))
    m = data.draw(st.integers(0, t - 1))          # the LPT branch (t > m)
    shard = Placement.from_owners(owners, D)
    plan = sparse_materialization(shard, load, t, m, Topology.single_node(D))
    achieved = fluid_device_load(plan, load).max()
    optimum = _brute_force_opt(shard, load, t, m)
    # Graham's list-scheduling bound (2 - 1/D). The 4/3 LPT ratio of identical-machine scheduling does not
    # transfer to fixed shards plus capped per-device replica slots (exhaustive search finds 1.38 at D=3).
    assert achieved <= (2 - 1 / D) * optimum + 1e-9


def test_alg1_brute_force_examples_reach_optimum():
    # Two hot experts on one device, three devices with one slot each: one replica each is optimal.
    shard = Placement.from_owners([1, 1], 3)
    load = np.array([17.0, 17.0])
    plan = sparse_materialization(shard, load, 2, 1, Topology.single_node(3))
    assert fluid_device_load(plan, load).max() <= _brute_force_opt(shard, load, 2, 1) * 4 / 3 + 1e-9
    shard = Placement.from_owners([0, 0, 0, 2], 3)
    load = np.array([2.7, 4.7, 4.6, 22.1])
    plan = sparse_materialization(shard, load, 2, 1, Topology.single_node(3))
    assert fluid_device_load(plan, load).max() == pytest.approx(_brute_force_opt(shard, load, 2, 1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(load_E=np.array([1.0, -1.0])), "negative"),
    (dict(load_E=np.array([1.0, np.nan])), "NaN"),
    (dict(load_E=np.ones(3)), "shape"),
    (dict(overlap_degree=-1), "overlap_degree"),
    (dict(materialization_budget=-2), "materialization_budget"),
    (dict(shard=Placement(np.ones((2, 2), dtype=bool))), "not a shard placement"),
    (dict(topology=Topology((3,))), "devices"),
])
def test_alg1_bad_input(kwargs, match):
    args = dict(shard=Placement.contiguous(2, 2), load_E=np.ones(2), overlap_degree=1,
                materialization_budget=1, topology=Topology((2,)))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sparse_materialization(**args)


def _cost(topo, budget=np.inf):
    return PlanCost(time_per_token_s=1e-3, expert_bytes=1e3, topology=topo, calibration_budget_s=budget)


def test_calibration_adopts_when_gain_exceeds_cost_and_respects_budget():
    topo = Topology((4,))
    shard = Placement.contiguous(4, 4)
    predicted = np.array([10.0, 10.0, 10.0, 10.0])
    materialized = sparse_materialization(shard, predicted, 2, 1, topo)
    actual = np.array([1.0, 1.0, 1.0, 400.0])      # expert 3 turns out hot
    merged = calibrate(shard, materialized, actual, 2, 1, topo, _cost(topo))
    assert materialized <= merged and merged != materialized
    assert merged.copies()[3] > 1
    assert (merged.mask & ~shard.mask).sum(axis=0).max() <= 1
    # The same transfer does not fit a tiny latency budget, nor pays off when compute is nearly free.
    assert calibrate(shard, materialized, actual, 2, 1, topo, _cost(topo, budget=1e-9)) is materialized
    cheap = PlanCost(time_per_token_s=1e-12, expert_bytes=1e3, topology=topo)
    assert calibrate(shard, materialized, actual, 2, 1, topo, cheap) is materialized


@settings(max_examples=60, deadline=None)
@given(cases(), st.data())
def test_calibration_invariants(case, data):
    topo, shard, load, t, m = case
    actual = np.array(data.draw(st.lists(st.integers(0, 1000), min_size=load.size, max_size=load.size)), float)
    materialized = sparse_materialization(shard, load, t, m, topo)
    merged = calibrate(shard, materialized, actual, t, m, topo, _cost(topo))
    assert materialized <= merged
    added = merged.mask & ~shard.mask
    t_eff = min(t, shard.num_experts)
    assert added.sum(axis=0).max() <= min(m, t_eff)
    assert added.any(axis=1).sum() <= t_eff


def test_calibration_bad_input():
    topo = Topology((2,))
    shard = Placement.contiguous(2, 2)
    with pytest.raises(ValueError, match="does not contain"):
        calibrate(shard, Placement.from_owners([1, 0], 2), np.ones(2), 1, 1, topo, _cost(topo))
    with pytest.raises(ValueError, match="negative"):
        calibrate(shard, shard, -np.ones(2), 1, 1, topo, _cost(topo))
