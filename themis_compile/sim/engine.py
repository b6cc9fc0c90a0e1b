"""The simulator's engine: replay a routing trace through each policy's planner and charge the cost model.

Every placement decision comes from the planner (`themis_compile.planner.make_policy`, wrapped by
`themis_compile.sim.policies`); this module charges time and memory for the plans the policies return,
read as their per-device totals (`PolicyStep.traffic`, O(E·D): the dense [E, D, D] plan R is never
built, which keeps 4,096 devices within a few GiB):

* expert compute from FLOPs at the cluster's stated efficiency, per device from the dispatch plan R
  (forward; backward costs twice the forward);
* token all-to-all from R (`planner.cost.all_to_all_time`): every device's intra-node ingress/egress
  over its NVSwitch link and every node's inter-node ingress/egress over the node's network, the slower
  of the two, plus a start-up latency; four per MoE layer (dispatch and combine, forward and backward);
* each policy's own collectives (`PolicyCharges.charge`): SparseAllGather / SparseReduceScatter at the
  §3.3 lower bound the planner weighs calibration with (`planner.cost.sparse_transfer_time`), issued on
  a communication stream and overlapped with the preceding attention window (§4.2), calibration on the
  critical path; FasterMoE's shadow broadcast and gradient reduce; the per-iteration AllReduce of
  persistent replicas (Eq. 5, overlapped with backward like data parallelism);
* migration of persistent state (SmartMoE swaps, FlexMoE and EPLB replicas, Themis's re-sharding) from
  the changes of `PolicyCharges.persistent_state`;
* data-parallel AllReduce of the dense (non-expert) gradients in per-layer buckets during backward;
* the optimizer step as memory traffic over HBM.

The critical path is accumulated on a representative device (the mean device for compute; waiting for
the straggler surfaces inside the all-to-all, as in the paper's Fig. 11) in six categories:
``A2A``, ``Rearr``, ``SpAG/SpRS`` (exposed only), ``AR`` (exposed only), ``Opt``, ``Comp``.

Legend: E experts, D devices, N nodes, L MoE layers.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from themis_compile.planner import LoadPredictor, Placement, PolicyStep
from themis_compile.planner.cost import all_to_all_time
from themis_compile.sim.costs import Coster, LayerCost
from themis_compile.sim.policies import DEFAULT_POLICIES, REFERENCE, PolicyCharges, charges_for
from themis_compile.sim.setup import SimSetup
from themis_compile.sim.traces import RoutingTrace, load_skew

logger = logging.getLogger(__name__)

__all__ = ["CATEGORIES", "DEFAULT_POLICIES", "PolicyResult", "SimResult", "simulate"]

CATEGORIES = ("A2A", "Rearr", "SpAG/SpRS", "AR", "Opt", "Comp")


# =========================================================================================== costs
def _layer_cost(coster: Coster, charges: PolicyCharges, layer: int, step: PolicyStep, predicted_E: np.ndarray
                ) -> LayerCost:
    """All-to-all and compute of ``step`` (common to every policy), plus the policy's own charges."""
    s = coster.setup
    lc = LayerCost()
    # The planner's all-to-all model; the bytes are the policy's own count of the same flows.
    lc.a2a_s = all_to_all_time(step.traffic, s.token_bytes, coster.topo) + s.cluster.collective_latency_s
    lc.a2a_bytes, lc.a2a_inter_bytes = step.bytes_moved["a2a"], step.bytes_moved["a2a_inter"]
    load_D = step.traffic.load_D
    lc.comp_mean_s = float(load_D.mean()) * s.time_per_token_s
    lc.comp_max_s = float(load_D.max()) * s.time_per_token_s
    charges.charge(coster, layer, step, predicted_E, lc)
    return lc


