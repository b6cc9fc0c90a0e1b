"""The Themis planner (§3.1, §4.2-4.4): placements, the paper's three algorithms, load prediction and
the baseline policies. Pure Python/numpy, deterministic, shared by the runtime and the simulator."""

from __future__ import annotations

from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

__all__ = ["Placement", "Topology"]
