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
