"""Calibration (§4.2) from the pairs (`materialize._calibrate_pairs`, the runtime's path under summary
statistics: one call of the compiled core) decides exactly as the dense code with the same fluid compute
model — the compiled core's and numpy's (``THEMIS_PLANNER_NUMPY=1``) — and builds no [E, D] matrix."""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.planner import Placement, PlanCost, Topology, calibrate, materialize_pairs
from themis_compile.planner.backend import using
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


CASES = [(8, 8, 32, 6, 2), (16, 4, 48, 12, 3), (32, 8, 64, 40, 2), (12, 3, 12, 5, 5), (64, 8, 256, 32, 2)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("D,dpn,E,t,m", CASES)
def test_pairs_path_decides_as_the_dense_code(seed, D, dpn, E, t, m) -> None:
    shard, planned, actual, topology, cost = _case(seed, D, dpn, E, t, m)
    sparse = calibrate(shard, planned, actual, t, m, topology, cost)
    assert shard.is_sparse and planned.is_sparse          # nothing read the [E, D] matrices
    dense = calibrate(Placement(shard.mask), Placement(planned.mask), actual, t, m, topology, cost)
    assert sparse == dense
    assert (sparse is planned) == (dense.digest() == planned.digest())
    assert np.array_equal(sparse.copy_counts(), dense.copies())
    with using(None):                                     # numpy's dense code, no compiled core
        numpy_dense = calibrate(Placement(shard.mask), Placement(planned.mask), actual, t, m, topology, cost)
    assert numpy_dense == sparse


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cost_nodes", [1, 2])
def test_pairs_path_weighs_on_the_cost_topology(seed, cost_nodes) -> None:
    """Step 2 on a cost topology other than the planning one (same devices, other nodes) decides as the
    dense code, which weighs both steps' placements there."""
    shard, planned, actual, topology, cost = _case(seed, 16, 4, 48, 12, 3)
    cost = PlanCost(cost.time_per_token_s, cost.expert_bytes, Topology.uniform(cost_nodes, 16 // cost_nodes,
                                                                               inter_node_bw=3e8))
    sparse = calibrate(shard, planned, actual, 12, 3, topology, cost)
    dense = calibrate(Placement(shard.mask), Placement(planned.mask), actual, 12, 3, topology, cost)
    assert sparse == dense


def test_pairs_path_leaves_bad_inputs_to_the_dense_checks() -> None:
    shard, planned, actual, topology, cost = _case(0, 16, 4, 48, 12, 3)
    with pytest.raises(ValueError, match="does not contain"):
        calibrate(Placement.from_owners((shard.owners() + 1) % 16, 16), planned, actual, 12, 3, topology, cost)
    bad = actual.astype(np.float64)
    bad[3] = -1.0
    with pytest.raises(ValueError, match="negative"):
        calibrate(shard, planned, bad, 12, 3, topology, cost)
