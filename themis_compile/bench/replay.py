"""Replaying a recorded routing trace through a model's router: ``bench step --skew trace[:PATH]``.

A routing trace (``themis_compile.sim.traces``: the JSONL the demo records) holds, per step and MoE layer,
the tokens each expert received, and usually their split over the source ranks. `TraceReplay` makes a
model's routers reproduce those loads: before every MoE block's forward it sets the block's
``router_bias`` to the bias at which the block's own top-k over ``gate(x) + bias`` assigns this rank's
tokens to the experts in the trace's proportions (this rank's row of the trace's per-device split when
the trace was recorded at the same world size, else the global shares). The routing stays the model's
own code and is differentiable as usual; only the bias, a non-trainable tensor, follows the trace. The
routers are `themis_compile.bench.models.BenchRouter` s (the reference model's ``MoEFeedForward`` and HF
Mixtral's biased ``MixtralTopKRouter`` alike): ``block``, ``logits(x)``, ``router_bias``.

Bench step ``s`` replays the trace's ``s``-th recorded step (cyclically), bench MoE layer ``l`` its
layer ``l mod L_trace``. Shape suffixes: T tokens (of this rank), E experts, K top-k, D ranks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from themis_compile.runtime.profiling import HARNESS_RANGE
from themis_compile.sim.traces import RoutingTrace, read_jsonl

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TRACE", "TraceReplay", "fit_router_bias", "target_counts"]

# What `make demo` writes (its EP run's routing); `--skew trace` without a path replays it.
DEFAULT_TRACE = "runs/demo/trace_ep.jsonl"


def target_counts(shares_E: np.ndarray, assignments: int, cap: int) -> np.ndarray:
    """Integer counts proportional to ``shares_E`` summing to ``assignments``, each at most ``cap``.

    Largest-remainder rounding; the excess of a count above ``cap`` (a token picks K distinct experts, so
    no expert can receive more than T) goes to the experts with the most room, in proportion order.
    """
    shares_E = np.asarray(shares_E, dtype=np.float64)
    total = shares_E.sum()
    if total <= 0:
        shares_E, total = np.ones_like(shares_E), float(shares_E.size)
    exact_E = shares_E / total * assignments
    counts_E = np.floor(exact_E).astype(np.int64)
    order = np.argsort(-(exact_E - counts_E), kind="stable")
    counts_E[order[: assignments - int(counts_E.sum())]] += 1
    excess = int(np.maximum(counts_E - cap, 0).sum())
    counts_E = np.minimum(counts_E, cap)
    for e in np.argsort(-shares_E, kind="stable"):
        take = min(excess, cap - int(counts_E[e]))
        counts_E[e] += take
        excess -= take
    return counts_E


@torch.no_grad()
def fit_router_bias(logits_TE: torch.Tensor, counts_E: torch.Tensor | np.ndarray, top_k: int,
                    sweeps: int = 12) -> torch.Tensor:
    """The bias b_E at which top-k(logits_TE + b_E) assigns ``counts_E[e]`` tokens to expert e.

    Contract: ``counts_E`` sums to T·K with every count in [0, T]. Returns a float32 [E] bias; the
    realized counts equal ``counts_E`` exactly when the sweeps converge (they do for the traces and sizes
    of the benchmark; tests/bench/test_replay.py measures it), otherwise they are the closest the last
    sweep reached. Ties are broken by a margin: every threshold is set midway between two tokens.

    Pseudo-code (Gauss-Seidel on the bias, one expert at a time, exact for that expert):
        b = 0
        repeat ``sweeps`` times, or until the counts match:
            for e in experts:
                thr_T = K-th largest of (z_T· + b) over the experts other than e
                m_T = z_Te - thr_T                  # token t picks e iff m_T + b_e > 0
                b_e = -(midpoint of the n_e-th and (n_e+1)-th largest m_T)     # exactly n_e tokens pick e
    """
    z_TE = logits_TE.detach().to(torch.float32)
    T, E = z_TE.shape
    counts_E = torch.as_tensor(np.asarray(counts_E), dtype=torch.int64)
    if int(counts_E.sum()) != T * top_k or int(counts_E.max()) > T or int(counts_E.min()) < 0:
        raise ValueError(f"target counts {counts_E.tolist()} are not a top-{top_k} routing of {T} tokens")
    b_E = torch.zeros(E, dtype=torch.float32)
    for _ in range(sweeps):
        for e in range(E):
            v_TE = z_TE + b_E
            v_TE[:, e] = float("-inf")
            thr_T = torch.topk(v_TE, top_k, dim=-1).values[:, top_k - 1]
            m_T = z_TE[:, e] - thr_T
            n = int(counts_E[e])
            if n == 0:
                b_E[e] = -(m_T.max() + 1.0)
            elif n == T:
                b_E[e] = -(m_T.min() - 1.0)
            else:
                top_N = torch.topk(m_T, n + 1).values
                b_E[e] = -0.5 * (top_N[n - 1] + top_N[n])
        ids_TK = torch.topk(z_TE + b_E, top_k, dim=-1).indices
        if torch.equal(torch.bincount(ids_TK.reshape(-1), minlength=E), counts_E):
            break
    return b_E


class TraceReplay:
    """Drives the routers of one model through a recorded trace, step by step.

    Usage::

        replay = TraceReplay.load(path, num_experts=E, top_k=K, rank=r, world=D)
        replay.install(routers)        # forward pre-hooks on their MoE blocks (bench.models.BenchRouter)
        for step in ...:
            replay.set_step(step)      # before the step's forward
            ...
        replay.fit_seconds             # time spent fitting biases (the harness's, not the policy's)
    """

    def __init__(self, trace: RoutingTrace, top_k: int, rank: int, world: int, source: str = "") -> None:
        self.trace, self.top_k, self.rank, self.world, self.source = trace, top_k, rank, world, source
        self.steps = trace.steps
        self.step = 0
        self.fit_seconds = 0.0
        self._handles: list = []

    @classmethod
    def load(cls, path: str | Path, num_experts: int, top_k: int, rank: int, world: int) -> TraceReplay:
        """Read ``path``; ValueError when it cannot drive a model with ``num_experts`` experts."""
        trace = read_jsonl(path)
        if trace.num_experts != num_experts:
            raise ValueError(f"trace {str(path)!r} has {trace.num_experts} experts, the model {num_experts}; "
                             f"pass --experts {trace.num_experts}")
        if trace.top_k is not None and trace.top_k != top_k:
            logger.warning("trace %s was recorded with top-%d routing, replayed with top-%d: its shares of "
                           "assignments are kept", path, trace.top_k, top_k)
        return cls(trace, top_k, rank, world, str(path))

    def trace_step(self, step: int) -> int:
        """The recorded step that bench step ``step`` replays."""
        return self.steps[step % len(self.steps)]

    def target_shares(self, step: int, layer: int, local: bool) -> np.ndarray:
        """[E] load shares of (bench) ``step`` and MoE ``layer``: this rank's, when ``local`` and the trace
        has a per-device split at this world size, else the global ones."""
        rec = self.trace.record(self.trace_step(step), layer % self.trace.num_layers)
        per_DE = rec.tokens_per_device_expert
        if local and per_DE is not None and per_DE.shape[0] == self.world and per_DE[self.rank].sum() > 0:
            counts_E = per_DE[self.rank]
        else:
            counts_E = rec.tokens_per_expert
        return counts_E / max(int(counts_E.sum()), 1)

    def set_step(self, step: int) -> None:
        self.step = step

    def install(self, routers) -> None:
        """Register the bias-fitting pre-hook on the MoE block of every router (``BenchRouter``: MoE layer
        ``l`` is ``routers[l]``)."""
        for layer, router in enumerate(routers):
            self._handles.append(router.block.register_forward_pre_hook(self._hook(layer, router)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int, router):
        def fit(block, args) -> None:
            with torch.profiler.record_function(HARNESS_RANGE):
                self._fit(layer, router, args)

        return fit

    def _fit(self, layer: int, router, args) -> None:
        t0 = time.perf_counter()
        x_TH = args[0].detach().reshape(-1, args[0].shape[-1])
        T = x_TH.shape[0]
        counts_E = target_counts(self.target_shares(self.step, layer, local=True), T * self.top_k, T)
        with torch.no_grad():
            bias_E = fit_router_bias(router.logits(x_TH), counts_E, self.top_k)
            router.router_bias.copy_(bias_E.to(router.router_bias.dtype))
        self.fit_seconds += time.perf_counter() - t0