# =========================================================================================== timeline
class _Timeline:
    """The critical path of one device: a compute stream that advances, plus communication streams
    (FIFO) whose results the compute stream waits for."""

    def __init__(self, record: bool) -> None:
        self.t = 0.0
        self.cat: dict[str, float] = defaultdict(float)
        self.events: list[dict[str, Any]] | None = [] if record else None
        self.stream_t: dict[str, float] = defaultdict(float)

    def run(self, name: str, cat: str, dur: float) -> None:
        if dur <= 0:
            return
        if self.events is not None:
            self.events.append({"name": name, "cat": cat, "stream": "compute", "start": self.t, "dur": dur})
        self.cat[cat] += dur
        self.t += dur

    def issue(self, name: str, cat: str, dur: float, stream: str = "comm") -> float:
        """Start a collective on ``stream`` no earlier than now; returns its end time."""
        start = max(self.stream_t[stream], self.t)
        if dur <= 0:
            return start
        end = start + dur
        self.stream_t[stream] = end
        if self.events is not None:
            self.events.append({"name": name, "cat": cat, "stream": stream, "start": start, "dur": dur})
        return end

    def wait(self, end: float, name: str, cat: str) -> None:
        self.run(name, cat, end - self.t)


def _iteration(setup: SimSetup, coster: Coster, costs: list[LayerCost], migrate_s: float,
               replica_opt_params: int, owned_expert_params: int, record: bool) -> _Timeline:
    """One training iteration on the representative device (see the module docstring)."""
    s, tl = setup, _Timeline(record)
    L = len(costs)
    tl.run("migration / re-shard", "Rearr", migrate_s)
    # ------------------------------------------------------------------------- forward
    for l, c in enumerate(costs):
        spag_end = tl.issue(f"SpAG L{l}", "SpAG/SpRS", c.spag_s)                      # §4.2: before attention
        tl.run(f"attention fwd L{l}", "Comp", s.t_attn_s)
        tl.wait(spag_end, f"wait SpAG L{l}", "SpAG/SpRS")
        tl.wait(tl.issue(f"SpAG calibration L{l}", "SpAG/SpRS", c.calib_s), f"SpAG calibration L{l}", "SpAG/SpRS")
        tl.run(f"shadow broadcast L{l}", "Rearr", c.bcast_s)
        tl.run(f"A2A dispatch L{l}", "A2A", c.a2a_s)
        tl.run(f"experts fwd L{l}", "Comp", c.comp_mean_s)
        tl.run(f"straggler wait fwd L{l}", "A2A", c.comp_max_s - c.comp_mean_s)
        tl.run(f"A2A combine L{l}", "A2A", c.a2a_s)
        tl.run(f"shared expert fwd L{l}", "Comp", s.shared_s)
    # The last layer keeps its replicas (costs[-1].remat_s is 0): its backward follows the LM head at once.
    remat_end = tl.issue(f"SpAG remat L{L - 1}", "SpAG/SpRS", costs[-1].remat_s)
    tl.run("LM head fwd+bwd", "Comp", 3.0 * s.head_s)
    ar_bytes = s.precision.grad_bytes
    tl.issue("AllReduce LM head grads", "AR", coster.allreduce_time(s.head_params * ar_bytes), stream="dp")
    # ------------------------------------------------------------------------- backward
    for l in reversed(range(L)):
        c = costs[l]
        tl.wait(remat_end, f"wait SpAG remat L{l}", "SpAG/SpRS")
        tl.run(f"A2A combine bwd L{l}", "A2A", c.a2a_s)
        tl.run(f"experts bwd L{l}", "Comp", 2.0 * c.comp_mean_s)
        tl.run(f"straggler wait bwd L{l}", "A2A", 2.0 * (c.comp_max_s - c.comp_mean_s))
        tl.run(f"A2A dispatch bwd L{l}", "A2A", c.a2a_s)
        tl.run(f"shadow grad reduce L{l}", "Rearr", c.reduce_s)
        tl.issue(f"AllReduce replicas L{l}", "AR", c.replica_ar_s, stream="dp")
        tl.run(f"shared expert bwd L{l}", "Comp", 2.0 * s.shared_s)
        # Attention backward of layer l is the window of SpRS(l) and the re-materialization of l-1.
        sprs_end = tl.issue(f"SpRS L{l}", "SpAG/SpRS", c.sprs_s)
        remat_end = tl.issue(f"SpAG remat L{l - 1}", "SpAG/SpRS", costs[l - 1].remat_s) if l else tl.t
        tl.run(f"attention bwd L{l}", "Comp", 2.0 * s.t_attn_s)
        tl.wait(sprs_end, f"wait SpRS L{l}", "SpAG/SpRS")
        tl.issue(f"AllReduce dense L{l}", "AR", coster.allreduce_time(s.layer_dense_params * ar_bytes), stream="dp")
    tl.wait(tl.issue("AllReduce embeddings", "AR", coster.allreduce_time(s.embedding_params * ar_bytes),
                     stream="dp"), "wait AllReduce", "AR")
    # ------------------------------------------------------------------------- optimizer
    # Adam is memory-bound: read and write parameter, gradient and optimizer state of every owned param.
    owned = s.dense_params + owned_expert_params + replica_opt_params
    tl.run("optimizer step", "Opt", 2.0 * owned * s.precision.state_bytes / s.cluster.hbm_bw)
    return tl


