"""Cluster topology: nodes of devices, with intra- and inter-node link bandwidths (§3.3, §4.2).

Every planner algorithm that is topology-aware (Alg. 1 l.10, Alg. 2 l.10-11, Alg. 3 l.7-12) needs
only two facts about the cluster: which node each device sits on, and how fast the links are. A
`Topology` carries exactly those, is immutable and hashable, and is cheap to build on every rank.

Legend: D devices (ranks), N nodes.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # networkx is imported lazily: only the inspection view needs it.
    import networkx

logger = logging.getLogger(__name__)

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Devices grouped into nodes; devices are numbered node by node (rank order, as torchrun does).

    Attributes:
        devices_per_node: number of devices on each node, possibly uneven, e.g. ``(4, 4)`` or ``(3, 2)``.
            Device ids run ``0 .. D-1``; node 0 holds the first ``devices_per_node[0]`` of them, and so on.
        intra_node_bw: bytes/s of one device's link inside its node (NVLink-class).
        inter_node_bw: bytes/s, each way, of one node's network into or out of the node (NIC-class; its
            devices share it): the planner's transfer and all-to-all times charge a node's ingress and
            egress against it, as the simulator's cluster specs and the emulated nodes state it.
    """

    devices_per_node: tuple[int, ...]
    intra_node_bw: float = 5e9
    inter_node_bw: float = 1e9

    def __post_init__(self) -> None:
        dpn = tuple(self.devices_per_node)
        if not dpn:
            raise ValueError("Topology needs at least one node")
        for n, count in enumerate(dpn):
            if isinstance(count, bool) or int(count) != count or count < 1:
                raise ValueError(f"Topology node {n} has {count!r} devices; every node needs an integer >= 1")
        if not (self.intra_node_bw > 0 and np.isfinite(self.intra_node_bw)):
            raise ValueError(f"Topology.intra_node_bw must be a positive finite number, got {self.intra_node_bw}")
        if not (self.inter_node_bw > 0 and np.isfinite(self.inter_node_bw)):
            raise ValueError(f"Topology.inter_node_bw must be a positive finite number, got {self.inter_node_bw}")
        # Normalize to a tuple of Python ints so equal topologies hash equal.
        object.__setattr__(self, "devices_per_node", tuple(int(c) for c in dpn))
        object.__setattr__(self, "intra_node_bw", float(self.intra_node_bw))
        object.__setattr__(self, "inter_node_bw", float(self.inter_node_bw))

    # ----------------------------------------------------------------------------------- constructors
    @classmethod
    def uniform(cls, num_nodes: int, devices_per_node: int, **bw: float) -> Topology:
        """``num_nodes`` nodes with ``devices_per_node`` devices each."""
        if num_nodes < 1 or devices_per_node < 1:
            raise ValueError(f"Topology.uniform needs num_nodes >= 1 and devices_per_node >= 1, "
                             f"got {num_nodes} and {devices_per_node}")
        return cls((int(devices_per_node),) * int(num_nodes), **bw)

    @classmethod
    def single_node(cls, num_devices: int, **bw: float) -> Topology:
        """All ``num_devices`` devices on one node (every link is intra-node)."""
        return cls.uniform(1, num_devices, **bw)

    @classmethod
    def from_env(cls, world_size: int, devices_per_node: int | None = None, **bw: float) -> Topology:
        """The topology of a torchrun job of ``world_size`` ranks.

        ``devices_per_node`` defaults to ``LOCAL_WORLD_SIZE`` when torchrun set it, else to the whole world
        (one node). A last node with fewer devices is allowed when ``world_size`` is not a multiple.
        """
        if world_size < 1:
            raise ValueError(f"Topology.from_env needs world_size >= 1, got {world_size}")
        if devices_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is not None:
                try:
                    devices_per_node = int(env)
                except ValueError as exc:
                    raise ValueError(f"LOCAL_WORLD_SIZE={env!r} is not an integer") from exc
            else:
                devices_per_node = world_size
        if devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
        devices_per_node = min(int(devices_per_node), int(world_size))
        full, rest = divmod(int(world_size), devices_per_node)
        counts = (devices_per_node,) * full + ((rest,) if rest else ())
        return cls(counts, **bw)

    # ----------------------------------------------------------------------------------- queries
    @functools.cached_property
    def num_devices(self) -> int:
        return sum(self.devices_per_node)

    @functools.cached_property
    def num_nodes(self) -> int:
        return len(self.devices_per_node)

    @functools.cached_property
    def devices_per_node_f(self) -> np.ndarray:
        """[N] float64: devices on every node, as the planner's load model uses them (read-only)."""
        k_N = np.asarray(self.devices_per_node, dtype=np.float64)
        k_N.setflags(write=False)
        return k_N

    @functools.cached_property
    def is_uniform(self) -> bool:
        """True when every node has the same number of devices."""
        return len(set(self.devices_per_node)) == 1

    @functools.cached_property
    def node_ids(self) -> np.ndarray:
        """[D] int64: the node of every device (read-only)."""
        ids_D = np.repeat(np.arange(self.num_nodes, dtype=np.int64), self.devices_per_node)
        ids_D.setflags(write=False)
        return ids_D

    @functools.cached_property
    def node_offsets(self) -> np.ndarray:
        """[N+1] int64: devices of node n are ``node_offsets[n] .. node_offsets[n+1]-1`` (read-only)."""
        offsets = np.zeros(self.num_nodes + 1, dtype=np.int64)
        np.cumsum(self.devices_per_node, out=offsets[1:])
        offsets.setflags(write=False)
        return offsets

    @functools.cached_property
    def local_ranks(self) -> np.ndarray:
        """[D] int64: the position of every device inside its node, ``d - node_offsets[node_of(d)]``
        (read-only)."""
        ranks_D = np.arange(self.num_devices, dtype=np.int64) - self.node_offsets[self.node_ids]
        ranks_D.setflags(write=False)
        return ranks_D

    @functools.cached_property
    def single_holder_levels(self) -> np.ndarray:
        """[N, D] int64: ``local_ranks[d] + (node_of(d) == n)``, the l.10 spreading level of device d's
        rank inside its node when an expert's only holder sits on node n (read-only)."""
        levels_ND = self.local_ranks + (np.arange(self.num_nodes)[:, None] == self.node_ids)
        levels_ND.setflags(write=False)
        return levels_ND

    @functools.cached_property
    def same_node(self) -> np.ndarray:
        """[D, D] bool: ``same_node[d, d2]`` is True when d and d2 share a node (read-only)."""
        ids_D = self.node_ids
        same_DD = ids_D[:, None] == ids_D[None, :]
        same_DD.setflags(write=False)
        return same_DD

    @functools.cached_property
    def core_layout(self) -> bytes:
        """The topology as the compiled planner core reads it: int64
        ``[N, D, uniform, devices_per_node (N), node_offsets (N+1), node_ids (D)]``."""
        header = np.array([self.num_nodes, self.num_devices, int(self.is_uniform)], dtype=np.int64)
        return np.concatenate([header, np.asarray(self.devices_per_node, dtype=np.int64), self.node_offsets,
                               self.node_ids]).astype(np.int64).tobytes()

    def node_of(self, d: int) -> int:
        """The node of device ``d``."""
        if not 0 <= d < self.num_devices:
            raise ValueError(f"device {d} is out of range for a topology of {self.num_devices} devices")
        return int(self.node_ids[d])

    def devices_of_node(self, n: int) -> tuple[int, ...]:
        """The device ids of node ``n``, ascending."""
        if not 0 <= n < self.num_nodes:
            raise ValueError(f"node {n} is out of range for a topology of {self.num_nodes} nodes")
        return tuple(range(int(self.node_offsets[n]), int(self.node_offsets[n + 1])))

    def validate(self, num_devices: int) -> None:
        """Raise ValueError unless this topology has exactly ``num_devices`` devices."""
        if int(num_devices) != self.num_devices:
            raise ValueError(f"topology {self.devices_per_node} has {self.num_devices} devices "
                             f"but the placement/world has {num_devices}")

    def to_networkx(self) -> "networkx.Graph":
        """A complete graph over devices for inspection: node attribute ``node`` (the node id); edge
        attributes ``bandwidth`` (bytes/s) and ``kind`` (``"intra"`` or ``"inter"``)."""
        import networkx as nx

        graph = nx.Graph(devices_per_node=self.devices_per_node)
        for d in range(self.num_devices):
            graph.add_node(d, node=int(self.node_ids[d]))
        for d in range(self.num_devices):
            for d2 in range(d + 1, self.num_devices):
                intra = bool(self.same_node[d, d2])
                graph.add_edge(d, d2, bandwidth=self.intra_node_bw if intra else self.inter_node_bw,
                               kind="intra" if intra else "inter")
        return graph

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        return {"devices_per_node": list(self.devices_per_node), "num_devices": self.num_devices,
                "num_nodes": self.num_nodes, "intra_node_bw": self.intra_node_bw,
                "inter_node_bw": self.inter_node_bw}
