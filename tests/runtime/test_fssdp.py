from __future__ import annotations

import pytest
import torch

import themis_compile
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import assert_equivalent, train_distributed, train_reference

STEPS, BATCH, SEQ = 8, 8, 16


def _stats(model, opt, step):
    runtime = themis_compile.api.runtime_of(model)
    return [(s.iteration, s.layer, s.delta_p) for s in runtime.stats if s.iteration == step]


def _run(rank, world_size, cases):
    return [train_distributed(rank, world_size, mk, ck, STEPS, BATCH, SEQ, step_callback=_stats)
            for mk, ck in cases]


SKEWED = dict(name="tiny-moe", router_skew=2.0)
CASES_2 = [
    (dict(SKEWED, experts_form="loop", top_k=2), {"policy": "themis"}),
    (dict(SKEWED, experts_form="stacked", top_k=2), {"policy": "themis-rm"}),
]


def test_themis_matches_single_process_2_ranks():
    results = run_multirank(_run, 2, args=(CASES_2,), timeout_s=60)
    for i, (mk, _) in enumerate(CASES_2):
        assert_equivalent(train_reference(mk, STEPS, BATCH, SEQ), [r[i] for r in results])
        # The plans really added replicas under the skewed router.
        delta = [d for step in results[0][i][3] for (_, _, d) in step]
        assert sum(delta) > 0


def _optimizer_state_owners(model, opt):
    """(layer, expert) pairs whose optimizer state lives on this rank."""
    runtime = themis_compile.api.runtime_of(model)
    owners = []
    for li, layer in enumerate(runtime.layers.values()):
        for e, params in layer.local_chunks().items():
            if all(p in opt.state and opt.state[p] for p in params):
                owners.append((li, e))
    return owners


def _reshard_stats(model, opt, step):
    runtime = themis_compile.api.runtime_of(model)
    return (_optimizer_state_owners(model, opt), runtime.reshard_scheduler.moved,
            sum(s.delta_p for s in runtime.stats if s.iteration == step))


def _run_reshard(rank, world_size, cases):
    return [train_distributed(rank, world_size, mk, ck, STEPS, BATCH, SEQ, step_callback=_reshard_stats)
            for mk, ck in cases]


CASES_4 = [
    # E=6 over 4 ranks (2, 2, 1, 1); two nodes of two; re-sharding every 3 steps.
    (dict(SKEWED, experts_form="loop", top_k=2, num_experts=6),
     {"policy": "themis", "reshard_interval": 3, "check_plans": True}),
    (dict(SKEWED, experts_form="stacked", top_k=1, num_experts=3, shared_expert=True),
     {"policy": "themis-rm", "reshard_interval": 3}),
]


def test_themis_4_ranks_two_nodes_with_resharding():
    results = run_multirank(_run_reshard, 4, args=(CASES_4,), devices_per_node=2, timeout_s=60)
    for i, (mk, _) in enumerate(CASES_4):
        per_rank = [r[i] for r in results]
        assert_equivalent(train_reference(mk, STEPS, BATCH, SEQ), per_rank)
        num_layers = 2
        num_experts = mk["num_experts"]
        for step in range(STEPS):
            owners = [o for r in per_rank for o in r[3][step][0]]
            # Optimizer state of every expert exists on exactly one rank at every step.
            assert sorted(owners) == sorted({(li, e) for li in range(num_layers) for e in range(num_experts)})
        assert per_rank[0][3][-1][1] > 0, "re-sharding never moved an expert"
        assert sum(s[2] for s in per_rank[0][3]) > 0, "no replicas were materialized"
