"""Policies (Themis and the §5.1 baselines) behind one interface, and the cost interface."""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.planner import (
    BYTE_CATEGORIES, POLICY_NAMES, LoadPredictor, PlanCost, Placement, Topology, device_compute_load,
    make_policy, straggler_time, topology_aware_dispatch,
)
from themis_compile.planner.cost import all_to_all_time, sparse_transfer_time

TOPO = Topology.uniform(2, 4)
E, L = 16, 2


def _policies(psi=1000.0):
    extra = {"themis": dict(overlap_degree=4, materialization_budget=2, reshard_interval=3),
             "themis-rm": dict(overlap_degree=4, materialization_budget=2, reshard_interval=3),
             "smartmoe": dict(swap_interval=2), "eplb": dict(interval=2), "flexmoe": dict(threshold=1.05)}
    return {n: make_policy(n, L, E, TOPO, psi, token_bytes=8.0, time_per_token_s=1e-6, **extra.get(n, {}))
            for n in POLICY_NAMES}


def _trace(iterations=7, seed=0):
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.3))
    for _ in range(iterations):
        yield [rng.multinomial(2048, pop, size=TOPO.num_devices).T for _ in range(L)]


def test_all_policies_keep_the_contract_and_themis_beats_ep():
    policies = _policies()
    predictor = LoadPredictor(L, E)
    straggler = {n: 0 for n in policies}
    seen = {n: {c: 0 for c in BYTE_CATEGORIES} for n in policies}
    for tokens_L in _trace():
        for layer, tokens in enumerate(tokens_L):
            for name, policy in policies.items():
                step = policy.plan(layer, predictor.predict(layer), tokens)
                routed = step.info.get("tokens_ED", tokens)
                assert (step.R.sum(axis=2) == routed).all(), name
                assert step.shard.is_shard_placement() and step.shard <= step.placement, name
                assert not step.R.sum(axis=1)[~step.placement.mask].any(), name
                assert set(step.bytes_moved) == set(BYTE_CATEGORIES), name
                assert all(v >= 0 for v in step.bytes_moved.values()), name
                for c, v in step.bytes_moved.items():
                    seen[name][c] += v
                straggler[name] += int(device_compute_load(step.R).max())
            predictor.update(layer, tokens.sum(axis=1))
    assert straggler["themis"] < straggler["ep"]
    assert straggler["uniform"] < straggler["ep"]
    assert seen["themis"]["spag"] > 0 and seen["themis"]["spag"] + seen["themis"]["spag_calibration"] \
        == seen["themis"]["sprs"]
    assert seen["themis-rm"]["spag_remat"] == seen["themis-rm"]["sprs"]
    assert seen["themis"]["reshard"] > 0
    assert seen["ep"]["spag"] == seen["ep"]["migration"] == seen["ep"]["allreduce"] == 0
    assert seen["fastermoe"]["broadcast"] == seen["fastermoe"]["reduce"] > 0
    assert seen["smartmoe"]["migration"] > 0
    assert seen["flexmoe"]["allreduce"] > 0 and seen["flexmoe"]["migration"] > 0
    assert seen["eplb"]["allreduce"] > 0 and seen["eplb"]["migration"] > 0
    assert seen["ep"]["a2a"] >= seen["ep"]["a2a_inter"] > seen["themis"]["a2a_inter"]


def test_policy_bad_input():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", 1, 4, TOPO)
    policy = make_policy("ep", 1, 4, Topology((2,)))
    with pytest.raises(ValueError, match="out of range"):
        policy.plan(1, np.ones(4), np.ones((4, 2), int))
    with pytest.raises(ValueError, match="negative"):
        policy.plan(0, -np.ones(4), np.ones((4, 2), int))
    with pytest.raises(ValueError):
        make_policy("themis", 1, 4, TOPO, overlap_degree=-1, materialization_budget=1)


def test_cost_interface():
    topo = Topology.uniform(2, 2)
    cost = PlanCost(time_per_token_s=2e-6, expert_bytes=1e6, topology=topo)
    shard = Placement.contiguous(4, 4)
    mask = shard.mask.copy()
    mask[0, :] = True
    placement = Placement(mask)
    # Device 1, 2 and 3 each receive one chunk (1 MB at 5 GB/s); node 1 is entered by one chunk (1 GB/s).
    assert cost.transfer_time(shard, placement) == pytest.approx(1e6 / 1e9)
    assert cost.transfer_time(shard, placement) == sparse_transfer_time(shard, placement, 1e6, topo)
    tokens = np.full((4, 4), 10)
    R = topology_aware_dispatch(placement, tokens, topo)
    # Every device keeps its own tokens of expert 0 (local first) and computes its owned expert's 40 tokens.
    assert device_compute_load(R).tolist() == [10, 50, 50, 50]
    assert cost.compute_time(R) == pytest.approx(50 * 2e-6) == straggler_time(device_compute_load(R), 2e-6)
    # The all-to-all bound recomputed from its definition: device links inside a node, node networks across.
    flow_DD = R.sum(axis=0)
    np.fill_diagonal(flow_DD, 0)
    same = topo.same_node
    intra = max(np.where(same, flow_DD, 0).sum(0).max(), np.where(same, flow_DD, 0).sum(1).max())
    inter_DD = np.where(same, 0, flow_DD)
    node_in = [inter_DD[:, 2 * n:2 * n + 2].sum() for n in range(2)]
    node_out = [inter_DD[2 * n:2 * n + 2, :].sum() for n in range(2)]
    want = max(intra * 1e3 / topo.intra_node_bw, max(node_in + node_out) * 1e3 / topo.inter_node_bw)
    assert all_to_all_time(R, 1e3, topo) == pytest.approx(want) and want > 0
    assert all_to_all_time(R, 1e3, Topology.uniform(1, 4)) == pytest.approx(
        max(flow_DD.sum(0).max(), flow_DD.sum(1).max()) * 1e3 / Topology.uniform(1, 4).intra_node_bw)
    with pytest.raises(ValueError):
        PlanCost(time_per_token_s=-1.0, expert_bytes=1.0, topology=topo)
