"""The sparse per-rank path (`materialize_pairs`, `own_row_entries`): the same plan as the dense
`sparse_materialization` + `dispatch_rows`, through the compiled core and through numpy."""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.planner import (
    Placement, Topology, backend, dispatch_rows, materialize_pairs, own_row_entries, sparse_materialization,
)

TOPOLOGIES = [(1,), (3,), (2, 2), (5, 3, 8), (4, 4, 4), (8,) * 6, (1, 3, 2, 4) * 3]
CORES = [None] + ([backend.compiled_core()] if backend.compiled_core() is not None else [])


def _case(rng):
    topo = Topology(TOPOLOGIES[rng.integers(len(TOPOLOGIES))])
    D = topo.num_devices
    E = int(rng.integers(1, 4 * D + 2))
    shard = Placement.from_owners(rng.integers(0, D, E), D)
    if rng.integers(3) == 0:
        load_E = rng.integers(0, 4, E).astype(np.float64)            # exact ties
    else:
        load_E = rng.dirichlet(np.full(E, 0.3)) * 1e5
    t = int(rng.integers(0, min(E, 24) + 1))
    m = int(rng.integers(0, t + 2))
    tokens_ED = rng.multinomial(int(rng.integers(0, 4000)), rng.dirichlet(np.full(E, 0.5)), size=D).T
    return topo, shard, load_E, t, m, np.ascontiguousarray(tokens_ED.astype(np.int64))


@pytest.mark.parametrize("core", CORES, ids=lambda c: "numpy" if c is None else "c")
def test_sparse_path_equals_the_dense_plan(core):
    rng = np.random.default_rng(53)
    branches = set()
    with backend.using(core):
        for _ in range(120):
            topo, shard, load_E, t, m, tokens_ED = _case(rng)
            D = topo.num_devices
            dense = sparse_materialization(shard, load_E, t, m, topo)
            full_J, pairs_X = materialize_pairs(shard, load_E, t, m, topo)
            rebuilt = shard.mask.copy()
            rebuilt.reshape(-1)[pairs_X] = True
            rebuilt[full_J] = True
            assert np.array_equal(rebuilt, dense.mask)
            assert not np.isin(pairs_X // D, full_J).any() and (D > 1 or full_J.size == 0)
            replicated_E = (dense.mask & ~shard.mask).any(axis=1)
            assert np.array_equal(full_J, np.flatnonzero((dense.copies() == D) & replicated_E))
            branches.add("everywhere" if full_J.size and m >= t else "lpt" if pairs_X.size else "none")
            for rank in {0, D - 1, int(rng.integers(D))}:
                row_ED = dispatch_rows(dense, tokens_ED, topo, rank)
                start_E, dest_Y, count_Y = own_row_entries(shard.owners(), full_J, pairs_X, tokens_ED[:, rank], topo,
                                                           rank)
                e_Y, d_Y = np.nonzero(row_ED)
                assert np.array_equal(np.repeat(np.arange(shard.num_experts), np.diff(start_E)), e_Y)
                assert np.array_equal(dest_Y, d_Y)
                assert np.array_equal(count_Y, row_ED[e_Y, d_Y])
    assert branches == {"everywhere", "lpt", "none"}


def test_sparse_path_rejects_bad_input():
    topo = Topology((2, 2))
    shard = Placement.from_owners([0, 1, 2, 3], 4)
    with pytest.raises(ValueError, match="negative"):
        materialize_pairs(shard, np.array([1.0, -1.0, 0.0, 0.0]), 2, 1, topo)
    none = np.array([], dtype=np.int64)
    ones = np.ones(4, dtype=np.int64)
    for core in CORES:
        with backend.using(core):
            with pytest.raises(ValueError, match="rank"):
                own_row_entries(shard.owners(), none, none, ones, topo, 4)
            with pytest.raises(ValueError, match="negative"):
                own_row_entries(shard.owners(), none, none, -ones, topo, 0)
            for full, pairs in [(none, [0]), (none, [6, 5]), ([1], [5]), ([2, 1], none), ([4], none)]:
                # a replica at its owner, unsorted replicas, a replica in a full expert, unsorted or
                # out-of-range full experts
                with pytest.raises(ValueError, match="ascending"):
                    own_row_entries(shard.owners(), np.array(full, dtype=np.int64), np.array(pairs, dtype=np.int64),
                                    ones, topo, 0)


def test_sparse_path_at_scale():
    """256 devices, E = 1,024, top-t everywhere and the LPT branch: the sparse plan is the dense one."""
    topo = Topology.uniform(32, 8)
    D, E = topo.num_devices, 1024
    rng = np.random.default_rng(59)
    shard = Placement.contiguous(E, D)
    tokens_ED = np.ascontiguousarray(rng.multinomial(4096 * 8, rng.dirichlet(np.full(E, 0.3)), size=D).T)
    load_E = tokens_ED.sum(axis=1).astype(np.float64)
    for t, m in [(23, 213), (23, 4)]:
        dense = sparse_materialization(shard, load_E, t, m, topo)
        full_J, pairs_X = materialize_pairs(shard, load_E, t, m, topo)
        assert (full_J.size, pairs_X.size > 0) == ((23, False) if m >= t else (0, True))
        for rank in (0, 77, D - 1):
            row_ED = dispatch_rows(dense, tokens_ED, topo, rank)
            start_E, dest_Y, count_Y = own_row_entries(shard.owners(), full_J, pairs_X, tokens_ED[:, rank], topo, rank)
            e_Y, d_Y = np.nonzero(row_ED)
            assert np.array_equal(np.repeat(np.arange(E), np.diff(start_E)), e_Y)
            assert np.array_equal(dest_Y, d_Y) and np.array_equal(count_Y, row_ED[e_Y, d_Y])
