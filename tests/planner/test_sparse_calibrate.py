"""Calibration (§4.2) from the pairs (`materialize._calibrate_pairs`, the runtime's path under summary
statistics) decides exactly as the dense numpy code with the same fluid compute model, and builds no
[E, D] matrix."""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.planner import Placement, PlanCost, Topology, calibrate, materialize_pairs
from themis_compile.planner.materialize import compiled_core

pytestmark = pytest.mark.skipif(compiled_core() is None, reason="the pairs path runs on the compiled core")


def _case(seed: int, D: int, dpn: int, E: int, t: int, m: int):
    rng = np.random.default_rng(seed)
    topology = Topology.uniform(D // dpn, dpn)
    shard = Placement.from_owners(rng.integers(0, D, size=E), D)
    predicted = rng.multinomial(50 * E, rng.dirichlet(np.full(E, 0.3))).astype(np.float64)
    full_J, replicas_X = materialize_pairs(shard, predicted, t, m, topology)
    added = np.union1d(replicas_X, (full_J[:, None] * D + np.arange(D)).reshape(-1))
    added = added[added % D != shard.owners()[added // D]]
    planned = Placement.from_pairs(np.union1d(shard.flat_ids(), added), E, D)
    actual = rng.multinomial(50 * E, rng.dirichlet(np.full(E, 0.3))).astype(np.int64)
    cost = PlanCost(float(rng.choice([1e-7, 1e-6, 1e-5])), float(rng.choice([1e3, 1e5])), topology)
    return shard, planned, actual, topology, cost


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("D,dpn,E,t,m", [(8, 8, 32, 6, 2), (16, 4, 48, 12, 3), (32, 8, 64, 40, 2), (12, 3, 12, 5, 5)])
def test_pairs_path_decides_as_the_dense_code(seed, D, dpn, E, t, m) -> None:
    shard, planned, actual, topology, cost = _case(seed, D, dpn, E, t, m)
    sparse = calibrate(shard, planned, actual, t, m, topology, cost)
    assert shard.is_sparse and planned.is_sparse          # nothing read the [E, D] matrices
    dense = calibrate(Placement(shard.mask), Placement(planned.mask), actual, t, m, topology, cost)
    assert sparse == dense
    assert (sparse is planned) == (dense.digest() == planned.digest())


@pytest.mark.parametrize("seed", range(20))
def test_top_experts_by_partition_select_as_a_stable_sort(seed) -> None:
    from themis_compile.planner.materialize import _by_load, _top_experts_fast

    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 40))
    load = rng.integers(0, 5, size=E).astype(np.float64)          # many ties
    for k in range(E + 2):
        expected = np.argsort(-load, kind="stable")[:k]
        got = _top_experts_fast(load, k)
        assert got.tolist() == sorted(expected.tolist())
        assert _by_load(got, load).tolist() == expected.tolist()
