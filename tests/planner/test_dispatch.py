"""Alg. 3 topology-aware token dispatch (§4.4): conservation, holders only, local first, intra-node first."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import Placement, Topology, even_dispatch, topology_aware_dispatch

topologies = st.sampled_from([Topology((1,)), Topology((4,)), Topology((2, 2)), Topology((3, 2)),
                              Topology((2, 2, 2)), Topology((1, 3))])


@st.composite
def plans(draw):
    topo = draw(topologies)
    D = topo.num_devices
    E = draw(st.integers(1, 8))
    owners = draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    extra = np.array(draw(st.lists(st.booleans(), min_size=E * D, max_size=E * D))).reshape(E, D)
    placement = Placement.from_owners(owners, D) | Placement(extra)
    tokens = np.array(draw(st.lists(st.integers(0, 50), min_size=E * D, max_size=E * D))).reshape(E, D)
    return topo, placement, tokens


@settings(max_examples=200, deadline=None)
@given(plans())
def test_dispatch_invariants(plan):
    topo, placement, tokens = plan
    R = topology_aware_dispatch(placement, tokens, topo)
    E, D = tokens.shape
    assert R.dtype == np.int64 and R.shape == (E, D, D) and (R >= 0).all()
    assert (R.sum(axis=2) == tokens).all()                                    # exact conservation
    assert not R.sum(axis=1)[~placement.mask].any()                           # only holders receive
    same = topo.same_node
    for e in range(E):
        holders = placement.mask[e]
        for d in range(D):
            row = R[e, d]
            if holders[d]:
                assert row[d] == tokens[e, d] and row.sum() == row[d]         # local first
            elif (holders & same[d]).any():
                assert not row[~same[d]].any()                                # intra-node first
            # Even split: targets differ by at most one token.
            targets = row[np.flatnonzero(holders & same[d])] if (holders & same[d]).any() and not holders[d] \
                else row[np.flatnonzero(holders)] if not holders[d] else None
            if targets is not None and targets.size:
                assert targets.max() - targets.min() <= 1


def test_dispatch_remainder_rule_is_documented_rotation():
    topo = Topology((3, 1))
    placement = Placement(np.array([[True, True, True, False]]))
    tokens = np.array([[0, 0, 0, 5]])
    R = topology_aware_dispatch(placement, tokens, topo)
    # Source 3 has no holder on its node: 5 tokens over holders (0, 1, 2); q=1, r=2, offset=(0+3)%3=0.
    assert R[0, 3].tolist() == [2, 2, 1, 0]
    tokens = np.array([[0, 0, 0, 4]])
    assert topology_aware_dispatch(placement, tokens, topo)[0, 3].tolist() == [2, 1, 1, 0]


def test_even_dispatch_ignores_topology():
    placement = Placement(np.array([[True, False, False, True]]))
    tokens = np.array([[0, 4, 0, 0]])
    assert topology_aware_dispatch(placement, tokens, Topology((2, 2)))[0, 1].tolist() == [4, 0, 0, 0]
    assert even_dispatch(placement, tokens)[0, 1].tolist() == [2, 0, 0, 2]


@pytest.mark.parametrize("tokens, match", [
    (np.array([[1, -1], [0, 0]]), "negative"),
    (np.array([[1.5, 0], [0, 0]]), "whole"),
    (np.ones((3, 2), dtype=int), "shape"),
])
def test_dispatch_bad_input(tokens, match):
    with pytest.raises(ValueError, match=match):
        topology_aware_dispatch(Placement.contiguous(2, 2), tokens, Topology((2,)))


def test_dispatch_orphan_expert_and_topology_mismatch():
    with pytest.raises(ValueError, match="no holder"):
        topology_aware_dispatch(Placement(np.array([[True, False], [False, False]])), np.ones((2, 2), int),
                                Topology((2,)))
    with pytest.raises(ValueError, match="devices"):
        topology_aware_dispatch(Placement.contiguous(2, 2), np.ones((2, 2), int), Topology((3,)))


# ------------------------------------------------------------------------------------- sparse totals
@settings(max_examples=300, deadline=None)
@given(plans(), st.integers(0, 3))
def test_sparse_traffic_equals_the_dense_plans_totals(plan, links_choice):
    """`dispatch_traffic` and `dispatch_expert_load` (O(E·D)) give the totals of the dense [E, D, D] plan
    of the readable reference bit for bit, classified on any node layout; `even_dispatch`'s plan is a
    single plan node on the cluster's links (FlexMoE)."""
    from themis_compile.planner import reference
    from themis_compile.planner.backend import using
    from themis_compile.planner.dispatch import (DispatchTraffic, dispatch_device_load, dispatch_expert_load,
                                                 dispatch_traffic)

    topo, placement, tokens = plan
    D = topo.num_devices
    links = [topo, Topology.single_node(D), Topology((1,) * D), topo][links_choice]
    R = reference.topology_aware_dispatch(placement, tokens, topo)
    assert dispatch_traffic(placement, tokens, topo, links) == DispatchTraffic.from_plan(R, links)
    assert np.array_equal(dispatch_expert_load(placement, tokens, topo), R.sum(axis=1))
    flat = Topology.single_node(D)
    assert dispatch_traffic(placement, tokens, flat, topo) == DispatchTraffic.from_plan(even_dispatch(placement, tokens),
                                                                                       topo)
    with using(None):                          # numpy's dispatch_device_load is the sparse load
        assert np.array_equal(dispatch_device_load(placement, tokens, topo), R.sum(axis=(0, 1)))


