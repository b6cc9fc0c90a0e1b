"""Golden tests: the planner's vectorized hot paths (Alg. 1, calibration, Alg. 3) give bit-identical
plans to straightforward reference implementations of the same rules, kept below, on many random cases
(uneven topologies, float ties in loads and modeled device loads, both branches of Alg. 1).

Legend: E experts, D devices (d source, d2 destination), N nodes, J materializable experts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from themis_compile.planner import (
    PlanCost, Placement, Topology, calibrate, fluid_device_load, sparse_materialization,
    topology_aware_dispatch,
)
from themis_compile.planner import device_compute_load, materialize
from themis_compile.planner.dispatch import check_tokens, dispatch_device_load, dispatch_rows

TOPOLOGIES = [(1,), (3,), (2, 2), (3, 2), (2, 2, 2), (4, 1), (1, 3), (5, 3, 8), (4, 4, 4), (8, 8, 8, 8)]


# --------------------------------------------------------------------------------------- reference
def ref_assign_slots(load_J, copies_J, room_J, total_slots):
    """Highest averages, one slot at a time."""
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


def ref_holder_shares(row_D, load, topology):
    D = row_D.size
    k_N = np.asarray(topology.devices_per_node, dtype=np.float64)
    holders_N = np.bincount(topology.node_ids[row_D], minlength=topology.num_nodes)
    copies = max(int(holders_N.sum()), 1)
    uncovered = float(k_N[holders_N == 0].sum())
    node_term_N = np.divide(k_N, holders_N, out=np.zeros_like(k_N), where=holders_N > 0)
    return (load / D) * (node_term_N[topology.node_ids] + uncovered / copies) * row_D


def ref_place_replicas(mask_ED, load_E, experts_J, slots_D, topology):
    """Alg. 1 l.7-11 replica by replica: the node-by-node greedy of l.10 as a Python loop."""
    if experts_J.size == 0 or not slots_D.any():
        return
    N = topology.num_nodes
    node_of = topology.node_ids.tolist()
    k_N = topology.devices_per_node
    copies_E = mask_ED.sum(axis=1)
    dev_load_D = fluid_device_load(Placement(mask_ED), load_E, topology)
    room_J = mask_ED.shape[1] - copies_E[experts_J]
    n_J = ref_assign_slots(load_E[experts_J], copies_E[experts_J], room_J, int(slots_D.sum()))
    for e, n in zip(experts_J.tolist(), n_J.tolist()):
        if n == 0:
            continue
        cand = np.flatnonzero(~mask_ED[e] & (slots_D > 0))
        if cand.size == 0:
            continue
        cand = cand[np.lexsort((-slots_D[cand], dev_load_D[cand]))]
        per_node = [[] for _ in range(N)]
        for d in cand.tolist():
            per_node[node_of[d]].append(d)
        holders_N = np.bincount(topology.node_ids[mask_ED[e]], minlength=N).tolist()
        taken = [0] * N
        sequence = []
        for _ in range(min(n, cand.size)):
            k = min(((holders_N[k] + taken[k]) / k_N[k], float(dev_load_D[per_node[k][taken[k]]]), k)
                    for k in range(N) if taken[k] < len(per_node[k]))[2]
            sequence.append(per_node[k][taken[k]])
            taken[k] += 1
        seq = np.asarray(sequence, dtype=np.int64)
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
        dev_load_D -= ref_holder_shares(mask_ED[e], float(load_E[e]), topology)
        mask_ED[e, chosen] = True
        slots_D[chosen] -= 1
        copies_E[e] += k
        dev_load_D += ref_holder_shares(mask_ED[e], float(load_E[e]), topology)


def ref_top_experts(load_E, t):
    top_J = np.argsort(-load_E, kind="stable")[:t]
    return top_J[load_E[top_J] > 0]


def ref_sparse_materialization(shard, load_E, t, m, topology):
    E, D = shard.shape
    t = min(t, E)
    m = min(m, t)
    top_J = ref_top_experts(load_E, t)
    if top_J.size == 0 or m == 0:
        return shard
    mask_ED = shard.mask.copy()
    if t <= m:
        mask_ED[top_J, :] = True
    else:
        ref_place_replicas(mask_ED, load_E, top_J, np.full(D, m, dtype=np.int64), topology)
    return Placement(mask_ED)


def ref_calibrate(shard, materialized, load_E, t, m, topology, cost, tokens_ED=None):
    E, D = shard.shape
    t = min(t, E)
    m = min(m, t)
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
    ref_place_replicas(mask_ED, load_E, experts_J, slots_D, topology)
    merged = Placement(mask_ED)
    if merged == materialized:
        return materialized
    extra_s = cost.transfer_time(materialized, merged)
    if extra_s > cost.calibration_budget_s:
        return materialized
    if tokens_ED is not None:
        before_s = cost.compute_time(ref_dispatch(materialized, tokens_ED, topology))
        after_s = cost.compute_time(ref_dispatch(merged, tokens_ED, topology))
    else:
        before_s = cost.fluid_compute_time(materialized, load_E)
        after_s = cost.fluid_compute_time(merged, load_E)
    if before_s - after_s > extra_s and math.isfinite(extra_s):
        return merged
    return materialized


def ref_dispatch(placement, tokens_ED, topology):
    """Alg. 3 source by source, with the module's remainder rule."""
    E, D = placement.shape
    mask_ED = placement.mask
    node_of = topology.node_ids
    R_EDD = np.zeros((E, D, D), dtype=np.int64)
    for e in range(E):
        holders = np.flatnonzero(mask_ED[e])
        for d in range(D):
            tokens = int(tokens_ED[e, d])
            if mask_ED[e, d]:
                R_EDD[e, d, d] = tokens                                   # l.4-5
                continue
            local = holders[node_of[holders] == node_of[d]]
            targets = local if local.size else holders                  # l.9-12
            if targets.size == 0:
                continue
            q, r = divmod(tokens, targets.size)
            for j, d2 in enumerate(targets.tolist()):
                R_EDD[e, d, d2] = q + (1 if (j - (e + d)) % targets.size < r else 0)
    return R_EDD


