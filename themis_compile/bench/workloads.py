"""Named routing workloads for ``bench step --workload NAME`` / ``--workloads all``.

A workload is the expert load each MoE router must produce at each step: target shares of the top-k
assignments per expert (this rank's, or the same on every rank), realized exactly as a replayed trace is,
by fitting every router's ``router_bias`` before its forward (`themis_compile.bench.replay`). The routing
stays the model's own code; only the bias follows the workload. Every workload is a function of
(step, layer, rank) and a seed, so a run is reproducible and every policy sees the same loads.

    balanced     every expert the same share (the force-balanced router of published MoE figures)
    paper        the router skew calibrated to the paper's Std of load shares, 0.04 (no fitting)
    trace        the recorded routing trace ``make demo`` writes (``--skew trace``)
    zipf         shares ∝ 1 / rank^1.2 over a seeded order of the experts
    hot-expert   one seeded expert chosen by 90 % of the tokens, the rest even
    hot-rank     one seeded rank sends all its tokens to the experts it owns under EP's contiguous
                 placement; the other ranks route evenly
    drift        a hot spot moving around a seeded ring of the experts, one expert per ``DRIFT_EVERY``
                 steps (shares ∝ 1 / (1 + ring distance)^1.2)
    shift        zipf, then at mid-run another seeded order (a sudden change of popularity)

Shape suffixes: E experts, D ranks.
"""

from __future__ import annotations

import numpy as np

from themis_compile.bench.replay import TraceReplay

__all__ = ["WORKLOADS", "SYNTHETIC", "ZIPF_S", "HOT_SHARE", "DRIFT_EVERY", "workload_shares", "WorkloadReplay"]

SYNTHETIC = ("balanced", "zipf", "hot-expert", "hot-rank", "drift", "shift")
WORKLOADS = ("balanced", "paper", "trace", "zipf", "hot-expert", "hot-rank", "drift", "shift")
ZIPF_S = 1.2
HOT_SHARE = 0.9          # of the tokens choosing the hot expert (a token picks K distinct experts)
DRIFT_EVERY = 2


def _zipf(order_E: np.ndarray) -> np.ndarray:
    """Shares ∝ 1 / (i + 1)^s for the expert at position i of ``order_E``."""
    shares_E = np.empty(order_E.size)
    shares_E[order_E] = 1.0 / np.arange(1, order_E.size + 1) ** ZIPF_S
    return shares_E / shares_E.sum()


def workload_shares(name: str, step: int, num_experts: int, top_k: int, world: int, *, rank: int | None = None,
                    seed: int = 0, total_steps: int = 1) -> np.ndarray:
    """[E] target shares of the top-k assignments (summing to 1) of workload ``name`` at ``step``: rank
    ``rank``'s own tokens, or (``rank=None``) the global shares. ``total_steps`` places ``shift``'s change
    at the middle of the run."""
    E = num_experts
    rng = np.random.default_rng([seed, E, world])
    order_E = rng.permutation(E)
    if name == "balanced":
        return np.full(E, 1.0 / E)
    if name == "zipf":
        return _zipf(order_E)
    if name == "hot-expert":
        hot = int(order_E[0])
        # The hot expert takes HOT_SHARE of the tokens, i.e. HOT_SHARE / K of the T·K assignments.
        shares_E = np.full(E, (1.0 - HOT_SHARE / top_k) / (E - 1))
        shares_E[hot] = HOT_SHARE / top_k
        return shares_E
    if name == "hot-rank":
        hot_rank = int(rng.integers(world))
        if rank is None:          # the mean of the ranks' shares (each rank routes the same number of tokens)
            return np.mean([workload_shares(name, step, E, top_k, world, rank=r, seed=seed) for r in range(world)],
                           axis=0)
        if rank != hot_rank:
            return np.full(E, 1.0 / E)
        # EP's contiguous placement: rank r owns experts [r·E/D, (r+1)·E/D) (E >= D).
        owned = np.arange(E)[(np.arange(E) * world) // E == hot_rank]
        if owned.size < top_k:
            raise ValueError(f"workload hot-rank: rank {hot_rank} owns {owned.size} experts, fewer than top-k "
                             f"{top_k}; use more experts")
        shares_E = np.zeros(E)
        shares_E[owned] = 1.0 / owned.size
        return shares_E
    if name == "drift":
        # The experts on a seeded ring; popularity ∝ 1 / (1 + ring distance to a centre)^s, the centre
        # moving one expert per DRIFT_EVERY steps: every expert's share changes a little at each step.
        pos_E = np.empty(E)
        pos_E[order_E] = np.arange(E)
        away_E = np.abs(pos_E - step / DRIFT_EVERY) % E
        shares_E = 1.0 / (1.0 + np.minimum(away_E, E - away_E)) ** ZIPF_S
        return shares_E / shares_E.sum()
    if name == "shift":
        if step < total_steps // 2:
            return _zipf(order_E)
        return _zipf(np.random.default_rng([seed, E, world, 1]).permutation(E))
    raise ValueError(f"unknown synthetic workload {name!r}; choose from {list(SYNTHETIC)}")


class WorkloadReplay(TraceReplay):
    """`TraceReplay` driven by a synthetic workload instead of a recorded trace (same fitting, same hooks)."""

    def __init__(self, name: str, num_experts: int, top_k: int, rank: int, world: int, *, seed: int = 0,
                 total_steps: int = 1) -> None:
        if name not in SYNTHETIC:
            raise ValueError(f"unknown synthetic workload {name!r}; choose from {list(SYNTHETIC)}")
        self.name, self.num_experts, self.seed, self.total_steps = name, num_experts, seed, total_steps
        self.top_k, self.rank, self.world, self.source = top_k, rank, world, f"workload:{name}"
        self.steps = list(range(total_steps))
        self.step = 0
        self.fit_seconds = 0.0
        self._handles = []
        workload_shares(name, 0, num_experts, top_k, world, rank=rank, seed=seed)      # fail early

    def trace_step(self, step: int) -> int:
        return step

    def target_shares(self, step: int, layer: int, local: bool) -> np.ndarray:
        return workload_shares(self.name, step, self.num_experts, self.top_k, self.world,
                               rank=self.rank if local else None, seed=self.seed, total_steps=self.total_steps)
