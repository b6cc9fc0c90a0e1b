"""The Themis planner (§3.1, §4.2-4.4): placements, the paper's three algorithms, load prediction and
the baseline policies. Pure Python/numpy, deterministic, shared by the runtime and the simulator.

* `Topology`, `Placement` — the cluster and the E × D chunk matrix (§3.1).
* `sparse_materialization` (Alg. 1) and `calibrate` (§4.2) — the ephemeral placement P' ⊇ P.
* `heterogeneous_sharding` (Alg. 2, §4.3) — shard placements of all MoE layers.
* `topology_aware_dispatch` (Alg. 3, §4.4) — the integer token plan R[e, d, d2].
* `LoadPredictor` — sliding-window load prediction (w = 5).
* `PlanCost`, `device_compute_load`, `straggler_time` — the small cost interface; `planner.cost` also holds
  the one SpAG/SpRS time (`sparse_transfer_time`) and all-to-all time (`all_to_all_time`) formulas.
* `Policy` and its implementations — Themis and the baselines of §5.1.
"""

from __future__ import annotations

from themis_compile.planner.baselines import (
    BYTE_CATEGORIES,
    POLICY_NAMES,
    EPLBPolicy,
    EPPolicy,
    FasterMoEPolicy,
    FlexMoEPolicy,
    Policy,
    PolicyStep,
    SmartMoEPolicy,
    ThemisPolicy,
    UniformPolicy,
    make_policy,
)
from themis_compile.planner.cost import PlanCost, device_compute_load, fluid_device_load, replicas_pay, straggler_time
from themis_compile.planner.dispatch import (
    dispatch_device_load,
    dispatch_rows,
    even_dispatch,
    own_row_entries,
    topology_aware_dispatch,
)
from themis_compile.planner.materialize import calibrate, materialize_pairs, sparse_materialization
from themis_compile.planner.placement import Placement
from themis_compile.planner.predictor import LoadPredictor
from themis_compile.planner.sharding import heterogeneous_sharding, homogeneous_sharding, slots_per_device
from themis_compile.planner.topology import Topology

__all__ = [
    "BYTE_CATEGORIES", "POLICY_NAMES", "EPLBPolicy", "EPPolicy", "FasterMoEPolicy", "FlexMoEPolicy",
    "LoadPredictor", "PlanCost", "Placement", "Policy", "PolicyStep", "SmartMoEPolicy", "ThemisPolicy",
    "Topology", "UniformPolicy", "calibrate", "device_compute_load", "dispatch_device_load", "dispatch_rows", "even_dispatch", "fluid_device_load",
    "heterogeneous_sharding", "homogeneous_sharding", "make_policy", "materialize_pairs", "own_row_entries",
    "replicas_pay", "slots_per_device",
    "sparse_materialization", "straggler_time", "topology_aware_dispatch",
]
