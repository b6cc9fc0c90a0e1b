"""The compiled planner core (``themis_compile.planner._cplan``) against the numpy code it replaces.

Every public planner entry point is run twice on the same inputs, once through the compiled core and
once with the numpy code (`backend.using(None)`), and the outputs must be
bit-identical: masks, holder counts, plans, device loads, the Placement objects themselves, and the
ValueErrors of bad input. Cases cover uneven topologies, both branches of Alg. 1 (t <= m and t > m),
float ties and zero loads, E < D and E > D, calibration (replicas placed from a non-shard mask; the
core's one-call calibration with its adopt / reject decision, binding budgets and the inputs it hands
back to numpy), the row and device-load variants of Alg. 3 and zero token counts.

Legend: E experts, D devices (d source, d2 destination), N nodes, J materializable experts, S sources.
"""

from __future__ import annotations

import importlib
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.planner import (
    PlanCost, Placement, Topology, backend, calibrate, dispatch, materialize, sparse_materialization,
    topology_aware_dispatch,
)
from themis_compile.planner.cost import fluid_device_load
from themis_compile.planner.dispatch import dispatch_device_load, dispatch_rows

TOPOLOGIES = [(1,), (3,), (2, 2), (3, 2), (2, 2, 2), (4, 1), (1, 3), (5, 3, 8), (4, 4, 4), (8, 8, 8, 8)]


def numpy_forced() -> bool:
    return os.environ.get("THEMIS_PLANNER_NUMPY", "") not in ("", "0")


@pytest.fixture(scope="module")
def core():
    """The compiled module itself (imported directly: the comparison holds whatever the environment
    selects for the rest of the suite). A missing build fails these tests, except where
    THEMIS_PLANNER_NUMPY=1 declares a machine that runs numpy only (no compiler, a source tree on
    another Python): there is then nothing to compare."""
    try:
        return importlib.import_module("themis_compile.planner._cplan")
    except ImportError:
        if numpy_forced():
            pytest.skip("compiled planner core not built and THEMIS_PLANNER_NUMPY=1: numpy only")
        raise


