"""Alg. 2 heterogeneous sharding (§4.3) and the homogeneous (EP) sharding it starts from.

All MoE layers are sharded at once so that every device spends the same memory on expert state
(equal slots), while a device may own any number of experts of one particular layer. Underloaded
experts (those sparse materialization never replicates) are spread first, layer by layer, to the
least-loaded node and device, so that no node becomes the sole ingress of many of them; the top-t
experts of each layer, which Alg. 1 will replicate anyway, fill the remaining slots.

Pseudo-code (Alg. 2, with this module's concrete choices in brackets)::

    1  J  ← top-t experts by load of every layer          [ties: lower expert id]
    2  J' ← E^g − J
    3  S_d ← |E^g| / |D| for every d                    [the first |E^g| mod |D| devices get one more]
    6  for layer l in layers by max load over J'_l, descending      [ties: lower layer id]
    9      for e in J'_l by load, descending                        [ties: lower expert id]
    10         n ← least-loaded node with free slots, ties by fewer free slots [then lower node id]
    11         d ← least-loaded device of n with S_d > 0, ties by fewer free slots [then lower id]
    12-13      P_l ← P_l ∪ {(e, d)}; S_d ← S_d − 1
    16 place J into the remaining slots                 [layer by layer, each expert of J by load
                                                         descending onto the least-loaded device of that
                                                         layer with a free slot, ties as in l.11]

"Load" of a node or device is the load of the layer being placed (each layer runs on its own).

Legend: L layers, E experts per layer, D devices, N nodes.
"""

from __future__ import annotations

import heapq

import logging

import numpy as np

from themis_compile.planner.materialize import check_count
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["heterogeneous_sharding", "homogeneous_sharding", "slots_per_device"]


def slots_per_device(total_experts: int, num_devices: int) -> np.ndarray:
    """[D] int64: Alg. 2 l.3, equal slots; the first ``total % D`` devices get one more."""
    base, extra = divmod(int(total_experts), int(num_devices))
    slots_D = np.full(num_devices, base, dtype=np.int64)
    slots_D[:extra] += 1
    return slots_D


def homogeneous_sharding(num_layers: int, num_experts: int, num_devices: int) -> list[Placement]:
    """Even (EP) sharding of every layer: experts owned contiguously by ranks (the initial sharding)."""
    check_count("num_layers", num_layers)
    return [Placement.contiguous(num_experts, num_devices)] * int(num_layers)


def heterogeneous_sharding(load_LE: np.ndarray, overlap_degree: int, topology: Topology) -> list[Placement]:
    """Alg. 2: one shard placement per MoE layer from the loads of all layers.

    Args:
        load_LE: [L, E] (predicted) tokens per expert of every layer, >= 0.
        overlap_degree: t >= 0; the top-t experts of each layer form J (placed last).
        topology: the cluster (D devices in N nodes).

    Returns:
        L shard placements; every device owns the same number of experts over all layers, up to one.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    if load_LE.ndim != 2:
        raise ValueError(f"load_LE must have shape [L, E], got {load_LE.shape}")
    if not np.isfinite(load_LE).all():
        raise ValueError("load_LE contains NaN or infinite entries")
    if (load_LE < 0).any():
        raise ValueError("load_LE contains negative entries")
    L, E = load_LE.shape
    t = min(check_count("overlap_degree", overlap_degree), E)
    D, N = topology.num_devices, topology.num_nodes
    node_of = topology.node_ids.tolist()
    devices_of = [list(topology.devices_of_node(n)) for n in range(N)]

    # l.1-2: J = top-t per layer, J' = the rest; both in load-descending order (ties: lower id).
    order_LE = np.argsort(-load_LE, axis=1, kind="stable")
    top_LJ, rest_LJ = order_LE[:, :t], order_LE[:, t:]
    # l.3: equal slots per device.
    slots = slots_per_device(L * E, D).tolist()
    node_slots = [sum(slots[d] for d in devices_of[n]) for n in range(N)]
    owners_LE = np.full((L, E), -1, dtype=np.int64)
    loads = load_LE.tolist()

    # l.6-7: layers by the max load of their J' experts, descending (ties: lower layer id).
    max_rest_L = load_LE[np.arange(L)[:, None], rest_LJ].max(axis=1) if rest_LJ.size else np.zeros(L)
    layer_order = np.argsort(-max_rest_L, kind="stable").tolist()
    # The minima of l.10, l.11 and l.16 are over (load, slots left, id) keys among the nodes / devices
    # with slots left; only the chosen node's and device's keys change, so each is a heap (popped,
    # updated, pushed back while it has slots): the same picks as scanning every candidate, in
    # O(log N + log D) per expert instead of O(N + D / N).
    dev_load_LD = [[0.0] * D for _ in range(L)]
    for l in layer_order:
        dev_load = dev_load_LD[l]
        node_heap = [(0.0, node_slots[k], k) for k in range(N) if node_slots[k] > 0]
        dev_heaps = [[(0.0, slots[x], x) for x in devices_of[k] if slots[x] > 0] for k in range(N)]
        for heap in [node_heap, *dev_heaps]:
            heapq.heapify(heap)
        for e in rest_LJ[l].tolist():                                               # l.9
            node_load_n, _, n = heapq.heappop(node_heap)                             # l.10
            _, _, d = heapq.heappop(dev_heaps[n])                                    # l.11
            owners_LE[l, e] = d                                                      # l.12
            slots[d] -= 1                                                            # l.13
            node_slots[n] -= 1
            dev_load[d] += loads[l][e]
            if slots[d] > 0:
                heapq.heappush(dev_heaps[n], (dev_load[d], slots[d], d))
            if node_slots[n] > 0:
                heapq.heappush(node_heap, (node_load_n + loads[l][e], node_slots[n], n))

    # l.16: fill the remaining slots with J, layer by layer.
    for l in range(L):
        dev_load = dev_load_LD[l]
        heap = [(dev_load[x], slots[x], x) for x in range(D) if slots[x] > 0]
        heapq.heapify(heap)
        for e in top_LJ[l].tolist():
            _, _, d = heapq.heappop(heap)
            owners_LE[l, e] = d
            slots[d] -= 1
            dev_load[d] += loads[l][e]
            if slots[d] > 0:
                heapq.heappush(heap, (dev_load[d], slots[d], d))

    return [Placement.from_owners(owners_LE[l], D) for l in range(L)]
