"""What each policy costs beyond the common all-to-all and compute: every policy charges its own.

A `PolicyCharges` wraps one planner policy (`themis_compile.planner.make_policy`; every placement
decision is the planner's own code) and answers what the engine asks of it, so the engine never looks
at a policy's name:

* `PolicyCharges.policy_kwargs` — the constructor arguments the setup gives the planner policy;
* `PolicyCharges.charge` — the policy's own collectives of one layer (Themis's SpAG / calibration /
  SpRS / re-materialization, FasterMoE's shadow broadcast and reduce, persistent replicas' AllReduce);
* `PolicyCharges.persistent_state` — the placement whose changes between iterations move persistent
  state (migration, re-sharding);
* `PolicyCharges.held_replicas` — the replica parameters, gradients and optimizer states the peak
  device holds at once (Fig. 12);
* `PolicyCharges.rearrangement_s` — what an iteration pays for the migration of persistent state (in
  full when it happens; Themis's re-sharding amortized over its interval, §5.3);
* `PolicyCharges.begin` / `PolicyCharges.end_iteration` — steady-state set-up (Themis re-shards once
  inside the warm-up);
* `PolicyCharges.take_plan_times` — wall times of the materialization plans (Alg. 1) it computed.

`charges_for(name, setup)` builds the right one from the registry `CHARGES` (policy name to class).

Legend: E experts, D devices, N nodes, L MoE layers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from themis_compile.planner import Placement, Policy, PolicyStep, Topology, make_policy, sparse_materialization
from themis_compile.planner.cost import sparse_transfer_time

from themis_compile.sim.costs import Coster, LayerCost
from themis_compile.sim.setup import SimSetup

__all__ = ["PolicyCharges", "ThemisCharges", "FasterMoECharges", "PersistentReplicaCharges",
           "FlexMoECharges", "CHARGES", "DEFAULT_POLICIES", "REFERENCE", "charges_for"]


def _as_pairs(placement: Placement) -> Placement:
    """The same placement held as its pairs (no [E, D] matrix)."""
    if placement.is_sparse:
        return placement
    return Placement.from_pairs(placement.flat_ids(), *placement.shape, placement.copy_counts())


class PolicyCharges:
    """A planner policy and what it costs beyond tokens: nothing, for EP, Uniform and SmartMoE (whose
    migrations the engine charges from `persistent_state`)."""

    def __init__(self, name: str, setup: SimSetup) -> None:
        self.name = name
        self.setup = setup
        self.policy: Policy = make_policy(name, setup.num_layers, setup.num_experts, setup.topology(), setup.psi,
                                          **self.policy_kwargs(setup, name))
        self._shard_pairs: dict[int, tuple[Placement, Placement]] = {}

    def transfer_time(self, base: Placement, target: Placement, psi: float, topology: Topology) -> float:
        """`sparse_transfer_time` (SpAG(base, target)), with ``base`` given to it as pairs: it then counts
        the transfer from the pairs, O(|P|), instead of passes over the [E, D] masks and node masks of
        placements that are new every layer step (the same counts). The pairs of the current shards (one
        per layer at most) are kept; a re-sharding drops the old ones."""
        if not base.is_sparse:
            held = self._shard_pairs.get(id(base))
            if held is None or held[0] is not base:
                if len(self._shard_pairs) >= self.setup.num_layers:
                    self._shard_pairs.clear()
                held = self._shard_pairs[id(base)] = (base, _as_pairs(base))
            base = held[1]
        return sparse_transfer_time(base, target, psi, topology)

    @classmethod
    def policy_kwargs(cls, setup: SimSetup, name: str) -> dict[str, Any]:
        return dict(optimizer_state_bytes=setup.expert_params * setup.precision.optimizer_bytes,
                    token_bytes=setup.token_bytes, time_per_token_s=setup.time_per_token_s)

    def plan(self, layer: int, predicted_E: np.ndarray, tokens_ED: np.ndarray) -> PolicyStep:
        return self.policy.plan(layer, predicted_E, tokens_ED)

    def charge(self, coster: Coster, layer: int, step: PolicyStep, predicted_E: np.ndarray, lc: LayerCost) -> None:
        """Add the policy's own collectives of ``layer`` to ``lc`` (nothing here)."""

    def persistent_state(self, step: PolicyStep) -> np.ndarray:
        """[E, D] bool: the state that persists between iterations (the owners)."""
        return step.shard.mask

    def bytes_moved(self, layer: int, step: PolicyStep) -> dict[str, int]:
        """The bytes ``step`` moves per category (``planner.BYTE_CATEGORIES``), as charged."""
        return step.bytes_moved

    def held_replicas(self, sum_max: int, layer_max: int) -> tuple[int, int, int]:
        """(replica params, replica grads, replica optimizer states) in experts, on the peak device, from
        the most replicas a device added over all layers (``sum_max``) and in one layer (``layer_max``)."""
        return 0, 0, 0

    def rearrangement_s(self, migrate_s: float) -> float:
        """The migration time an iteration is charged, given what its persistent-state changes cost
        (``migrate_s``, `Coster.migration_time`): all of it, in the iteration that makes them."""
        return migrate_s

    def begin(self, warmup: int, early_reshard: bool) -> None:
        """Called once before the first iteration."""

    def take_plan_times(self) -> list[float]:
        """Wall times (s) of the materialization plans computed since the last call (Themis only)."""
        return []

    def end_iteration(self, iteration: int) -> None:
        """Called after every iteration."""


