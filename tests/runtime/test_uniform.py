"""The ``uniform`` policy is the force-balanced ideal on themis' own path: the FSSDP layers with every pair
routed round-robin over the experts (``uniform_ids``) and no replicas. On 2 gloo ranks it trains equal to
one process whose routers spread the pairs the same way, every layer perfectly balanced, nothing
materialized."""

from __future__ import annotations

import torch

from themis_compile.api import _make_uniform_route
from themis_compile.runtime.fssdp import FSSDPExperts
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import assert_equivalent, train_distributed, train_reference

SPEC = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=8)
STEPS, BATCH, SEQ = 4, 8, 16


def _uniform_routers(model) -> None:
    for block in model.moe_layers():
        block.route = _make_uniform_route(block.route, block.num_experts)


def _stats(model, opt, step):
    from themis_compile.api import runtime_of

    runtime = runtime_of(model)
    layers = list(runtime.layers.values())
    return ([s.imbalance for s in runtime.stats if s.iteration == step], [s.delta_p for s in runtime.stats
                                                                          if s.iteration == step],
            all(isinstance(layer, FSSDPExperts) and layer.uniform_routing for layer in layers))


def _train(rank, world_size):
    torch.set_num_threads(1)
    return train_distributed(rank, world_size, SPEC, {"policy": "uniform"}, STEPS, BATCH, SEQ, step_callback=_stats)


def test_uniform_is_themis_path_balanced_and_equal_to_one_process():
    reference = train_reference(SPEC, STEPS, BATCH, SEQ, prepare=_uniform_routers)
    results = run_multirank(_train, 2, timeout_s=120)
    assert_equivalent(reference, results)
    for result in results:
        for imbalance, delta_p, on_fssdp in result[3]:
            assert on_fssdp and imbalance and all(i == 1.0 for i in imbalance) and not any(delta_p)
