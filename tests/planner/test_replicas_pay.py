"""`planner.cost.replicas_pay`: Alg. 1's replicas are materialized only where the compute they save
exceeds their SpAG + SpRS."""

from __future__ import annotations

import numpy as np

from themis_compile.planner import PlanCost, Placement, Topology, materialize_pairs, replicas_pay
from themis_compile.runtime.fssdp import _added_pairs

E, D = 8, 4


def _added(load_E, topology, t=4, m=2):
    shard = Placement.contiguous(E, D)
    full_J, replicas_X = materialize_pairs(shard, np.asarray(load_E, dtype=np.float64), t, m, topology)
    return shard.owners(), _added_pairs(shard.owners(), full_J, replicas_X, D)


def test_replicas_at_even_loads_never_pay():
    # Alg. 1's replicas for a hot expert 0, judged at even loads (a predicted skew that did not come, or a
    # predictor without history): they only move work between devices.
    topology = Topology.single_node(D)
    owners_E, added_X = _added(np.array([800.0, 10, 10, 10, 10, 10, 10, 10]), topology)
    assert added_X.size > 0
    cost = PlanCost(time_per_token_s=1.0, expert_bytes=1.0, topology=topology)     # transfers free, compute dear
    assert not replicas_pay(np.full(E, 100.0), owners_E, added_X, cost)


def test_skew_pays_unless_the_transfers_cost_more():
    topology = Topology.single_node(D)
    load_E = np.array([800.0, 10, 10, 10, 10, 10, 10, 10])
    owners_E, added_X = _added(load_E, topology)
    assert added_X.size > 0
    assert replicas_pay(load_E, owners_E, added_X, PlanCost(time_per_token_s=1e-6, expert_bytes=1e3, topology=topology))
    # One chunk at 5 GB/s takes 2 s; the ~500 tokens saved at 1 µs each do not cover it.
    assert not replicas_pay(load_E, owners_E, added_X,
                            PlanCost(time_per_token_s=1e-6, expert_bytes=1e10, topology=topology))
    assert not replicas_pay(load_E, owners_E, added_X[:0], PlanCost(1.0, 1.0, topology))


def test_crossing_nodes_costs_more_than_staying_inside():
    load_E = np.array([800.0, 10, 10, 10, 10, 10, 10, 10])
    one = Topology.single_node(D)
    two = Topology.uniform(2, D // 2, inter_node_bw=1e8)
    owners_E, added_X = _added(load_E, two)
    # Priced so that the intra-node transfer pays and the inter-node one does not.
    psi = 2e6
    assert replicas_pay(load_E, owners_E, added_X, PlanCost(time_per_token_s=2e-5, expert_bytes=psi, topology=one))
    assert not replicas_pay(load_E, owners_E, added_X, PlanCost(time_per_token_s=2e-5, expert_bytes=psi, topology=two))