class ThemisCharges(PolicyCharges):
    """Themis and Themis-RM: the predicted SpAG before each layer overlaps its attention forward (§4.2),
    calibration's extra SpAG is on the critical path, SpRS overlaps the attention backward, and Themis-RM
    gathers released replicas again before backward. The runtime keeps the last layer's replicas (its
    backward follows at once), so the last layer is never re-materialized."""

    @classmethod
    def policy_kwargs(cls, setup: SimSetup, name: str) -> dict[str, Any]:
        rm = name == "themis-rm"
        return dict(super().policy_kwargs(setup, name), overlap_degree=setup.overlap_degree,
                    reshard_interval=setup.reshard_interval,
                    materialization_budget=setup.materialization_budget_rm if rm else setup.materialization_budget)

    def charge(self, coster: Coster, layer: int, step: PolicyStep, predicted_E: np.ndarray, lc: LayerCost) -> None:
        policy, topo, psi = self.policy, coster.topo, self.setup.psi
        # The same pure Alg. 1 call the policy made before calibration (deterministic), timed: the
        # paper's "time to compute the materialization plan" (§5.3).
        started = time.perf_counter()
        materialized = sparse_materialization(step.shard, predicted_E, policy.overlap_degree,
                                              policy.materialization_budget, topo)
        self._plan_s.append(time.perf_counter() - started)
        if step.info.get("calibrated"):
            lc.calib_s = sparse_transfer_time(_as_pairs(materialized), step.placement, psi, topo)
        if materialized != step.shard:
            lc.spag_s = self.transfer_time(step.shard, materialized, psi, topo)
        if step.placement != step.shard:
            lc.sprs_s = self.transfer_time(step.shard, step.placement, coster.grad_psi, topo)
            if self.releases(layer) and step.bytes_moved["spag_remat"]:
                lc.remat_s = self.transfer_time(step.shard, step.placement, psi, topo)

    def bytes_moved(self, layer: int, step: PolicyStep) -> dict[str, int]:
        if self.releases(layer) or not step.bytes_moved["spag_remat"]:
            return step.bytes_moved
        return {**step.bytes_moved, "spag_remat": 0}

    def take_plan_times(self) -> list[float]:
        out, self._plan_s = self._plan_s, []
        return out

    def releases(self, layer: int) -> bool:
        """Whether ``layer``'s replicas are freed after forward and gathered again for backward."""
        return bool(self.policy.rematerialize) and layer < self.setup.num_layers - 1

    def held_replicas(self, sum_max: int, layer_max: int) -> tuple[int, int, int]:
        if not self.policy.rematerialize:
            return sum_max, layer_max, 0     # held forward -> backward; gradients one layer at a time (SpRS)
        # Re-materialized: the layer in use and the next one gathered ahead (the last layer's replicas
        # are kept, and the one before it is gathered while the last runs backward).
        held = min(2, self.setup.num_layers) * layer_max
        return min(held, sum_max), layer_max, 0

    def __init__(self, name: str, setup: SimSetup) -> None:
        super().__init__(name, setup)
        self._plan_s: list[float] = []
        self._reshard_s = 0.0

    def rearrangement_s(self, migrate_s: float) -> float:
        """§5.3 counts Themis's "re-sharding latency amortized over its interval": every iteration pays the
        last Alg. 2 re-sharding's migration time over ``reshard_interval`` (a run shorter than the interval
        would otherwise never see one, or see one in full)."""
        if migrate_s > 0:
            self._reshard_s = migrate_s
        interval = self.setup.reshard_interval
        return self._reshard_s / interval if interval else migrate_s

    def begin(self, warmup: int, early_reshard: bool) -> None:
        # Measure the steady state: the first Alg. 2 re-sharding runs in the last warm-up iteration.
        self._early = early_reshard and warmup >= 2 and bool(self.setup.reshard_interval)
        self._warmup = warmup
        if self._early:
            self.policy.reshard_interval = warmup - 1

    def end_iteration(self, iteration: int) -> None:
        if self._early and iteration == self._warmup - 1:
            self.policy.reshard_interval = self.setup.reshard_interval