# =========================================================================================== results
@dataclass
class PolicyResult:
    """What one policy cost, averaged over the measured iterations."""

    name: str
    iteration_s: list[float] = field(default_factory=list)
    breakdown_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: dict[str, float] = field(default_factory=dict)
    bytes_moved: dict[str, float] = field(default_factory=dict)
    a2a_inter_fraction: float = 0.0
    straggler_s: float = 0.0       # the part of A2A that is waiting for the slowest device's experts
    events: list[dict[str, Any]] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)     # wall times of measured materialization plans

    @property
    def plan_us_median(self) -> float:
        """Median wall time of Alg. 1 per MoE layer (µs) on this machine (NaN for policies without it)."""
        return float(np.median(self.plan_s)) * 1e6 if self.plan_s else math.nan

    @property
    def mean_iteration_s(self) -> float:
        return float(np.mean(self.iteration_s)) if self.iteration_s else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mean_iteration_s": self.mean_iteration_s,
                "breakdown_s": self.breakdown_s, "memory_bytes": self.memory_bytes,
                "bytes_moved_per_iteration": self.bytes_moved, "a2a_inter_fraction": self.a2a_inter_fraction,
                "straggler_s": self.straggler_s, "plan_us_median": self.plan_us_median}


@dataclass
class SimResult:
    """The outcome of `simulate`."""

    setup: SimSetup
    policies: dict[str, PolicyResult]
    iterations: int
    warmup: int
    trace_iteration: int
    wall_s: float = 0.0
    trace_skew: float = 0.0

    def speedup_over(self, reference: str = REFERENCE) -> dict[str, float]:
        """Throughput relative to ``reference`` (its mean iteration time over each policy's)."""
        ref = self.policies[reference].mean_iteration_s
        return {n: ref / r.mean_iteration_s for n, r in self.policies.items()}

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"setup": self.setup.describe(), "iterations": self.iterations,
                               "warmup": self.warmup, "trace_skew": self.trace_skew, "wall_s": self.wall_s,
                               "policies": {n: r.as_dict() for n, r in self.policies.items()}}
        if REFERENCE in self.policies:
            out["throughput_vs_ep"] = self.speedup_over(REFERENCE)
        return out


