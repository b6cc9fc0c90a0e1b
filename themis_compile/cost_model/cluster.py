"""Cluster descriptions for the simulator: the paper's Cluster A and B (§5.1) and custom clusters.

Bandwidths are one-direction figures in bytes/s:

* ``intra_node_bw`` — one device's NVSwitch link. The paper quotes bidirectional totals (600 GB/s for
  A100, 900 GB/s for H200), so one direction is half of that.
* ``inter_node_bw`` — one node's network interfaces together (the paper quotes 400 Gbps for A and
  3200 Gbps for B per node). Per-node ingress is what binds sparse collectives (§4.2) and the token
  all-to-all across nodes.

``comm_efficiency`` scales both link figures to what collectives achieve, and ``compute_efficiency``
scales the device's dense bf16 peak to what model FLOPs achieve; both are stated, configurable
assumptions of the simulator.

Custom clusters come from a TOML or JSON file with the field names of `Cluster` (all but ``name`` may
be omitted and default to Cluster A's values)::

    name = "my-cluster"
    devices_per_node = 8
    intra_node_bw = 300e9
    inter_node_bw = 50e9
    peak_flops = 312e12
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Cluster", "CLUSTERS", "get_cluster", "load_cluster"]


@dataclass(frozen=True)
class Cluster:
    """One homogeneous GPU cluster.

    Attributes:
        name: a label.
        gpu: the device model (informational).
        devices_per_node: GPUs per node.
        num_nodes: nodes (the paper's default is 4).
        intra_node_bw: bytes/s, one direction, of one device's intra-node link.
        inter_node_bw: bytes/s, one direction, of one node's inter-node network.
        peak_flops: dense bf16 FLOP/s of one device.
        hbm_bw: bytes/s of device memory (the optimizer step is memory-bound).
        memory_bytes: device memory.
        compute_efficiency: achieved fraction of ``peak_flops``.
        comm_efficiency: achieved fraction of the link bandwidths.
        collective_latency_s: fixed start-up latency charged per all-to-all.
    """

    name: str
    gpu: str = "A100-80G"
    devices_per_node: int = 8
    num_nodes: int = 4
    intra_node_bw: float = 300e9
    inter_node_bw: float = 50e9
    peak_flops: float = 312e12
    hbm_bw: float = 2.0e12
    memory_bytes: float = 80e9
    compute_efficiency: float = 0.5
    comm_efficiency: float = 0.8
    collective_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("intra_node_bw", "inter_node_bw", "peak_flops", "hbm_bw", "memory_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"Cluster.{name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("compute_efficiency", "comm_efficiency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"Cluster.{name} must be in (0, 1], got {value!r}")
        if not (self.collective_latency_s >= 0 and math.isfinite(self.collective_latency_s)):
            raise ValueError(f"Cluster.collective_latency_s must be >= 0, got {self.collective_latency_s!r}")

    # ----------------------------------------------------------------------------------- derived
    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def effective_flops(self) -> float:
        """FLOP/s the compute model charges: peak · compute_efficiency."""
        return self.peak_flops * self.compute_efficiency

    @property
    def effective_intra_bw(self) -> float:
        return self.intra_node_bw * self.comm_efficiency

    @property
    def effective_inter_bw(self) -> float:
        return self.inter_node_bw * self.comm_efficiency

    @property
    def window_bw(self) -> float:
        """The bw of t = ⌊T_attn·bw/Ψ⌋ (§4.2): per-node ingress on several nodes, else the device link."""
        return self.effective_inter_bw if self.num_nodes > 1 else self.effective_intra_bw

    def with_nodes(self, num_nodes: int) -> Cluster:
        """The same cluster with ``num_nodes`` nodes."""
        return dataclasses.replace(self, num_nodes=int(num_nodes))

    def replace(self, **changes: Any) -> Cluster:
        return dataclasses.replace(self, **changes)

    def scaled_bandwidth(self, factor: float) -> Cluster:
        """Both link bandwidths multiplied by ``factor``."""
        return dataclasses.replace(self, intra_node_bw=self.intra_node_bw * factor,
                                   inter_node_bw=self.inter_node_bw * factor)

    def topology(self) -> Topology:
        """The planner's `Topology` with the effective bandwidths (inter-node: per node)."""
        return Topology.uniform(self.num_nodes, self.devices_per_node, intra_node_bw=self.effective_intra_bw,
                                inter_node_bw=self.effective_inter_bw)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        return {**dataclasses.asdict(self), "num_devices": self.num_devices}


CLUSTERS: dict[str, Cluster] = {
    # AWS p4de.24xlarge: 8 x A100-80G, 600 GB/s NVSwitch (bidirectional), 400 Gbps network per node.
    "A": Cluster("A", gpu="A100-80G", intra_node_bw=600e9 / 2, inter_node_bw=400e9 / 8, peak_flops=312e12,
                 hbm_bw=2.0e12, memory_bytes=80e9),
    # AWS p5en.48xlarge: 8 x H200-141G, 900 GB/s NVSwitch (bidirectional), 3200 Gbps network per node.
    "B": Cluster("B", gpu="H200-141G", intra_node_bw=900e9 / 2, inter_node_bw=3200e9 / 8, peak_flops=989e12,
                 hbm_bw=4.8e12, memory_bytes=141e9),
}


def load_cluster(path: str | Path) -> Cluster:
    """A custom cluster from a TOML (``.toml``) or JSON file with `Cluster`'s field names."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cluster file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"cluster file {str(path)!r} is not valid TOML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cluster file {str(path)!r} is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and "cluster" in data and isinstance(data["cluster"], dict):
        data = data["cluster"]
    if not isinstance(data, dict):
        raise ValueError(f"cluster file {str(path)!r} must hold a table/object of Cluster fields")
    fields = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"cluster file {str(path)!r} has unknown field(s) {unknown}; known: {sorted(fields)}")
    data.setdefault("name", path.stem)
    return Cluster(**data)


def get_cluster(name_or_path: str, num_nodes: int | None = None) -> Cluster:
    """Cluster ``"A"`` or ``"B"``, or a custom one from a TOML/JSON file; ``num_nodes`` overrides nodes."""
    if name_or_path in CLUSTERS:
        cluster = CLUSTERS[name_or_path]
    elif name_or_path.upper() in CLUSTERS and len(name_or_path) == 1:
        cluster = CLUSTERS[name_or_path.upper()]
    elif Path(name_or_path).suffix.lower() in (".toml", ".json"):
        cluster = load_cluster(name_or_path)
    else:
        raise ValueError(f"unknown cluster {name_or_path!r}; use 'A', 'B' or a .toml/.json file")
    if num_nodes is not None:
        if num_nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {num_nodes}")
        cluster = cluster.with_nodes(num_nodes)
    return cluster