def run_both(core, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` through the compiled core and through numpy: (compiled, numpy). A
    ValueError is returned as its message, so both paths must also fail alike."""
    results = []
    for chosen in (core, None):
        with backend.using(chosen):
            try:
                results.append(fn(*args, **kwargs))
            except ValueError as exc:
                results.append(f"ValueError: {exc}")
    return results


def assert_same(compiled, reference) -> None:
    assert type(compiled) is type(reference)
    if isinstance(reference, Placement):
        assert compiled == reference
        assert np.array_equal(compiled.mask, reference.mask)
        assert np.array_equal(compiled.copies(), reference.copies())
        assert np.array_equal(compiled.copies(), compiled.mask.sum(axis=1))     # cached counts are right
    elif isinstance(reference, np.ndarray):
        assert compiled.dtype == reference.dtype and compiled.shape == reference.shape
        assert np.array_equal(compiled, reference)
    else:
        assert compiled == reference


# --------------------------------------------------------------------------------------- cases
def make_loads(rng: np.random.Generator, E: int, kind: int) -> np.ndarray:
    if kind == 0:
        return rng.integers(0, 1000, E).astype(np.float64)
    if kind == 1:
        return rng.dirichlet(np.full(E, 0.3)) * 1e5
    if kind == 2:                        # many exact ties in loads and in modeled device loads
        return rng.integers(0, 4, E).astype(np.float64) * 3.0
    if kind == 3:                        # mostly zero loads
        return np.where(rng.random(E) < 0.7, 0.0, rng.random(E) * 50.0)
    return rng.random(E) * 10.0 ** rng.uniform(-3, 6)


def make_case(rng: np.random.Generator):
    topo = Topology(TOPOLOGIES[rng.integers(len(TOPOLOGIES))])
    D = topo.num_devices
    E = int(rng.integers(1, 3 * D + 8))                 # E < D and E > D both occur
    owners_E = rng.integers(0, D, E) if rng.integers(2) else np.arange(E) % D
    load_E = make_loads(rng, E, int(rng.integers(5)))
    t = int(rng.integers(0, E + 3))
    m = int(rng.integers(0, min(E, 6) + 2))
    return topo, Placement.from_owners(owners_E, D), load_E, t, m


def make_tokens(rng: np.random.Generator, E: int, D: int) -> np.ndarray:
    tokens_ED = rng.multinomial(int(rng.integers(0, 4000)), rng.dirichlet(np.ones(E)), size=D).T
    if rng.integers(3) == 0:
        tokens_ED[rng.random(tokens_ED.shape) < 0.5] = 0             # many zero counts
    return tokens_ED.astype(np.int64)        # F-ordered (a transposed draw), like the benchmark's counts


def compare_case(core, topo, shard, load_E, t, m, rng) -> dict:
    """All entry points on one case; returns which branches it exercised."""
    E, D = shard.shape
    fast, ref = run_both(core, sparse_materialization, shard, load_E, t, m, topo)
    assert_same(fast, ref)
    tokens_ED = make_tokens(rng, E, D)
    actual_E = tokens_ED.sum(axis=1).astype(np.float64)
    cost = PlanCost(1e-6, float(rng.choice([1e3, 1e6])), topo)
    with_tokens = tokens_ED if rng.integers(2) else None
    placed = ref if isinstance(ref, Placement) else shard
    fast_c, ref_c = run_both(core, calibrate, shard, placed, actual_E, t, m + 1, topo, cost, tokens_ED=with_tokens)
    assert_same(fast_c, ref_c)
    for placement in {placed, ref_c}:
        assert_same(*run_both(core, topology_aware_dispatch, placement, tokens_ED, topo))
        sources_S = rng.integers(0, D, int(rng.integers(0, D + 2)))     # any subset, repeats allowed
        assert_same(*run_both(core, dispatch_rows, placement, tokens_ED, topo, sources_S))
        d = int(rng.integers(D))
        assert_same(*run_both(core, dispatch_rows, placement, tokens_ED, topo, d))
        assert_same(*run_both(core, dispatch_rows, placement, tokens_ED, topo, np.int64(d)))
        assert_same(*run_both(core, dispatch_device_load, placement, tokens_ED, topo))
    t_eff, m_eff = min(t, E), min(m, t, E)
    return {"lpt": t_eff > m_eff > 0, "all": 0 < t_eff <= m_eff, "few": E < D, "many": E > D,
            "calibrated": ref_c is not placed, "replicated": isinstance(ref, Placement) and ref != shard}


# --------------------------------------------------------------------------------------- backend
def test_compiled_core_is_the_backend_unless_numpy_is_forced():
    if numpy_forced():
        assert backend.compiled_core() is None and dispatch.planner_backend() == "numpy"
    else:   # CI must not silently run numpy only: the editable install builds the core
        assert backend.compiled_core() is not None and dispatch.planner_backend() == "c"
        assert backend.compiled_core().__name__ == "themis_compile.planner._cplan"


def test_environment_variable_forces_numpy(monkeypatch, core):
    monkeypatch.setenv("THEMIS_PLANNER_NUMPY", "1")
    assert backend.load_compiled_core() is None
    monkeypatch.setenv("THEMIS_PLANNER_NUMPY", "0")
    assert backend.load_compiled_core() is core
    monkeypatch.delenv("THEMIS_PLANNER_NUMPY")
    assert backend.load_compiled_core() is core
    monkeypatch.setattr(core, "ABI", core.ABI + 1)                  # a build from an older source
    assert backend.load_compiled_core() is None


# --------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("seed", range(3))
def test_compiled_and_numpy_plans_are_bit_identical(core, seed):
    rng = np.random.default_rng(100 + seed)
    seen = {key: 0 for key in ("lpt", "all", "few", "many", "calibrated", "replicated")}
    for _ in range(150):
        for key, hit in compare_case(core, *make_case(rng), rng).items():
            seen[key] += hit
    assert all(count > 0 for count in seen.values()), seen      # every branch was exercised


@settings(max_examples=60, deadline=None)
@given(dpn=st.sampled_from(TOPOLOGIES), E=st.integers(1, 40), t=st.integers(0, 12), m=st.integers(0, 6),
       loads=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 3.0, 7.25, 1e6]), min_size=40, max_size=40),
       seed=st.integers(0, 2 ** 16))
def test_hypothesis_compiled_matches_numpy(core, dpn, E, t, m, loads, seed):
    rng = np.random.default_rng(seed)
    topo = Topology(dpn)
    shard = Placement.from_owners(rng.integers(0, topo.num_devices, E), topo.num_devices)
    compare_case(core, topo, shard, np.asarray(loads[:E]), t, m, rng)


def test_benchmark_scale_and_the_sequential_sum_branches(core):
    """4 nodes x 8 devices at the benchmark's sizes, and a large E·D (5,000 experts), where a dense
    column sum would have switched to pairwise summation: the model adds experts in order at any size."""
    rng = np.random.default_rng(11)
    topo = Topology.uniform(4, 8)
    for E, t, m in [(64, 8, 2), (128, 16, 4), (128, 16, 1), (128, 40, 3)]:
        shard = Placement.contiguous(E, 32)
        for _ in range(4):
            load_E = rng.multinomial(4096 * 8, rng.dirichlet(np.full(E, 0.3))).astype(np.float64)
            compare_case(core, topo, shard, load_E, t, m, rng)
    big = Topology((4, 4))
    shard = Placement.from_owners(rng.integers(0, 8, 5000), 8)
    load_E = rng.dirichlet(np.full(5000, 0.3)) * 1e6
    fast, ref = run_both(core, sparse_materialization, shard, load_E, 12, 3, big)
    assert_same(fast, ref)
    assert ref != shard


def test_slot_apportionment_matches_numpy_under_exact_ties(core):
    """l.9 alone: small integer loads make quotients equal each other and the core's bulk-start
    threshold sum(load) / total exactly; the counts must still be numpy's, slot for slot."""
    rng = np.random.default_rng(17)
    for _ in range(3000):
        J = int(rng.integers(0, 9))
        load_J = np.sort(rng.integers(0, 7, J).astype(np.float64) * float(rng.choice([1.0, 3.0, 0.1])))[::-1].copy()
        if rng.integers(4) == 0:
            load_J = rng.random(J) * 10.0 ** rng.uniform(-300, 300)
        copies_J = rng.integers(1, 5, J).astype(np.int64)
        room_J = rng.integers(0, 9, J).astype(np.int64)
        total = int(rng.integers(0, 40))
        n_J = np.full(J, -1, dtype=np.int64)
        core.assign_slots(load_J, copies_J, room_J, total, n_J)
        expected_J = materialize._assign_slots_by_load(load_J, copies_J, room_J, total)
        assert np.array_equal(n_J, expected_J), (load_J, copies_J, room_J, total)


def test_modeled_loads_of_replicated_masks_are_the_cost_model_bit_for_bit(core):
    """The core's own `fluid_device_load` (calibration's starting loads) on several-node topologies."""
    rng = np.random.default_rng(29)
    for dpn in [tp for tp in TOPOLOGIES if len(tp) > 1] * 20:
        topo = Topology(dpn)
        D = topo.num_devices
        E = int(rng.integers(1, 60))
        mask_ED = Placement.from_owners(rng.integers(0, D, E), D).mask | (rng.random((E, D)) < rng.random())
        load_E = make_loads(rng, E, int(rng.integers(5)))
        out_D = np.full(D, np.nan)
        core.fluid_device_load(topo.core_layout, mask_ED, load_E, out_D)
        assert np.array_equal(out_D, fluid_device_load(Placement(mask_ED), load_E, topo))


def test_many_node_merge_matches_numpy(core):
    """l.10's node merge (a heap in the core) on many nodes, uniform and not, with the exact ties of
    small integer loads: the same picks as numpy's lexsort, slot for slot."""
    rng = np.random.default_rng(37)
    replicated = 0
    for dpn in [(2,) * 16, (1, 3, 2, 4) * 4, (8,) * 12, (3, 1) * 9]:
        topo = Topology(dpn)
        D = topo.num_devices
        for _ in range(6):
            E = int(rng.integers(D, 4 * D))
            shard = Placement.from_owners(rng.integers(0, D, E), D)
            if rng.integers(2):
                load_E = rng.integers(0, 5, E).astype(np.float64)
            else:
                load_E = rng.dirichlet(np.full(E, 0.3)) * 1e6
            t = int(rng.integers(2, 24))
            m = int(rng.integers(1, t))
            fast, ref = run_both(core, sparse_materialization, shard, load_E, t, m, topo)
            assert_same(fast, ref)
            replicated += int((ref.copies() > 1).sum() > 1)
    assert replicated >= 20         # the LPT branch ran, with several replicated experts, in most cases


def test_modeled_loads_add_experts_in_order_at_any_size(core):
    """`fluid_device_load` on several nodes is the per-device sum of its terms in ascending expert order,
    also where a dense column sum would be pairwise (large E·D); the core computes the same floats."""
    rng = np.random.default_rng(31)
    topo = Topology((8, 8, 8, 8))
    E, D = 6000, topo.num_devices
    mask_ED = Placement.from_owners(rng.integers(0, D, E), D).mask | (rng.random((E, D)) < 0.01)
    load_E = rng.dirichlet(np.full(E, 0.3)) * 1e7
    k_N = topo.devices_per_node_f
    expected_D = np.zeros(D)
    for e in range(E):                      # the model's formula, one expert after another
        holders_D = np.flatnonzero(mask_ED[e])
        h_N = np.bincount(topo.node_ids[holders_D], minlength=topo.num_nodes)
        uncovered = float(k_N[h_N == 0].sum())
        for d in holders_D.tolist():
            n = topo.node_ids[d]
            expected_D[d] += (load_E[e] / D) * (k_N[n] / h_N[n] + uncovered / holders_D.size)
    model_D = fluid_device_load(Placement(mask_ED), load_E, topo)
    assert np.array_equal(model_D, expected_D)
    out_D = np.full(D, np.nan)
    core.fluid_device_load(topo.core_layout, mask_ED, load_E, out_D)
    assert np.array_equal(out_D, model_D)


def test_place_replicas_from_a_replicated_mask(core):
    """calibrate's use: a mask that already holds replicas, uneven free slots, experts in load order."""
    rng = np.random.default_rng(5)
    for _ in range(150):
        topo = Topology(TOPOLOGIES[rng.integers(len(TOPOLOGIES))])
        D = topo.num_devices
        E = int(rng.integers(1, 30))
        mask_ED = Placement.from_owners(rng.integers(0, D, E), D).mask.copy()
        mask_ED |= rng.random((E, D)) < 0.15
        load_E = make_loads(rng, E, int(rng.integers(5)))
        order_E = np.argsort(-load_E, kind="stable")
        experts_J = order_E[load_E[order_E] > 0][:int(rng.integers(0, E + 1))]
        slots_D = rng.integers(0, 3, D).astype(np.int64)
        outs = []
        for chosen in (core, None):
            m_ED, s_D, c_E = mask_ED.copy(), slots_D.copy(), mask_ED.sum(axis=1).astype(np.int64)
            with backend.using(chosen):
                materialize._place_replicas(m_ED, load_E, experts_J, s_D, topo, c_E)
            outs.append((m_ED, s_D, c_E))
        for fast, ref in zip(*outs):
            assert np.array_equal(fast, ref)
        assert np.array_equal(outs[0][2], outs[0][0].sum(axis=1))


def test_inputs_of_other_types_and_layouts(core):
    """Lists, float loads in other dtypes, strided and transposed token counts, float token counts."""
    rng = np.random.default_rng(9)
    topo = Topology((3, 2))
    shard = Placement.from_owners([0, 1, 2, 3, 4, 0, 1, 2, 3], 5)
    wide_ED = rng.integers(0, 50, (9, 10))
    loads = [5.0, 0.0, 3.0, 3.0, 9.0, 1.0, 0.0, 2.0, 8.0]
    for load_E in (loads, np.asarray(loads, dtype=np.float32), np.asarray(loads * 2)[::2], np.asarray(loads, int)):
        assert_same(*run_both(core, sparse_materialization, shard, load_E, 4, 2, topo))
    placement = run_both(core, sparse_materialization, shard, loads, 4, 2, topo)[1]
    for tokens_ED in (wide_ED[:, ::2], np.asfortranarray(wide_ED[:, :5]), wide_ED[::-1, 5:],
                      np.broadcast_to(wide_ED[:1, :5], (9, 5)), wide_ED[:, :5].astype(np.float64),
                      wide_ED[:, :5].astype(np.int32), wide_ED[:, :5].tolist()):
        assert_same(*run_both(core, topology_aware_dispatch, placement, tokens_ED, topo))
        assert_same(*run_both(core, dispatch_rows, placement, tokens_ED, topo, [4, 0, 4]))
        assert_same(*run_both(core, dispatch_device_load, placement, tokens_ED, topo))


def test_extreme_loads_overflowing_the_modeled_loads(core):
    """Finite loads near the float maximum make the modeled device loads inf or NaN; the core orders
    them as numpy does (NaN last) and makes the same comparisons."""
    rng = np.random.default_rng(23)
    for i in range(300):
        topo = Topology([(2, 2), (3, 2), (5, 3, 8), (1,), (4, 4, 4)][i % 5])
        D = topo.num_devices
        E = int(rng.integers(2, 20))
        shard = Placement.from_owners(rng.integers(0, D, E), D)
        load_E = rng.choice([0.0, 1e308, 1.7e308, 5e307, 1.0, 1e-320], E)
        with np.errstate(all="ignore"):
            assert_same(*run_both(core, sparse_materialization, shard, load_E, int(rng.integers(1, E + 1)),
                                  int(rng.integers(1, 4)), topo))


def test_wide_counts_and_no_experts(core):
    topo = Topology((2, 2))
    placement = Placement(np.array([[True, False, True, True], [False, True, False, False]]))
    tokens_ED = np.array([[0, 2 ** 40 + 3, 7, 1], [5, 2 ** 33, 0, 3]], dtype=np.int64)
    for fn in (topology_aware_dispatch, dispatch_device_load):
        assert_same(*run_both(core, fn, placement, tokens_ED, topo))
    assert_same(*run_both(core, dispatch_rows, placement, tokens_ED, topo, [3, 1]))
    empty = Placement.empty(0, 4)
    for fn in (topology_aware_dispatch, dispatch_device_load):
        assert_same(*run_both(core, fn, empty, np.zeros((0, 4), dtype=np.int64), topo))
    assert_same(*run_both(core, sparse_materialization, Placement.from_owners([], 4), np.zeros(0), 3, 2, topo))


# --------------------------------------------------------------------------------------- calibration
def random_materialized(rng: np.random.Generator, shard: Placement, topo: Topology, t: int, m: int) -> Placement:
    """What calibration starts from: Alg. 1's output, or the shard with random replicas (which may
    already exceed the remaining budget or overlap degree)."""
    if rng.integers(3):
        placed = sparse_materialization(shard, make_loads(rng, shard.num_experts, int(rng.integers(5))), t, m, topo)
        return placed
    return Placement(shard.mask | (rng.random(shard.shape) < rng.choice([0.02, 0.1, 0.3])))


def calibration_case(rng: np.random.Generator, dpn: tuple[int, ...] | None = None):
    topo = Topology(dpn if dpn is not None else TOPOLOGIES[rng.integers(len(TOPOLOGIES))],
                    intra_node_bw=float(rng.choice([5e9, 1e11])), inter_node_bw=float(rng.choice([1e9, 2e10])))
    D = topo.num_devices
    E = int(rng.integers(1, 3 * D + 8))
    shard = Placement.from_owners(rng.integers(0, D, E) if rng.integers(2) else np.arange(E) % D, D)
    t, m = int(rng.integers(0, E + 3)), int(rng.integers(0, min(E, 6) + 2))
    tokens_ED = make_tokens(rng, E, D) if rng.integers(4) else rng.integers(0, 2, (E, D))   # also 0/1 counts
    layout = int(rng.integers(3))
    if layout == 1:
        tokens_ED = np.ascontiguousarray(tokens_ED)
    elif layout == 2:                                  # a strided view
        tokens_ED = np.repeat(tokens_ED, 2, axis=1)[:, ::2]
    kind = int(rng.integers(4))
    if kind == 0:
        actual_E = tokens_ED.sum(axis=1)               # the runtime's int64 sums
    elif kind == 1:
        actual_E = tokens_ED.sum(axis=1).astype(np.float64)
    else:                                              # loads unrelated to the counts: ties, zeros
        actual_E = make_loads(rng, E, int(rng.integers(5)))
    # Budgets: none, one that binds for some transfers, zero (binds for every transfer).
    budget = float(rng.choice([math.inf, 2e-4, 2e-3, 0.0]))
    cost = PlanCost(float(rng.choice([1e-6, 1e-4])), float(rng.choice([1e3, 1e5, 1e6, 16e6])), topo,
                    calibration_budget_s=budget)
    return topo, shard, random_materialized(rng, shard, topo, t, m), actual_E, t, m, tokens_ED, cost


def core_outcome(core, topo, shard, placed, actual_E, t, m, tokens_ED, cost) -> str:
    """Which way the core's calibration went (its return code and the compared times)."""
    E, D = shard.shape
    t = min(t, E)
    code, before_s, after_s, extra_s = core.calibrate(
        topo.core_layout, topo.core_layout, shard.mask, placed.mask, np.ascontiguousarray(actual_E, dtype=np.float64),
        False, t, min(m, t), tokens_ED, None if materialize._bincount_is_the_model(E, topo)
        else fluid_device_load(placed, np.asarray(actual_E, dtype=np.float64), topo),
        cost.expert_bytes, topo.intra_node_bw, topo.inter_node_bw, cost.calibration_budget_s, cost.time_per_token_s,
        np.empty((E, D), dtype=np.bool_), np.empty(E, dtype=np.int64))
    if code == 1:
        return "adopted"
    if extra_s == 0.0:
        return "nothing_to_add"
    if extra_s > cost.calibration_budget_s:
        return "over_budget"
    return "gain_too_small"


@pytest.mark.parametrize("seed", range(2))
def test_compiled_calibration_matches_numpy(core, seed):
    """Both steps in the core against the numpy code: the same Placement (mask and holder counts) and the
    same decision, over topologies, budgets that bind, tied and zero loads, E < D, token layouts."""
    rng = np.random.default_rng(300 + seed)
    seen = {key: 0 for key in ("adopted", "nothing_to_add", "over_budget", "gain_too_small", "few")}
    for _ in range(400):
        topo, shard, placed, actual_E, t, m, tokens_ED, cost = calibration_case(rng)
        fast, ref = run_both(core, calibrate, shard, placed, actual_E, t, m, topo, cost, tokens_ED)
        assert_same(fast, ref)
        outcome = core_outcome(core, topo, shard, placed, actual_E, t, m, tokens_ED, cost)
        assert (outcome == "adopted") == (ref is not placed), outcome
        if outcome == "adopted":
            assert placed.issubset(ref) and ref != placed
        else:
            assert fast is placed                            # the very same object, as numpy returns
        seen[outcome] += 1
        seen["few"] += shard.num_experts < shard.num_devices
    assert all(count > 0 for count in seen.values()), seen


def test_compiled_calibration_at_benchmark_scale(core):
    """4 nodes x 8 devices, E = 64 and 128, loads drifted away from the prediction: adoption and
    rejection both occur (a cheap transfer is adopted, the benchmark's 16 MB experts are not)."""
    rng = np.random.default_rng(41)
    topo = Topology.uniform(4, 8)
    outcomes = set()
    for E, t, m in [(64, 8, 2), (128, 16, 4)]:
        shard = Placement.contiguous(E, 32)
        popularity_E = rng.dirichlet(np.full(E, 0.3))
        for i in range(12):
            predicted_E = rng.multinomial(4096 * 8, popularity_E).astype(np.float64)
            placed = sparse_materialization(shard, predicted_E, t, m, topo)
            actual_E = popularity_E * np.exp(rng.normal(0.0, 0.3, E))
            tokens_ED = rng.multinomial(4096 * 8, actual_E / actual_E.sum(), size=32).T.astype(np.int64)
            cost = PlanCost(1e-6, [16e6, 1e3][i % 2], topo)
            fast, ref = run_both(core, calibrate, shard, placed, tokens_ED.sum(axis=1), t, m + 1, topo, cost,
                                 tokens_ED)
            assert_same(fast, ref)
            outcomes.add(ref is placed)
    assert outcomes == {True, False}


def test_compiled_calibration_where_the_core_takes_the_models_loads(core):
    """One node (the model is a matrix product) and a shape whose column sums are not sequential: the
    starting loads come from the numpy model, the rest from the core."""
    rng = np.random.default_rng(43)
    adopted = 0
    for _ in range(40):
        topo, shard, placed, actual_E, t, m, tokens_ED, cost = calibration_case(rng, dpn=(int(rng.integers(1, 9)),))
        fast, ref = run_both(core, calibrate, shard, placed, actual_E, t, m, topo, cost, tokens_ED)
        assert_same(fast, ref)
        adopted += ref is not placed
    assert adopted > 0
    big = Topology((4, 4))
    shard = Placement.from_owners(rng.integers(0, 8, 5000), 8)
    tokens_ED = rng.multinomial(200000, rng.dirichlet(np.full(5000, 0.3)), size=8).T.astype(np.int64)
    placed = sparse_materialization(shard, rng.dirichlet(np.full(5000, 0.3)) * 1e6, 12, 3, big)
    fast, ref = run_both(core, calibrate, shard, placed, tokens_ED.sum(axis=1), 12, 4, big,
                         PlanCost(1e-6, 1e3, big), tokens_ED)
    assert_same(fast, ref)
    assert ref is not placed


def test_device_loads_with_counts_around_the_32_bit_boundary(core):
    """The core's Alg. 3 quotients come from a reciprocal below 2^32 tokens and from a division above:
    counts at exact multiples of the holder counts and on both sides of 2^32."""
    rng = np.random.default_rng(53)
    topo = Topology((3, 2, 3))
    shard = Placement.from_owners(rng.integers(0, 8, 12), 8)
    for _ in range(60):
        placement = Placement(shard.mask | (rng.random((12, 8)) < rng.random()))
        k_ED = rng.integers(1, 9, (12, 8))
        near_ED = rng.choice([2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, 2 ** 31, 0], (12, 8)) + rng.integers(-40, 40, (12, 8))
        for tokens_ED in (k_ED * rng.integers(0, 2 ** 29, (12, 8)), np.maximum(near_ED, 0),
                          rng.integers(0, 2 ** 33, (12, 8))):
            tokens_ED = tokens_ED.astype(np.int64)
            assert_same(*run_both(core, dispatch_device_load, placement, tokens_ED, topo))
            assert_same(*run_both(core, calibrate, shard, placement, tokens_ED.sum(axis=1) // 8, 6, 3, topo,
                                  PlanCost(1e-12, 1.0, topo), tokens_ED))


class _DoubledTransfers(PlanCost):
    def transfer_time(self, shard: Placement, placement: Placement) -> float:
        return 2.0 * super().transfer_time(shard, placement)


def test_compiled_calibration_hands_other_inputs_to_numpy(core):
    """Inputs outside the core's conventions give numpy's result or numpy's ValueError: a PlanCost
    subclass, an integer budget, token counts of another dtype, loads as a list, a cost topology that
    differs from the dispatch topology, P ⊄ P', bad loads and counts, negative token counts."""
    rng = np.random.default_rng(47)
    topo = Topology((2, 2))
    shard = Placement.from_owners([0, 1, 2, 3, 0, 1], 4)
    placed = Placement(shard.mask | np.eye(6, 4, k=1, dtype=bool))
    tokens_ED = rng.integers(0, 50, (6, 4)).astype(np.int64)
    tokens_ED[0] += 400                                     # expert 0 is hot: calibration adds replicas
    load_E = tokens_ED.sum(axis=1)
    costs = [PlanCost(1e-6, 1e3, topo), _DoubledTransfers(1e-6, 1e3, topo), PlanCost(1e-6, 1e3, topo, 1),
             PlanCost(1e-6, 1e3, Topology((1, 3))), PlanCost(1e-6, 1e3, Topology((3, 1), 1e6, 1e6))]
    for cost in costs:
        for tokens in (tokens_ED, tokens_ED.astype(np.int32), tokens_ED.astype(np.float64)):
            for load in (load_E, load_E.tolist()):
                assert_same(*run_both(core, calibrate, shard, placed, load, 4, 2, topo, cost, tokens))
    assert run_both(core, calibrate, shard, placed, load_E, 4, 2, topo, costs[0], tokens_ED)[1] is not placed
    bad_calls = [
        (Placement.from_owners([2, 1, 2, 3, 0, 1], 4), placed, load_E, 4, 2, tokens_ED, "P ⊄ P'"),
        (shard, placed, -load_E, 4, 2, tokens_ED, "negative entries"),
        (shard, placed, load_E * np.nan, 4, 2, tokens_ED, "NaN"),
        (shard, placed, load_E[:5], 4, 2, tokens_ED, "shape"),
        (shard, placed, load_E, -1, 2, tokens_ED, "overlap_degree"),
        (shard, placed, load_E, 4, 2.0, tokens_ED, "materialization_budget"),
        (shard, placed, load_E, 4, 2, -tokens_ED, "negative counts"),
        (shard, placed, load_E, 4, 2, tokens_ED[:, :3], "shape"),
        (shard, placed, -load_E, -1, 2, -tokens_ED, "negative entries"),         # the first check speaks
    ]
    for args in bad_calls:
        fast, ref = run_both(core, calibrate, *args[:5], topo, costs[0], args[5])
        assert fast == ref and args[6] in ref, (fast, ref)
    fast, ref = run_both(core, calibrate, shard, placed, load_E, 4, 2, topo, PlanCost(1e-6, 1e3, Topology((3, 2))),
                         tokens_ED)
    assert fast == ref and "topology" in ref
    # Negative counts only matter once the gain is weighed: an early return never reads them.
    assert_same(*run_both(core, calibrate, shard, placed, load_E, 4, 0, topo, costs[0], -tokens_ED))


# --------------------------------------------------------------------------------------- errors
def test_bad_input_fails_alike(core):
    topo = Topology((2, 2))
    shard = Placement.from_owners([0, 1, 2], 4)
    bad_loads = ([1.0, -2.0, 0.0], [1.0, math.nan, 0.0], [math.inf, 1.0, 0.0], [1.0, 2.0], [[1.0, 2.0, 3.0]])
    for load_E in bad_loads:
        fast, ref = run_both(core, sparse_materialization, shard, load_E, 2, 1, topo)
        assert fast == ref and str(ref).startswith("ValueError")
    for args in ((-1, 1), (2, 1.5), (True, 1)):       # bad counts; with bad loads too, loads come first
        fast, ref = run_both(core, sparse_materialization, shard, [1.0, 2.0, 3.0], *args, topo)
        assert fast == ref and "ValueError" in ref
        fast, ref = run_both(core, sparse_materialization, shard, [1.0, -2.0, 3.0], *args, topo)
        assert fast == ref and "negative entries" in ref
    fast, ref = run_both(core, sparse_materialization, shard, [1.0, 2.0, 3.0], 2, 1, Topology((2, 3)))
    assert fast == ref and "topology" in ref
    orphan = Placement(np.array([[True, False, False, False], [False, False, False, False]]))
    cases = [
        (orphan, np.array([[1, 0, 0, 0], [0, 2, 0, 0]]), topo, "has tokens but no holder"),
        (orphan, np.array([[1, -1, 0, 0], [0, 0, 0, 0]]), topo, "negative counts"),
        (orphan, np.array([[1, 0, 0, 0], [0, 0, 0, 0]]), Topology((4, 4)), "topology"),
        (orphan, np.array([[1, 0, 0], [0, 0, 0]]), topo, "shape"),
        (orphan, np.array([[1.5, 0, 0, 0], [0, 0, 0, 0]]), topo, "whole numbers"),
    ]
    for placement, tokens_ED, topology, message in cases:
        for fn in (topology_aware_dispatch, dispatch_device_load):
            fast, ref = run_both(core, fn, placement, tokens_ED, topology)
            assert fast == ref and message in ref, (fast, ref)
        for sources in (1, [0, 1], [5]):
            fast, ref = run_both(core, dispatch_rows, placement, tokens_ED, topology, sources)
            assert fast == ref and message in ref, (fast, ref)
    for sources in (4, -1, [0, 4], [[0]]):
        fast, ref = run_both(core, dispatch_rows, orphan, np.zeros((2, 4), dtype=np.int64), topo, sources)
        assert fast == ref and "sources must be device ids" in ref