def simulate(setup: SimSetup, trace: RoutingTrace, policies: tuple[str, ...] | list[str] = DEFAULT_POLICIES, *,
             iterations: int | None = None, warmup: int | None = None, trace_iteration: int | None = None,
             early_reshard: bool = True, progress: bool = False, progress_label: str | None = None) -> SimResult:
    """Replay ``trace`` through each policy's planner and charge the cost model.

    Args:
        setup: from `build_setup`.
        trace: a routing trace with E = setup.num_experts and at least L layers.
        policies: policy names (``themis_compile.planner.POLICY_NAMES``).
        iterations: steps to simulate (default: all steps of the trace).
        warmup: leading iterations left out of the averages (default: the predictor window, 5, when
            more than 10 iterations run, else 0).
        trace_iteration: the iteration whose timeline is kept for the chrome trace (default: the last).
        early_reshard: measure Themis in its steady state: its first Alg. 2 re-sharding runs in the last
            warm-up iteration (with the predictor's loads), later ones every ``reshard_interval``.
        progress: a tqdm progress bar on stderr (``progress_label`` in front of it, default "simulating").
    """
    if trace.num_experts != setup.num_experts:
        raise ValueError(f"the trace has {trace.num_experts} experts but the model has {setup.num_experts}")
    if trace.num_layers < setup.num_layers:
        raise ValueError(f"the trace has {trace.num_layers} MoE layers but the model has {setup.num_layers}")
    if not policies:
        raise ValueError("no policy to simulate")
    steps = trace.steps
    n_it = len(steps) if iterations is None else int(iterations)
    if n_it < 1:
        raise ValueError(f"iterations must be >= 1, got {n_it}")
    if n_it > len(steps):
        raise ValueError(f"the trace has {len(steps)} steps, fewer than the {n_it} iterations asked for")
    warmup = (5 if n_it > 10 else 0) if warmup is None else int(warmup)
    if not 0 <= warmup < n_it:
        raise ValueError(f"warmup must be in [0, iterations={n_it}), got {warmup}")
    trace_iteration = n_it - 1 if trace_iteration is None else int(trace_iteration)
    L, D = setup.num_layers, setup.num_devices
    coster = Coster(setup)
    runs = [_PolicyRun(charges_for(name, setup), PolicyResult(name)) for name in dict.fromkeys(policies)]
    for run in runs:
        run.charges.begin(warmup, early_reshard)
    predictor = LoadPredictor(L, setup.num_experts, window=5)
    skews = []
    bar = _progress(n_it * len(runs), progress, progress_label or "simulating")
    started = time.perf_counter()
    tokens_ED = np.empty((setup.num_experts, D), dtype=np.int64)
    try:
        for it in range(n_it):
            predicted_LE = [predictor.predict(layer) for layer in range(L)]
            measured = it >= warmup
            for run in runs:
                run.begin_iteration(D)
            loads_LE = []
            # Layer-major: one layer's counts, as the int64 the planner reads, serve every policy (each
            # policy still plans its layers in order; the policies share no state).
            for layer in range(L):
                # One buffer for every layer: the planner keeps no reference to a layer's counts.
                layer_ED = trace.record(steps[it], layer).tokens_ED(D)
                if layer_ED.dtype.kind in "iu" and layer_ED.shape == tokens_ED.shape:
                    tokens_ED.setflags(write=True)
                    np.copyto(tokens_ED, layer_ED)
                    tokens_ED.setflags(write=False)
                    layer_ED = tokens_ED
                for run in runs:
                    run.layer(coster, layer, layer_ED, predicted_LE[layer], measured)
                loads_LE.append(layer_ED.sum(axis=1, dtype=np.int64))
                del layer_ED
            for run in runs:
                run.end_iteration(setup, coster, it, measured, it == trace_iteration)
                if bar is not None:
                    bar.update(1)
            for layer, load_E in enumerate(loads_LE):
                predictor.update(layer, load_E)
                if measured:
                    skews.append(load_skew(load_E))
    finally:
        if bar is not None:
            bar.close()
    n_meas = n_it - warmup
    for run in runs:
        run.finish(setup, n_meas)
    return SimResult(setup, {run.result.name: run.result for run in runs}, n_it, warmup, trace_iteration,
                     time.perf_counter() - started, float(np.mean(skews)) if skews else 0.0)


def _owned(shard: Placement) -> np.ndarray:
    """[D] the experts each device owns: ``shard.slots()``, counted from the owners a shard placement
    keeps (O(E)) instead of a pass over its [E, D] mask."""
    if shard.is_shard_placement():
        return np.bincount(shard.owners(), minlength=shard.num_devices)
    return shard.slots()