# --------------------------------------------------------------------------------------- cases
def random_case(rng: np.random.Generator):
    topo = Topology(TOPOLOGIES[rng.integers(len(TOPOLOGIES))])
    D = topo.num_devices
    E = int(rng.integers(1, 40))
    owners_E = rng.integers(0, D, E)
    kind = int(rng.integers(4))
    if kind == 0:
        load_E = rng.integers(0, 1000, E).astype(np.float64)
    elif kind == 1:
        load_E = rng.dirichlet(np.full(E, 0.3)) * 1e5
    elif kind == 2:                      # many exact ties in loads and in modeled device loads
        load_E = rng.integers(0, 4, E).astype(np.float64) * 3.0
    else:
        load_E = rng.random(E) * 10.0 ** rng.uniform(-3, 6)
    t = int(rng.integers(0, E + 3))
    m = int(rng.integers(0, min(E, 6) + 2))
    return topo, Placement.from_owners(owners_E, D), load_E, t, m


def test_reference_matches_the_module_remainder_rule_on_a_hand_case():
    topo = Topology((2, 2))
    placement = Placement(np.array([[True, True, False, False]]))
    R_EDD = ref_dispatch(placement, np.array([[5, 6, 7, 9]]), topo)
    assert R_EDD[0, 2].tolist() == [4, 3, 0, 0]    # q=3, r=1, offset (0+2)%2=0: the first target
    assert R_EDD[0, 3].tolist() == [4, 5, 0, 0]    # q=4, r=1, offset (0+3)%2=1: the second target
    assert (topology_aware_dispatch(placement, np.array([[5, 6, 7, 9]]), topo) == R_EDD).all()


@pytest.mark.parametrize("seed", range(4))
def test_alg1_calibration_and_alg3_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        topo, shard, load_E, t, m = random_case(rng)
        E, D = shard.shape
        fast = sparse_materialization(shard, load_E, t, m, topo)
        slow = ref_sparse_materialization(shard, load_E, t, m, topo)
        assert np.array_equal(fast.mask, slow.mask), (topo, E, t, m)
        assert np.array_equal(fast.copies(), fast.mask.sum(axis=1))    # counts cached by the builder
        tokens_ED = rng.multinomial(int(rng.integers(0, 4000)), rng.dirichlet(np.ones(E)), size=D).T
        actual_E = tokens_ED.sum(axis=1).astype(np.float64)
        cost = PlanCost(1e-6, float(rng.choice([1e3, 1e6])), topo)
        with_tokens = tokens_ED if rng.integers(2) else None
        fast_c = calibrate(shard, fast, actual_E, t, m + 1, topo, cost, tokens_ED=with_tokens)
        slow_c = ref_calibrate(shard, slow, actual_E, t, m + 1, topo, cost, tokens_ED=with_tokens)
        assert np.array_equal(fast_c.mask, slow_c.mask), (topo, E, t, m)
        assert np.array_equal(fast_c.copies(), fast_c.mask.sum(axis=1))
        R_EDD = topology_aware_dispatch(fast_c, tokens_ED, topo)
        assert R_EDD.dtype == np.int64 and R_EDD.shape == (E, D, D)
        assert np.array_equal(R_EDD, ref_dispatch(fast_c, tokens_ED, topo))
        sources_S = rng.integers(0, D, int(rng.integers(0, D + 1)))     # any subset, repeats allowed
        assert np.array_equal(dispatch_rows(fast_c, tokens_ED, topo, sources_S), R_EDD[:, sources_S, :])
        d = int(rng.integers(D))
        assert np.array_equal(dispatch_rows(fast_c, tokens_ED, topo, d), R_EDD[:, d, :])
        assert np.array_equal(dispatch_device_load(fast_c, tokens_ED, topo), device_compute_load(R_EDD))


