"""Topology and Placement (§3.1): construction, set algebra, receive counts, node entries, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import Placement, Topology


def test_topology_uneven_nodes_and_queries():
    topo = Topology((3, 2))
    assert topo.num_devices == 5 and topo.num_nodes == 2
    assert topo.node_ids.tolist() == [0, 0, 0, 1, 1]
    assert topo.devices_of_node(1) == (3, 4) and topo.node_of(2) == 0
    graph = topo.to_networkx()
    assert graph.number_of_nodes() == 5 and graph.nodes[4]["node"] == 1
    assert graph.edges[0, 1]["kind"] == "intra" and graph.edges[0, 3]["bandwidth"] == topo.inter_node_bw
    assert Topology.uniform(2, 4) == Topology((4, 4)) and hash(Topology.uniform(2, 4)) == hash(Topology((4, 4)))


def test_topology_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_env(8).devices_per_node == (4, 4)
    assert Topology.from_env(6).devices_per_node == (4, 2)
    assert Topology.from_env(8, devices_per_node=2).devices_per_node == (2, 2, 2, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Topology.from_env(8).devices_per_node == (8,)


@pytest.mark.parametrize("make", [
    lambda: Topology(()), lambda: Topology((2, 0)), lambda: Topology((2,), intra_node_bw=0),
    lambda: Topology((2,), inter_node_bw=-1.0), lambda: Topology.uniform(0, 4), lambda: Topology.from_env(0),
])
def test_topology_bad_input(make):
    with pytest.raises(ValueError):
        make()


def test_topology_validate_mismatch():
    with pytest.raises(ValueError, match="has 4 devices"):
        Topology.uniform(2, 2).validate(5)


def test_contiguous_uneven_and_fewer_experts_than_devices():
    assert Placement.contiguous(7, 3).owners().tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert Placement.contiguous(2, 4).slots().tolist() == [1, 1, 0, 0]
    assert Placement.contiguous(8, 4).owners().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_placement_is_immutable_and_copied():
    raw = np.eye(3, dtype=bool)
    p = Placement(raw)
    raw[0, 1] = True
    assert not p.mask[0, 1]
    with pytest.raises(ValueError):
        p.mask[0, 0] = False


def test_placement_operations():
    shard = Placement.from_owners([0, 1, 1, 3], 4)
    topo = Topology.uniform(2, 2)
    mask = shard.mask.copy()
    mask[1, [0, 2]] = True   # expert 1 (owner 1, node 0) gains device 0 (node 0) and device 2 (node 1)
    mask[3, 2] = True        # expert 3 (owner 3, node 1) gains device 2 (node 1)
    p = Placement(mask)
    assert shard <= p and shard.issubset(p) and not p <= shard
    assert (shard | p) == p and p.union(shard) == p
    delta = p.delta(shard)
    assert delta.num_pairs() == 3 == p.num_pairs() - shard.num_pairs()
    assert p.receive_counts(shard).tolist() == [1, 0, 2, 0]
    entries = p.new_node_entries(shard, topo)
    assert entries.tolist() == [[False, False], [False, True], [False, False], [False, False]]
    assert p.holders(1).tolist() == [0, 1, 2] and p.experts_on(2).tolist() == [1, 3]
    assert not p.is_shard_placement() and shard.is_shard_placement()
    assert len({p, Placement(mask), shard}) == 2
    assert p.digest() == Placement(mask.astype(int)).digest() != shard.digest()


def test_placement_bad_input():
    shard = Placement.from_owners([0, 1], 2)
    with pytest.raises(ValueError, match="not a shard placement"):
        Placement(np.ones((2, 2), dtype=bool)).owners()
    with pytest.raises(ValueError, match="not a shard placement"):
        Placement(np.zeros((2, 2), dtype=bool)).owners()
    with pytest.raises(ValueError):
        Placement.from_owners([0, 2], 2)
    with pytest.raises(ValueError):
        Placement(np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="not a subset"):
        shard.delta(Placement.full(2, 2))
    with pytest.raises(ValueError):
        shard.new_node_entries(shard, Topology.uniform(1, 3))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_placement_algebra_properties(E, D, data):
    bits = data.draw(st.lists(st.booleans(), min_size=E * D, max_size=E * D))
    owners = data.draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    shard = Placement.from_owners(owners, D)
    p = shard | Placement(np.array(bits).reshape(E, D))
    assert shard <= p and p.is_shard_placement() == (p == shard)
    assert p.receive_counts(shard).sum() == p.delta(shard).num_pairs() == p.num_pairs() - E
    assert (p.delta(shard) | shard) == p
    assert shard.owners().tolist() == owners


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 7), st.data())
def test_node_mask_and_transfer_time_match_their_definitions(sizes, E, data):
    """The cached node mask (a reshape on equal nodes) is the per-node OR of the devices; transfer_time's
    direct counts are receive_counts and new_node_entries."""
    from themis_compile.planner import PlanCost

    topology = Topology(sizes)
    D = topology.num_devices
    bits = data.draw(st.lists(st.booleans(), min_size=E * D, max_size=E * D))
    owners = data.draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    shard = Placement.from_owners(owners, D)
    p = shard | Placement(np.array(bits, dtype=bool).reshape(E, D))
    want_EN = np.stack([p.mask[:, topology.devices_of_node(n)].any(axis=1) for n in range(topology.num_nodes)],
                       axis=1).reshape(E, topology.num_nodes)
    assert np.array_equal(p.node_mask(topology), want_EN) and np.array_equal(p.node_mask(topology), want_EN)
    cost = PlanCost(time_per_token_s=1e-6, expert_bytes=3e6,
                    topology=Topology(sizes, intra_node_bw=7e9, inter_node_bw=1e9))
    recv, entries = p.receive_counts(shard), p.new_node_entries(shard, topology).sum(axis=0)
    want = 0.0 if not recv.any() else max(float(recv.max()) * 3e6 / 7e9, float(entries.max()) * 3e6 / 1e9)
    assert cost.transfer_time(shard, p) == want
    if p != shard:
        with pytest.raises(ValueError, match="not a subset"):
            cost.transfer_time(p, shard)


@pytest.mark.parametrize("seed", range(8))
def test_merge_sorted_is_the_union_of_disjoint_sorted_ids(seed):
    from themis_compile.planner.placement import merge_sorted

    rng = np.random.default_rng(seed)
    ids = rng.permutation(int(rng.integers(0, 400)) + 1)
    cut = int(rng.integers(0, ids.size + 1))
    a, b = np.sort(ids[:cut]).astype(np.int64), np.sort(ids[cut:]).astype(np.int64)
    assert np.array_equal(merge_sorted(a, b), np.union1d(a, b))


@pytest.mark.parametrize("seed", range(8))
def test_extended_placement_remembers_its_delta_over_its_bases(seed):
    """P' = P.extended(ΔP) and P'' = P'.extended(Δ'') are the placements of their pairs, with the holder
    counts of them, and answer added_over / issubset of P' and P from what they remember, alike."""
    rng = np.random.default_rng(seed)
    E, D = 24, 8
    shard = Placement.from_owners(rng.integers(0, D, size=E), D)
    free_X = np.setdiff1d(np.arange(E * D), shard.flat_ids())
    chosen = rng.permutation(free_X)[:int(rng.integers(0, 40))]
    delta, extra = np.sort(chosen[:chosen.size // 2]), np.sort(chosen[chosen.size // 2:])
    planned = shard.extended(delta)
    merged = planned.extended(extra)
    for placement, base_X in ((planned, delta), (merged, np.union1d(delta, extra))):
        fresh = Placement.from_pairs(np.union1d(shard.flat_ids(), base_X), E, D)
        assert placement == fresh and placement.digest() == fresh.digest()
        assert np.array_equal(placement.copy_counts(), fresh.copy_counts())
        assert np.array_equal(placement.added_over(shard), base_X)
        assert shard.issubset(placement)
    assert np.array_equal(merged.added_over(planned), extra)
    assert planned.issubset(merged)
    assert shard.extended(np.zeros(0, dtype=np.int64)) is shard