class FasterMoECharges(PolicyCharges):
    """FasterMoE: the shadow broadcast after gating and the shadows' gradient reduce, both on the critical
    path, at the §3.3 lower bound of the same transfer."""

    def charge(self, coster: Coster, layer: int, step: PolicyStep, predicted_E: np.ndarray, lc: LayerCost) -> None:
        if step.bytes_moved["broadcast"]:
            p = self.setup.precision
            lc.bcast_s = self.transfer_time(step.shard, step.placement, self.setup.psi, coster.topo)
            lc.reduce_s = lc.bcast_s * p.grad_bytes / max(p.param_bytes, 1)

    def held_replicas(self, sum_max: int, layer_max: int) -> tuple[int, int, int]:
        return sum_max, layer_max, 0


class PersistentReplicaCharges(PolicyCharges):
    """Persistent replicas (EPLB): their placement is the persistent state (new copies migrate) and their
    gradients are all-reduced every iteration (Eq. 5)."""

    def charge(self, coster: Coster, layer: int, step: PolicyStep, predicted_E: np.ndarray, lc: LayerCost) -> None:
        lc.replica_ar_s = coster.replica_allreduce_time(step.placement.mask)

    def persistent_state(self, step: PolicyStep) -> np.ndarray:
        return step.placement.mask

    def held_replicas(self, sum_max: int, layer_max: int) -> tuple[int, int, int]:
        return sum_max, sum_max, 0


class FlexMoECharges(PersistentReplicaCharges):
    """FlexMoE: persistent replicas in pre-allocated per-layer reserves that carry optimizer state."""

    @classmethod
    def policy_kwargs(cls, setup: SimSetup, name: str) -> dict[str, Any]:
        return dict(super().policy_kwargs(setup, name), replica_slots=setup.replica_slots)

    def held_replicas(self, sum_max: int, layer_max: int) -> tuple[int, int, int]:
        reserve = self.setup.replica_slots * self.setup.num_layers
        return reserve, reserve, reserve


# The reference of every relative figure (throughput and memory "vs EP").
REFERENCE = "ep"
# The policies `simulate` runs when none are named (§5.1's systems, Uniform and Themis-RM).
DEFAULT_POLICIES = ("ep", "uniform", "fastermoe", "smartmoe", "flexmoe", "themis", "themis-rm")

CHARGES: dict[str, type[PolicyCharges]] = {
    "ep": PolicyCharges, "uniform": PolicyCharges, "smartmoe": PolicyCharges, "fastermoe": FasterMoECharges,
    "flexmoe": FlexMoECharges, "eplb": PersistentReplicaCharges, "themis": ThemisCharges,
    "themis-rm": ThemisCharges,
}


def charges_for(name: str, setup: SimSetup) -> PolicyCharges:
    """The policy ``name`` (``themis_compile.planner.POLICY_NAMES``) configured from ``setup``."""
    if name not in CHARGES:
        raise ValueError(f"unknown policy {name!r}; choose from {tuple(CHARGES)}")
    return CHARGES[name](name, setup)
