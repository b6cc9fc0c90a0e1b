"""8 ranks as 2 nodes x 4 train the tiny models exactly like one process, under themis, themis-rm and ep.

One spawn of 8 gloo ranks: every rank trains the reference model (ModuleList experts, 8 of them, top-2)
and a tiny HF Mixtral (8 experts) under each policy in turn, and the global losses per step and the
parameters at the end must equal single-process training on the whole global batch. The two nodes are
Linux network namespaces joined by a shaped bridge (`EmulatedNodes`, the emulation of
``bench step --network emulated``) where this host can build them (root), so that intra-node traffic
stays on a node's loopback and inter-node traffic really crosses the bridge; elsewhere the nodes are
declared (``devices_per_node=4``: the same topology for the planner, every byte over loopback). Both
run the same assertions. Re-sharding every 2 steps with a fixed overlap degree and budget, so that the
plans really materialize replicas and move experts across the node boundary.
"""

from __future__ import annotations

import contextlib

from themis_compile.testing import run_multirank
from themis_compile.testing.netns import EmulatedNodes
from tests.runtime.equivalence import assert_equivalent, train_distributed, train_reference

WORLD, PER_NODE = 8, 4
STEPS, BATCH, SEQ = 4, 8, 16          # one sequence per rank
POLICIES = ("themis", "themis-rm", "ep")
MODELS = {
    "ref-loop": dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=8),
    "mixtral": dict(hf="mixtral", num_experts=8),
}
CONFIG = {"reshard_interval": 2, "check_plans": True, "overlap_degree": 8, "materialization_budget": 2,
          "cost_benefit": False}   # replicas even where the tiny experts cannot pay for them


def _record(model, opt, step):
    import themis_compile

    runtime = themis_compile.api.runtime_of(model)
    moved = getattr(getattr(runtime, "reshard_scheduler", None), "moved", 0)
    return moved, sum(s.delta_p for s in getattr(runtime, "stats", ()) if s.iteration == step)


def _train_all(rank: int, world_size: int) -> list:
    import os

    out = [train_distributed(rank, world_size, MODELS[name], {"policy": policy, **CONFIG}, STEPS, BATCH, SEQ,
                             step_callback=_record)
           for name in MODELS for policy in POLICIES]
    return [os.environ.get("GLOO_SOCKET_IFNAME"), out]


def _network():
    if EmulatedNodes.unavailable_reason() is not None:
        return contextlib.nullcontext(None)
    return EmulatedNodes(WORLD // PER_NODE, inter_node_bw=1e9, latency_ms=50.0)


def test_eight_ranks_on_two_nodes_match_one_process():
    with _network() as net:
        results = run_multirank(_train_all, WORLD, devices_per_node=PER_NODE, network=net, timeout_s=120)
    if net is not None:
        assert all(ifname == net.ifname for ifname, _ in results), "ranks did not run inside their node"
    cases = [(name, policy) for name in MODELS for policy in POLICIES]
    references = {name: train_reference(spec, STEPS, BATCH, SEQ) for name, spec in MODELS.items()}
    for i, (name, policy) in enumerate(cases):
        per_rank = [out[i] for _, out in results]
        try:
            assert_equivalent(references[name], per_rank, atol=1e-3)
        except AssertionError as exc:
            raise AssertionError(f"{name}/{policy} on {WORLD} ranks: {exc}") from exc
        records = per_rank[0][3]
        if policy != "ep":
            assert records[-1][0] > 0, f"{name}/{policy}: re-sharding never moved an expert"
            assert sum(delta for _, delta in records) > 0, f"{name}/{policy}: no replicas were materialized"
