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