def test_sparse_traffic_of_a_replicated_expert_by_hand():
    """One expert on devices 1, 2 (node 0) and 5 (node 1) of 2 x 4 devices; 7 tokens on every device."""
    from themis_compile.planner.dispatch import dispatch_traffic

    topo = Topology.uniform(2, 4)
    mask = np.zeros((1, 8), dtype=bool)
    mask[0, [1, 2, 5]] = True
    tokens = np.full((1, 8), 7)
    t = dispatch_traffic(Placement(mask), tokens, topo)
    # Node 0's sources 0 and 3 split over 1, 2; node 1's 4, 6, 7 all go to 5 (local first, l.10).
    assert t.load_D.tolist() == [0, 14, 14, 0, 0, 28, 0, 0] and t.kept_D.tolist() == [0, 7, 7, 0, 0, 7, 0, 0]
    assert t.intra_out_D.tolist() == [7, 0, 0, 7, 7, 0, 7, 7] and not t.inter_out_D.any()
    assert t.sent() == 35 and t.inter_node_sent() == 0
    # Topology-unaware (FlexMoE): every source splits over all three holders, across nodes.
    flat = dispatch_traffic(Placement(mask), tokens, Topology.single_node(8), topo)
    assert flat.load_D.sum() == 56 and flat.inter_node_sent() > 0


@pytest.mark.parametrize("num_devices", [8, 12, 24])
def test_first_holders_are_the_masks_argmax(num_devices):
    """The lowest holder of every expert, read eight devices a word where D allows it (12 does not), for
    rows with no holder, one, or several, and for a shard placement (its owners)."""
    from themis_compile.planner.dispatch import _first_holders

    rng = np.random.default_rng(num_devices)
    mask = rng.random((64, num_devices)) < rng.choice([0.0, 0.02, 0.2, 0.9], size=(64, 1))
    mask[0] = False
    mask[1, -1] = True
    for placement in (Placement(mask), Placement.contiguous(64, num_devices)):
        assert np.array_equal(_first_holders(placement), np.argmax(placement.mask, axis=1))


def test_sparse_traffic_with_whole_words_of_devices_and_checked_tokens():
    """2 x 8 devices (the holders read a word at a time): `dispatch_traffic` equals the dense plan's
    totals, with the tokens checked by it or by the caller (``tokens_checked``)."""
    from themis_compile.planner import reference
    from themis_compile.planner.dispatch import DispatchTraffic, check_tokens, dispatch_traffic

    topo = Topology.uniform(2, 8)
    rng = np.random.default_rng(0)
    for _ in range(20):
        placement = Placement.from_owners(rng.integers(0, 16, size=24), 16) | Placement(rng.random((24, 16)) < 0.1)
        tokens = rng.integers(0, 30, size=(24, 16))
        expect = DispatchTraffic.from_plan(reference.topology_aware_dispatch(placement, tokens, topo), topo)
        assert dispatch_traffic(placement, tokens, topo) == expect
        assert dispatch_traffic(placement, check_tokens(tokens, 24, 16), topo, tokens_checked=True) == expect