def test_alg1_matches_the_reference_at_benchmark_scale():
    """4 nodes × 8 devices, E = 64 top-8 and E = 128 top-16: the LPT branch with many replicas."""
    rng = np.random.default_rng(7)
    topo = Topology.uniform(4, 8)
    for E, t, m in [(64, 8, 2), (128, 16, 4), (128, 16, 1)]:
        shard = Placement.contiguous(E, 32)
        for _ in range(6):
            tokens_ED = rng.multinomial(4096 * 4, rng.dirichlet(np.full(E, 0.3)), size=32).T
            load_E = tokens_ED.sum(axis=1).astype(np.float64)
            fast = sparse_materialization(shard, load_E, t, m, topo)
            assert np.array_equal(fast.mask, ref_sparse_materialization(shard, load_E, t, m, topo).mask)
            assert (fast.mask & ~shard.mask).sum() > E // 8          # the case really replicates
            assert np.array_equal(topology_aware_dispatch(fast, tokens_ED, topo),
                                  ref_dispatch(fast, tokens_ED, topo))


def test_dispatch_large_counts_use_wide_integers():
    topo = Topology((2, 2))
    placement = Placement(np.array([[True, False, True, True], [False, True, False, False]]))
    tokens_ED = np.array([[0, 2 ** 40 + 3, 7, 1], [5, 2 ** 33, 0, 3]], dtype=np.int64)
    R_EDD = topology_aware_dispatch(placement, tokens_ED, topo)
    assert np.array_equal(R_EDD, ref_dispatch(placement, tokens_ED, topo))
    assert (R_EDD.sum(axis=2) == tokens_ED).all()
    assert np.array_equal(dispatch_rows(placement, tokens_ED, topo, [1, 0]), R_EDD[:, [1, 0], :])
    assert np.array_equal(dispatch_device_load(placement, tokens_ED, topo), R_EDD.sum(axis=(0, 1)))


def test_dispatch_rows_rejects_bad_sources_and_orphans():
    topo = Topology((2, 2))
    placement = Placement(np.array([[True, False, False, False], [False, False, False, False]]))
    with pytest.raises(ValueError, match="sources must be device ids"):
        dispatch_rows(placement, np.zeros((2, 4), dtype=np.int64), topo, [4])
    with pytest.raises(ValueError, match="expert 1 has tokens but no holder"):
        dispatch_rows(placement, np.array([[1, 0, 0, 0], [0, 2, 0, 0]]), topo, 0)
    with pytest.raises(ValueError, match="expert 1 has tokens but no holder"):
        dispatch_device_load(placement, np.array([[1, 0, 0, 0], [0, 2, 0, 0]]), topo)


def test_assign_slots_matches_one_slot_at_a_time():
    rng = np.random.default_rng(3)
    for _ in range(200):
        J = int(rng.integers(1, 8))
        load_J = np.sort(rng.integers(0, 6, J).astype(np.float64) * 2.0)[::-1].copy()
        copies_J = rng.integers(1, 4, J)
        room_J = rng.integers(0, 6, J)
        total = int(rng.integers(0, 20))
        assert np.array_equal(materialize._assign_slots_by_load(load_J, copies_J, room_J, total),
                              ref_assign_slots(load_J, copies_J, room_J, total))


def test_shard_device_load_is_the_cost_model_bit_for_bit():
    rng = np.random.default_rng(5)
    for dpn in TOPOLOGIES:
        topo = Topology(dpn)
        D = topo.num_devices
        owners_E = rng.integers(0, D, 50)
        load_E = rng.random(50) * 10.0 ** rng.uniform(-3, 6, 50)
        expected_D = fluid_device_load(Placement.from_owners(owners_E, D), load_E, topo)
        assert np.array_equal(materialize._shard_device_load(owners_E, load_E, topo), expected_D)


def test_validation_fast_paths_still_reject_bad_input():
    with pytest.raises(ValueError, match="NaN or infinite"):
        materialize.check_loads(np.array([1.0, np.nan]), 2)
    with pytest.raises(ValueError, match="NaN or infinite"):
        materialize.check_loads(np.array([1.0, np.inf]), 2)
    with pytest.raises(ValueError, match="negative entries \\(expert 1\\)"):
        materialize.check_loads(np.array([1.0, -2.0]), 2)
    huge = materialize.check_loads(np.array([1e308, 1e308]), 2)     # finite entries, infinite sum
    assert huge.tolist() == [1e308, 1e308]
    with pytest.raises(ValueError, match="negative counts"):
        check_tokens(np.array([[1, -1]], dtype=np.int64), 1, 2)
    assert check_tokens(np.array([[1, 2]], dtype=np.int32), 1, 2).dtype == np.int64


def test_shard_check_is_cached_but_not_wrong():
    shard = Placement.contiguous(4, 2)
    assert shard.is_shard_placement() and shard.is_shard_placement()
    replicated = shard | Placement.full(4, 2)
    assert not replicated.is_shard_placement()
    for _ in range(2):
        with pytest.raises(ValueError, match="not a shard placement"):
            replicated.require_shard_placement()
    with pytest.raises(ValueError, match="not a shard placement"):
        sparse_materialization(replicated, np.ones(4), 2, 1, Topology((2,)))