@dataclass
class _PolicyRun:
    """One policy's charges and what the engine accumulates for it over the iterations."""

    charges: PolicyCharges
    result: PolicyResult
    cats: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    moved: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    a2a_inter_bytes: int = 0
    a2a_bytes: int = 0
    persistent_LED: dict[int, np.ndarray] = field(default_factory=dict)
    sum_max: int = 0               # most replicas a device added over all layers of one iteration
    layer_max: int = 0             # most replicas a device added in one layer
    owned_max: int = 0             # most experts a device owns over all layers

    _costs: list[LayerCost] = field(default_factory=list)
    _nbytes: float = 0.0
    _new_copies: list = field(default_factory=list)
    _added_sum_D: np.ndarray | None = None
    _owned_D: np.ndarray | None = None

    def begin_iteration(self, num_devices: int) -> None:
        """Start an iteration: its layers come next (`layer`), then `end_iteration`."""
        self._costs, self._nbytes, self._new_copies = [], 0.0, []
        self._added_sum_D = np.zeros(num_devices, dtype=np.int64)
        self._owned_D = np.zeros(num_devices, dtype=np.int64)

    def layer(self, coster: Coster, layer: int, tokens_ED: np.ndarray, predicted_E: np.ndarray,
              measured: bool) -> None:
        """Plan and charge ``layer`` of the current iteration."""
        charges = self.charges
        step = charges.plan(layer, predicted_E, tokens_ED)
        self._costs.append(_layer_cost(coster, charges, layer, step, predicted_E))
        if step.placement is not step.shard:                # replicas added this layer
            # ΔP = P' \ shard per device, from the pairs the policy's SpAG / SpRS charge already derived
            added_D = np.bincount(step.placement.added_over(step.shard) % step.shard.num_devices,
                                  minlength=step.shard.num_devices)
            self._added_sum_D += added_D
            self.layer_max = max(self.layer_max, int(added_D.max()))
        self._owned_D += _owned(step.shard)
        # Persistent state that changed since last iteration: migration / re-sharding.
        state_ED = charges.persistent_state(step)
        prev_ED = self.persistent_LED.get(layer)
        if prev_ED is not None and prev_ED is not state_ED and not np.array_equal(prev_ED, state_ED):
            self._new_copies.append((state_ED & ~prev_ED, np.logical_or.reduceat(prev_ED, coster.offsets, axis=1)))
        self.persistent_LED[layer] = state_ED
        moved = charges.bytes_moved(layer, step)
        self._nbytes += moved["migration"] + moved["reshard"]
        if measured:
            for k, v in moved.items():
                self.moved[k] += v

    def end_iteration(self, setup: SimSetup, coster: Coster, it: int, measured: bool, record: bool) -> None:
        """Charge iteration ``it`` from its layers."""
        charges, costs = self.charges, self._costs
        plan_s = charges.take_plan_times()
        if measured:
            self.result.plan_s += plan_s
        self.sum_max = max(self.sum_max, int(self._added_sum_D.max()))
        self.owned_max = max(self.owned_max, int(self._owned_D.max()))
        migrate_s = charges.rearrangement_s(coster.migration_time(self._nbytes, self._new_copies))
        _, _, rep_opt = charges.held_replicas(self.sum_max, self.layer_max)
        tl = _iteration(setup, coster, costs, migrate_s, rep_opt * setup.expert_params,
                        self.owned_max * setup.expert_params, record=record)
        if measured:
            self.result.iteration_s.append(tl.t)
            for k, v in tl.cat.items():
                self.cats[k] += v
            self.result.straggler_s += 3.0 * sum(c.comp_max_s - c.comp_mean_s for c in costs)
            self.a2a_inter_bytes += sum(c.a2a_inter_bytes for c in costs)
            self.a2a_bytes += sum(c.a2a_bytes for c in costs)
        if tl.events is not None:
            self.result.events = tl.events
        charges.end_iteration(it)
        self._costs, self._new_copies = [], []

    def finish(self, setup: SimSetup, n_meas: int) -> None:
        res = self.result
        res.breakdown_s = {c: self.cats.get(c, 0.0) / n_meas for c in CATEGORIES}
        res.straggler_s /= n_meas
        res.bytes_moved = {k: v / n_meas for k, v in self.moved.items()}
        res.a2a_inter_fraction = self.a2a_inter_bytes / self.a2a_bytes if self.a2a_bytes else 0.0
        res.memory_bytes = _memory(self.charges, setup, self.owned_max, self.sum_max, self.layer_max)


def _memory(charges: PolicyCharges, setup: SimSetup, owned: int, sum_max: int, layer_max: int) -> dict[str, float]:
    """Model-state memory of the peak device (Fig. 12): parameters, gradients, optimizer states."""
    p = setup.precision
    rep_param, rep_grad, rep_opt = charges.held_replicas(sum_max, layer_max)
    ep_ = setup.expert_params
    param = (setup.dense_params + (owned + rep_param) * ep_) * p.param_bytes
    grad = (setup.dense_params + (owned + rep_grad) * ep_) * p.grad_bytes
    opt = (setup.dense_params + (owned + rep_opt) * ep_) * p.optimizer_bytes
    return {"Param": float(param), "Grad": float(grad), "Opt": float(opt), "Total": float(param + grad + opt)}


def _progress(total: int, enabled: bool, label: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional
        logger.info("tqdm is not installed; no progress bar")
        return None
    return tqdm(total=total, file=sys.stderr, desc=label, unit="policy-iter", leave=False)


