"""Golden tests: the planner's vectorized hot paths (Alg. 1, calibration, Alg. 3) give bit-identical
plans to the readable reference of the same rules (`planner/reference.py`) on many random cases
(uneven topologies, float ties in loads and modeled device loads, both branches of Alg. 1).

Legend: E experts, D devices (d source, d2 destination), N nodes, J materializable experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.planner import (
    PlanCost, Placement, Topology, calibrate, fluid_device_load, sparse_materialization,
    topology_aware_dispatch,
)
from themis_compile.planner import backend, device_compute_load, materialize, reference
from themis_compile.planner.dispatch import check_tokens, dispatch_device_load, dispatch_rows

TOPOLOGIES = [(1,), (3,), (2, 2), (3, 2), (2, 2, 2), (4, 1), (1, 3), (5, 3, 8), (4, 4, 4), (8, 8, 8, 8)]


@pytest.fixture
def planner_core(request):
    """The fast path named by the test's ``core`` parameter: the compiled core (skipped where it is not
    built) or the numpy code. (test_cplan.py holds the two bit-identical to each other as well.)"""
    if request.param == "numpy":
        with backend.using(None):
            yield "numpy"
        return
    core = backend.load_compiled_core()
    if core is None:
        pytest.skip("compiled planner core not built (or THEMIS_PLANNER_NUMPY set): numpy only")
    with backend.using(core):
        yield "compiled"


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
    R_EDD = reference.topology_aware_dispatch(placement, np.array([[5, 6, 7, 9]]), topo)
    assert R_EDD[0, 2].tolist() == [4, 3, 0, 0]    # q=3, r=1, offset (0+2)%2=0: the first target
    assert R_EDD[0, 3].tolist() == [4, 5, 0, 0]    # q=4, r=1, offset (0+3)%2=1: the second target
    assert (topology_aware_dispatch(placement, np.array([[5, 6, 7, 9]]), topo) == R_EDD).all()


@pytest.mark.parametrize("planner_core, seed", [("compiled", s) for s in range(3)] + [("numpy", 3)],
                         indirect=["planner_core"])
def test_alg1_calibration_and_alg3_match_the_reference(planner_core, seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        topo, shard, load_E, t, m = random_case(rng)
        E, D = shard.shape
        fast = sparse_materialization(shard, load_E, t, m, topo)
        slow = reference.sparse_materialization(shard, load_E, t, m, topo)
        assert np.array_equal(fast.mask, slow.mask), (topo, E, t, m)
        assert np.array_equal(fast.copies(), fast.mask.sum(axis=1))    # counts cached by the builder
        tokens_ED = rng.multinomial(int(rng.integers(0, 4000)), rng.dirichlet(np.ones(E)), size=D).T
        actual_E = tokens_ED.sum(axis=1).astype(np.float64)
        cost = PlanCost(1e-6, float(rng.choice([1e3, 1e6])), topo)
        with_tokens = tokens_ED if rng.integers(2) else None
        fast_c = calibrate(shard, fast, actual_E, t, m + 1, topo, cost, tokens_ED=with_tokens)
        slow_c = reference.calibrate(shard, slow, actual_E, t, m + 1, topo, cost, tokens_ED=with_tokens)
        assert np.array_equal(fast_c.mask, slow_c.mask), (topo, E, t, m)
        assert np.array_equal(fast_c.copies(), fast_c.mask.sum(axis=1))
        R_EDD = topology_aware_dispatch(fast_c, tokens_ED, topo)
        assert R_EDD.dtype == np.int64 and R_EDD.shape == (E, D, D)
        assert np.array_equal(R_EDD, reference.topology_aware_dispatch(fast_c, tokens_ED, topo))
        sources_S = rng.integers(0, D, int(rng.integers(0, D + 1)))     # any subset, repeats allowed
        assert np.array_equal(dispatch_rows(fast_c, tokens_ED, topo, sources_S), R_EDD[:, sources_S, :])
        d = int(rng.integers(D))
        assert np.array_equal(dispatch_rows(fast_c, tokens_ED, topo, d), R_EDD[:, d, :])
        assert np.array_equal(dispatch_device_load(fast_c, tokens_ED, topo), device_compute_load(R_EDD))


@pytest.mark.parametrize("planner_core", ["compiled", "numpy"], indirect=True)
def test_alg1_matches_the_reference_at_benchmark_scale(planner_core):
    """4 nodes × 8 devices, E = 64 top-8 and E = 128 top-16: the LPT branch with many replicas."""
    rng = np.random.default_rng(7)
    topo = Topology.uniform(4, 8)
    for E, t, m in [(64, 8, 2), (128, 16, 4), (128, 16, 1)]:
        shard = Placement.contiguous(E, 32)
        for _ in range(6):
            tokens_ED = rng.multinomial(4096 * 4, rng.dirichlet(np.full(E, 0.3)), size=32).T
            load_E = tokens_ED.sum(axis=1).astype(np.float64)
            fast = sparse_materialization(shard, load_E, t, m, topo)
            assert np.array_equal(fast.mask, reference.sparse_materialization(shard, load_E, t, m, topo).mask)
            assert (fast.mask & ~shard.mask).sum() > E // 8          # the case really replicates
            assert np.array_equal(topology_aware_dispatch(fast, tokens_ED, topo),
                                  reference.topology_aware_dispatch(fast, tokens_ED, topo))


def test_dispatch_large_counts_use_wide_integers():
    topo = Topology((2, 2))
    placement = Placement(np.array([[True, False, True, True], [False, True, False, False]]))
    tokens_ED = np.array([[0, 2 ** 40 + 3, 7, 1], [5, 2 ** 33, 0, 3]], dtype=np.int64)
    R_EDD = topology_aware_dispatch(placement, tokens_ED, topo)
    assert np.array_equal(R_EDD, reference.topology_aware_dispatch(placement, tokens_ED, topo))
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
                              reference.assign_slots_by_load(load_J, copies_J, room_J, total))


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
