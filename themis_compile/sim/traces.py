"""Routing traces: what the gates did, per iteration and MoE layer — synthetic or recorded from training.

A trace is a list of records, one per (step, layer), with the tokens routed to every expert and, when
known, the split of those tokens over source devices. The simulator replays a trace through the planner.

JSONL format (the demo's recorder writes the same): one JSON object per line::

    {"header": {"num_experts": E, "top_k": k, "world_size": D, "model": "name"}}     (optional, first)
    {"step": 0, "layer": 0, "tokens_per_expert": [int, ...E],
     "tokens_per_device_expert": [[int, ...E], ...D]}                                   (the last key optional)

The reader is lenient: the header may be missing (E is taken from the first record), unknown keys are
ignored, blank lines are skipped. A record without ``tokens_per_device_expert`` is split evenly over
the simulated devices.

Skew is measured as the paper's Fig. 3 plots it: the shares of routed assignments p_e, which sum to 1
over the experts (`load_skew` is their Std, `load_cv` their coefficient of variation Std / mean =
E·Std). Every model's synthetic traces have the same skew at the paper's 32-GPU configurations, CV
`PAPER_CV` (see there for its derivation from Fig. 16a and §5.2); the CV is held when k changes (a fixed
Std of k-fold larger proportions would make the loads k-fold flatter at top-5 than at top-2), and the Std
is held when E grows with the EP degree (weak scaling), so EP's imbalance worsens with the EP degree as
§5.4 observes (`model_cv`).

Synthetic traces (`synthetic_trace`) have drifting, skewed loads: p ∝ exp(σ·z), z a per-layer latent
that drifts as an AR(1) process between steps (innovation ``drift``) plus a fresh per-step ``jitter``
(the mini-batch's own composition), σ solved so that the CV of p equals the requested ``cv`` exactly
(after capping p_e at 1/k: a token picks k distinct experts). They are generated a step at a time when
first read (`SyntheticRecords`), from the same random stream as generating them all at once: a large
cluster's counts do not fit in memory together (one [D, E] record is 134 MB at 4,096 devices, stored in
the narrowest integer type that holds it). Records past `SyntheticRecords.EXACT_CELLS` cells (4,096
devices) draw the same multinomial distribution with a faster exact sampler, from another random
stream. `trace_statistics` measures what a recorded
trace and a synthetic one are compared by (tests/sim/test_traces.py holds the defaults to a trace the
demo recorded): CV, lag-1 autocorrelation of the shares, and how often the hottest expert changes.

Legend: E experts, D devices (sources), L layers.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["RoutingRecord", "RoutingTrace", "synthetic_trace", "load_skew", "load_cv", "proportions_with_skew",
           "trace_statistics", "model_cv", "read_jsonl", "write_jsonl", "SyntheticRecords", "PAPER_CV",
           "PAPER_SHARE_STD",
           "PAPER_MAX_DEVICES", "DEFAULT_DRIFT", "DEFAULT_JITTER"]

# Fig. 16a: Std 0.04 of Qwen1.5-MoE's "per-expert token proportion" (between the 0.034 and 0.046 of its
# loss weights 0.1 and 0), E = 64 experts, top-4, on the paper's 32 GPUs. The paper does not say whether
# the proportions sum to 1 (shares of routed assignments, as Fig. 3 plots them: CV = 64 * 0.04 = 2.56) or
# to k (the fraction of tokens that pick the expert: CV = 64 * 0.04 / 4 = 0.64). The one skew-dependent
# figure it reports for every Fig. 9 configuration, EP 1.48x-2.87x slower than Uniform (§5.2), centres
# between them: at CV 2.56 the simulated slowdowns are 1.75-3.42 (mean 2.50, above the range's centre
# 2.18 in 7 of 10 runs), at 0.74 1.17-1.83 (below the range), at their geometric mean 1.28 1.37-2.75. `PAPER_CV` is that geometric mean, the same for every model at its 32-GPU configuration (the
# paper measures no other model's skew; all train with the same auxiliary loss weight 0.001, §5.1).
PAPER_SHARE_STD = 0.04
PAPER_DEVICES = 32
# The largest EP degree the paper measures (Fig. 13b): the skew's growth with E is known up to there.
PAPER_MAX_DEVICES = 64
PAPER_CV = math.sqrt((64 * PAPER_SHARE_STD) * (64 * PAPER_SHARE_STD / 4))
# Step-to-step dynamics of the synthetic latent, matched to a routing trace the demo recorded (`make
# demo`; tests/sim/data/demo_trace.jsonl): its lag-1 autocorrelation of the shares and how often the
# hottest expert changes (see `trace_statistics`).
DEFAULT_DRIFT = 0.05
DEFAULT_JITTER = 0.0


@dataclass(frozen=True)
class RoutingRecord:
    """The gate's output of one MoE layer in one step.

    Attributes:
        step: training step (iteration).
        layer: MoE layer index.
        tokens_per_expert: [E] int64, token assignments per expert over all devices.
        tokens_per_device_expert: [D, E] int64 or None, the same split by source device.
    """

    step: int
    layer: int
    tokens_per_expert: np.ndarray
    tokens_per_device_expert: np.ndarray | None = None

    def tokens_ED(self, num_devices: int) -> np.ndarray:
        """[E, D] int64 gate counts for a simulated world of ``num_devices`` devices.

        Uses the recorded per-device split when its device count matches; otherwise splits every
        expert's tokens evenly over the devices (the remainder to the lowest ids, rotated by expert).
        """
        if self.tokens_per_device_expert is not None and self.tokens_per_device_expert.shape[0] == num_devices:
            return np.ascontiguousarray(self.tokens_per_device_expert.T)
        E = self.tokens_per_expert.size
        q_E, r_E = np.divmod(self.tokens_per_expert, num_devices)
        rot_ED = (np.arange(num_devices)[None, :] - np.arange(E)[:, None]) % num_devices
        return q_E[:, None] + (rot_ED < r_E[:, None])

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"step": int(self.step), "layer": int(self.layer),
                               "tokens_per_expert": self.tokens_per_expert.tolist()}
        if self.tokens_per_device_expert is not None:
            obj["tokens_per_device_expert"] = self.tokens_per_device_expert.tolist()
        return obj


@dataclass
class RoutingTrace:
    """An ordered collection of `RoutingRecord` with an optional header.

    Attributes:
        records: the records, in file order.
        header: ``{"num_experts", "top_k", "world_size", "model"}`` (any may be missing).
    """

    records: Sequence[RoutingRecord]
    header: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.records, SyntheticRecords):   # generated on demand, consistent by construction
            self._index: dict[tuple[int, int], RoutingRecord] | None = None
            return
        if not self.records:
            raise ValueError("a routing trace needs at least one record")
        E = self.records[0].tokens_per_expert.size
        declared = self.header.get("num_experts")
        if declared is not None and int(declared) != E:
            raise ValueError(f"trace header says num_experts={declared} but records have {E} experts")
        for rec in self.records:
            if rec.tokens_per_expert.size != E:
                raise ValueError(f"record step={rec.step} layer={rec.layer} has {rec.tokens_per_expert.size} "
                                 f"experts, expected {E}")
        self._index = {(r.step, r.layer): r for r in self.records}

    @property
    def num_experts(self) -> int:
        if isinstance(self.records, SyntheticRecords):
            return self.records.num_experts
        return int(self.records[0].tokens_per_expert.size)

    @property
    def num_layers(self) -> int:
        if isinstance(self.records, SyntheticRecords):
            return self.records.num_layers
        return max(r.layer for r in self.records) + 1

    @property
    def steps(self) -> list[int]:
        """Distinct steps, ascending."""
        if isinstance(self.records, SyntheticRecords):
            return list(range(self.records.num_steps))
        return sorted({r.step for r in self.records})

    @property
    def top_k(self) -> int | None:
        value = self.header.get("top_k")
        return None if value is None else int(value)

    def record(self, step: int, layer: int) -> RoutingRecord:
        """The record of (step, layer); ValueError when the trace lacks it."""
        if self._index is None:
            return self.records.record(step, layer)  # type: ignore[union-attr]
        try:
            return self._index[(step, layer)]
        except KeyError:
            raise ValueError(f"the trace has no record for step {step}, layer {layer}") from None

    def skew(self) -> float:
        """Mean over records of `load_skew` (Std of the shares, summing to 1)."""
        return float(np.mean([load_skew(r.tokens_per_expert) for r in self.records]))

    def cv(self) -> float:
        """Mean over records of `load_cv`."""
        return float(np.mean([load_cv(r.tokens_per_expert) for r in self.records]))

    def write_jsonl(self, path: str | Path) -> None:
        write_jsonl(self, path)

    @classmethod
    def read_jsonl(cls, path: str | Path) -> RoutingTrace:
        return read_jsonl(path)


# --------------------------------------------------------------------------------------- skew
def model_cv(experts_per_device: int | None, num_experts: int, num_devices: int) -> float:
    """The CV a model's synthetic traces use: `PAPER_CV` at its 32-GPU configuration (E_32 = experts per
    device · 32 experts), with the Std of the shares held as E grows with the EP degree, CV = PAPER_CV · E /
    E_32 (§5.4: "baseline systems suffer increasing latency at larger EP degrees due to worsening load
    imbalance"; weak scaling of DeepSeek-V3: CV 0.64 at 16 GPUs, 2.56 at 64). Past the paper's largest EP
    degree (`PAPER_MAX_DEVICES`) nothing says how the imbalance grows: the CV is held at its value there. A
    model whose E does not scale with the devices (``experts_per_device`` None) keeps `PAPER_CV`. The CV
    does not depend on k.
    """
    if not experts_per_device:
        return PAPER_CV
    experts = min(num_experts, experts_per_device * PAPER_MAX_DEVICES)
    return PAPER_CV * experts / (experts_per_device * PAPER_DEVICES)


def load_skew(tokens_E: np.ndarray) -> float:
    """Std over experts of the shares p_e = tokens_e / Σ tokens (they sum to 1; Fig. 3, Fig. 16a).
    0 for no tokens."""
    tokens_E = np.asarray(tokens_E, dtype=np.float64)
    total = tokens_E.sum()
    return 0.0 if total <= 0 else float((tokens_E / total).std())


def load_cv(tokens_E: np.ndarray) -> float:
    """Coefficient of variation of the per-expert loads, Std / mean = E · `load_skew`."""
    return float(np.asarray(tokens_E).size * load_skew(tokens_E))


def trace_statistics(trace: RoutingTrace, skip: int = 0) -> dict[str, float]:
    """The statistics synthetic traces are held to, over the steps after the first ``skip``:

    * ``cv``: mean over records of `load_cv`;
    * ``lag1``: mean over (layer, expert) of the lag-1 autocorrelation of the expert's share over steps
      (series with no variation left out);
    * ``hot_change``: fraction of consecutive steps, over layers, whose hottest expert differs.
    """
    steps = trace.steps[skip:]
    if len(steps) < 3:
        raise ValueError(f"trace_statistics needs at least 3 steps after skip={skip}, got {len(steps)}")
    cvs, lags, changes = [], [], []
    for layer in range(trace.num_layers):
        tokens_SE = np.stack([trace.record(s, layer).tokens_per_expert for s in steps]).astype(np.float64)
        share_SE = tokens_SE / np.maximum(tokens_SE.sum(axis=1, keepdims=True), 1.0)
        cvs += [load_cv(t) for t in tokens_SE]
        x_SE = share_SE - share_SE.mean(axis=0)
        den_E = (x_SE * x_SE).sum(axis=0)
        ok_E = den_E > 1e-18
        lags += ((x_SE[1:] * x_SE[:-1]).sum(axis=0)[ok_E] / den_E[ok_E]).tolist()
        hot_S = share_SE.argmax(axis=1)
        changes += (hot_S[1:] != hot_S[:-1]).tolist()
    return {"cv": float(np.mean(cvs)), "lag1": float(np.mean(lags)) if lags else 1.0,
            "hot_change": float(np.mean(changes))}


def _cap(p_E: np.ndarray, cap: float) -> np.ndarray:
    """Proportions with every entry <= cap, the excess redistributed proportionally (water-filling)."""
    p_E = p_E / p_E.sum()
    if cap * p_E.size < 1.0 - 1e-12:
        raise ValueError(f"cannot cap {p_E.size} proportions at {cap}: they could not sum to 1")
    for _ in range(p_E.size):
        over_E = p_E > cap
        if not over_E.any():
            break
        excess = float((p_E[over_E] - cap).sum())
        p_E = np.where(over_E, cap, p_E)
        free_E = p_E < cap
        free_sum = p_E[free_E].sum()
        p_E[free_E] += excess * (p_E[free_E] / free_sum if free_sum > 0 else 1.0 / free_E.sum())
    return p_E


def proportions_with_skew(z_E: np.ndarray, skew: float, cap: float = 1.0) -> np.ndarray:
    """p ∝ exp(σ·z), capped at ``cap``, with σ >= 0 solved so that Std(p) = ``skew``.

    When the requested skew exceeds what the cap allows, the most skewed feasible p is returned (and a
    warning logged).
    """
    z_E = np.asarray(z_E, dtype=np.float64)
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    if skew == 0 or z_E.size == 1:
        return np.full(z_E.size, 1.0 / z_E.size)

    def make(sigma: float) -> np.ndarray:
        w_E = np.exp(sigma * (z_E - z_E.max()))
        return _cap(w_E / w_E.sum(), cap)

    lo, hi = 0.0, 1.0
    # Std(p) grows with σ until exp underflows every weight but the largest (then the capped excess
    # spreads evenly and Std falls again): stop doubling where it stops growing.
    std_hi = make(hi).std()
    while std_hi < skew and hi < 1e3:
        std_next = make(2.0 * hi).std()
        if std_next <= std_hi:
            break
        lo, hi, std_hi = hi, 2.0 * hi, std_next
    if std_hi < skew:
        logger.warning("skew %.4f is not reachable with %d experts capped at %.3f; using %.4f",
                       skew, z_E.size, cap, std_hi)
        return make(hi)
    for _ in range(40):                     # σ to 2^-40 of its bracket
        mid = 0.5 * (lo + hi)
        if make(mid).std() < skew:
            lo = mid
        else:
            hi = mid
    return make(hi)


def synthetic_trace(num_layers: int, num_experts: int, num_devices: int, tokens_per_device: int,
                    top_k: int, iterations: int, *, cv: float = PAPER_CV, drift: float | None = None,
                    jitter: float | None = None, device_spread: float = 0.2, seed: int = 0,
                    model: str | None = None) -> RoutingTrace:
    """A drifting, skewed synthetic routing trace.

    Args:
        num_layers, num_experts, num_devices: L, E, D.
        tokens_per_device: tokens each device routes per step (batch · seq_len); each picks ``top_k``.
        top_k: experts per token.
        iterations: steps to generate.
        cv: coefficient of variation of the expert shares (see the module docstring; `PAPER_CV`).
        drift: per-step innovation of the latent loads (AR(1): z ← √(1-drift²)·z + drift·ε); default
            `DEFAULT_DRIFT`.
        jitter: Std of a fresh per-step latent noise added to z (the batch's composition); default
            `DEFAULT_JITTER`.
        device_spread: how much a device's routing differs from the global one (log-normal, fixed per
            device and layer; 0: every device routes alike up to sampling noise).
        seed: seeds everything; equal arguments give equal traces.
        model: a name for the header.
    """
    drift = DEFAULT_DRIFT if drift is None else float(drift)
    jitter = DEFAULT_JITTER if jitter is None else float(jitter)
    for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("num_devices", num_devices),
                        ("tokens_per_device", tokens_per_device), ("iterations", iterations)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if not 0 <= drift <= 1:
        raise ValueError(f"drift must be in [0, 1], got {drift}")
    if device_spread < 0 or cv < 0 or jitter < 0:
        raise ValueError("cv, jitter and device_spread must be >= 0")
    records = SyntheticRecords(int(num_layers), int(num_experts), int(num_devices), int(tokens_per_device) * int(top_k),
                               int(iterations), cap=1.0 / top_k, share_skew=cv / num_experts, drift=drift,
                               jitter=jitter, device_spread=device_spread, seed=seed)
    header = {"num_experts": int(num_experts), "top_k": int(top_k), "world_size": int(num_devices), "model": model,
              "cv": float(cv), "drift": drift, "jitter": jitter, "synthetic": True}
    return RoutingTrace(records, header)


def _narrow(counts: np.ndarray) -> np.ndarray:
    """``counts`` (non-negative) in the narrowest unsigned integer type that holds them."""
    top = int(counts.max(initial=0))
    dtype = np.uint16 if top < 2 ** 16 else np.uint32 if top < 2 ** 32 else np.int64
    return counts.astype(dtype)


def _transposed(a_XY: np.ndarray, rows: int = 512) -> np.ndarray:
    """``a_XY.T`` as a C-contiguous [Y, X] copy, made ``rows`` rows at a time (each chunk's reads and
    writes stay in cache: a quarter faster than one strided copy of a block of the Poisson sampler)."""
    out_YX = np.empty(a_XY.shape[::-1], dtype=a_XY.dtype)
    for lo in range(0, a_XY.shape[0], rows):
        out_YX[:, lo:lo + rows] = a_XY[lo:lo + rows].T
    return out_YX


class SyntheticRecords(Sequence[RoutingRecord]):
    """The records of `synthetic_trace`, step-major, each step's L records generated when first read.

    The random stream is consumed in the order of generating everything at once, so the records do not
    depend on the order they are read in::

        z ← N(0, 1)^[L, E];  spread ← s·N(0, 1)^[L, D, E]                 # once
        for step: z ← √(1-drift²)·z + drift·ε (step > 0);  z̃ ← (z + jitter·ε') / √(1 + jitter²)
            for layer: p ← proportions_with_skew(z̃[layer]);  p_DE ∝ p·exp(spread[layer])
                       counts_DE ← Multinomial(k·B·S, p_DE)

    Two samplers draw the multinomial, the same distribution from different random streams:

    * records of at most `EXACT_CELLS` cells (E·D; every configuration of `simulate --paper` and the
      weak scaling to 1,024 devices): numpy's ``Generator.multinomial`` on the main stream, the spread
      drawn from it too (the stream every figure before this sampler was measured on);
    * larger records: `_poisson_multinomial`, in blocks of devices — independent Poisson counts with a
      mean a little below the row total, a row whose sum overshoots drawn again, the shortfall added as
      categorical draws. That is exactly Multinomial(n, p) (given its sum s, a Poisson vector is
      Multinomial(s, p); s ≤ n depends on s alone; Multinomial(s, p) + Multinomial(n - s, p) is
      Multinomial(n, p)) at less cost: numpy's multinomial is one binomial per cell (about 90 ns each
      at 4,096 devices), its Poisson draw cheaper for the small counts there, and the blocks need no
      transpose and no float64 spread (30 % less time per record for DeepSeek-V3 at 4,096 devices). The spread comes from a generator of its own per layer (so it can be drawn again block by
      block, or kept as float16 when it fits in `SPREAD_CACHE_BYTES`: the same values either way).

    What is kept is small: the generator's state where each layer's spread starts (small records: the
    spread is drawn again when needed, instead of holding the [L, D, E] floats, unless they fit in
    `SPREAD_CACHE_BYTES`), the state and z at the start of every
    step generated so far (a step is regenerated from there), and the records of the latest steps up to
    `CACHE_BYTES` (at least the last step's; a small trace stays whole), whose counts are stored as
    [E, D] in the narrowest integer type (`RoutingRecord.tokens_ED` returns them without a copy;
    read-only).
    """

    CACHE_BYTES = 256 * 2 ** 20
    SPREAD_CACHE_BYTES = 1024 * 2 ** 20
    # Records up to this many cells (E·D) are drawn by numpy's multinomial on the original stream: every
    # configuration up to 1,024 devices (DeepSeek-V3 there: 4,096 x 1,024 cells); 4,096 devices use the
    # Poisson sampler.
    EXACT_CELLS = 2 ** 24
    # The Poisson sampler's work unit (cells per block of devices) and the margin of its Poisson mean
    # below the row total n, in standard deviations: n - margin·√n (a row is drawn again with probability
    # about Φ(-margin), 7 %; about margin·√n categorical draws complete a row).
    BLOCK_CELLS = 2 ** 20
    POISSON_MARGIN = 1.5

    def __init__(self, num_layers: int, num_experts: int, num_devices: int, assignments: int, num_steps: int, *,
                 cap: float, share_skew: float, drift: float, jitter: float, device_spread: float,
                 seed: int) -> None:
        self.num_layers, self.num_experts, self.num_devices = num_layers, num_experts, num_devices
        self.num_steps = num_steps
        self._assignments, self._cap, self._share_skew = assignments, cap, share_skew
        self._drift, self._jitter, self._spread = drift, jitter, device_spread
        self._seed = seed
        self._keep = math.sqrt(1.0 - drift * drift)
        # The jittered latent keeps unit variance, so that σ (and with it the CV) means the same every step.
        self._scale = 1.0 / math.sqrt(1.0 + jitter * jitter)
        self._rng = np.random.default_rng(seed)
        z_LE = self._rng.standard_normal((num_layers, num_experts))
        self._spread_states: list[dict] = []
        # Per layer: exp(spread) as [D, E] float64 (multinomial), or the Poisson sampler's [E, b] float16 blocks.
        self._spread_cache: list[np.ndarray] | list[list[np.ndarray]] | None = None
        self._poisson = num_devices * num_experts > self.EXACT_CELLS
        if self._poisson:
            if 2.0 * num_layers * num_devices * num_experts <= self.SPREAD_CACHE_BYTES:
                self._spread_cache = [list(self._spread_blocks(layer)) for layer in range(num_layers)]
        elif 8.0 * num_layers * num_devices * num_experts <= self.SPREAD_CACHE_BYTES:
            self._spread_cache = [np.exp(device_spread * self._rng.standard_normal((num_devices, num_experts)))
                                  for _ in range(num_layers)]
        else:
            for _ in range(num_layers):        # advance past the spread, one layer at a time
                self._spread_states.append(self._rng.bit_generator.state)
                self._spread_rows(None)
        self._starts = [(self._rng.bit_generator.state, z_LE)]     # generator state and z before step s
        self._cached: dict[int, list[RoutingRecord]] = {}           # step -> records, oldest first

    def _spread_rows(self, state: dict | None) -> np.ndarray | None:
        """exp(spread[layer]) [D, E] from the generator state where that layer's spread starts (None:
        draw and discard from the main generator, in row blocks)."""
        D, E = self.num_devices, self.num_experts
        if state is None:
            block = max(1, (1 << 22) // max(E, 1))
            for lo in range(0, D, block):
                self._rng.standard_normal((min(block, D - lo), E))
            return None
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        return np.exp(self._spread * rng.standard_normal((D, E)))

    def _block_devices(self) -> int:
        return max(1, self.BLOCK_CELLS // max(self.num_experts, 1))

    def _spread_blocks(self, layer: int):
        """The Poisson sampler's exp(spread[layer]) as float16 [E, b] blocks of `_block_devices` devices
        (a relative rounding of 2^-11 on a factor of about ±20 %; half the bytes to keep), from the
        layer's own generator (the same values on every call)."""
        D, E, cols = self.num_devices, self.num_experts, self._block_devices()
        rng = np.random.default_rng(np.random.SeedSequence(self._seed, spawn_key=(1, layer)))
        for lo in range(0, D, cols):
            block = rng.standard_normal((E, min(cols, D - lo)), dtype=np.float32)
            block *= np.float32(self._spread)
            yield np.exp(block, out=block).astype(np.float16)

    def _poisson_multinomial(self, p_E: np.ndarray, layer: int) -> np.ndarray:
        """[E, D] counts of one record: for every device d, Multinomial(n, p_E·exp(spread[layer, :, d]))
        (normalized), drawn as independent Poisson counts, a device's column drawn again while its sum
        exceeds n, and completed with n - sum categorical draws (see the class docstring). Built in
        blocks of devices (columns), so nothing of the record's size is transposed or held as floats.
        Stored as uint16 while the counts fit (always below 2^16 assignments a device; above, the record
        is widened the first time a block does not fit)."""
        D, E, n, rng = self.num_devices, self.num_experts, self._assignments, self._rng
        mean = max(0.0, n - self.POISSON_MARGIN * math.sqrt(n))
        out_ED = np.empty((E, D), dtype=np.uint16)
        wide = np.uint32 if n < 2 ** 32 else np.int64
        cols = self._block_devices()
        blocks = self._spread_cache[layer] if self._spread_cache is not None else self._spread_blocks(layer)
        for lo, w_Eb in zip(range(0, D, cols), blocks):
            b = w_Eb.shape[1]
            p_Eb = p_E[:, None] * w_Eb
            p_Eb /= p_Eb.sum(axis=0)
            counts_Eb = rng.poisson(p_Eb * mean)
            sum_b = counts_Eb.sum(axis=0)
            over_b = np.flatnonzero(sum_b > n)
            while over_b.size:                       # rare: draw those devices again
                counts_Eb[:, over_b] = rng.poisson(p_Eb[:, over_b] * mean)
                sum_b[over_b] = counts_Eb[:, over_b].sum(axis=0)
                over_b = over_b[sum_b[over_b] > n]
            short_b = n - sum_b
            if short_b.any():
                # The shortfall: categorical draws by inversion of each device's cumulative shares (the
                # first expert whose cumulative share exceeds u), one `searchsorted` per device of its
                # draws sorted (twice as fast; the counts do not depend on the draws' order). The
                # cumulative shares are summed in expert order, as before, but along the rows of the
                # transposed block (a cumsum down the columns costs half as much again).
                cum_bE = np.cumsum(_transposed(p_Eb), axis=1)
                ends_b = np.cumsum(short_b)
                u_i = rng.random(int(ends_b[-1])) * np.repeat(cum_bE[:, -1], short_b)
                e_i = np.empty(u_i.size, dtype=np.int64)
                for j in np.flatnonzero(short_b):
                    i0, i1 = ends_b[j] - short_b[j], ends_b[j]
                    e_i[i0:i1] = np.searchsorted(cum_bE[j], np.sort(u_i[i0:i1]), side="right")
                np.minimum(e_i, E - 1, out=e_i)
                np.add.at(counts_Eb.reshape(-1), e_i * b + np.repeat(np.arange(b), short_b), 1)
            if out_ED.dtype == np.uint16 and n >= 2 ** 16 and counts_Eb.max(initial=0) >= 2 ** 16:
                out_ED = out_ED.astype(wide)         # a device sent one expert 2^16 tokens or more
            out_ED[:, lo:lo + b] = counts_Eb
        return out_ED

    def _generate(self, step: int) -> list[RoutingRecord]:
        state, z_LE = self._starts[step]
        self._rng.bit_generator.state = state
        if step:
            z_LE = self._keep * z_LE + self._drift * self._rng.standard_normal(z_LE.shape)
        noisy_LE = self._scale * (z_LE + self._jitter * self._rng.standard_normal(z_LE.shape))
        records = []
        for layer in range(self.num_layers):
            p_E = proportions_with_skew(noisy_LE[layer], self._share_skew, self._cap)
            if self._poisson:
                counts_ED = self._poisson_multinomial(p_E, layer)
                if counts_ED.dtype != np.uint16 and counts_ED.max(initial=0) < 2 ** 16:
                    counts_ED = counts_ED.astype(np.uint16)
                total_E = counts_ED.sum(axis=1, dtype=np.int64)
            else:
                exp_spread_DE = self._spread_cache[layer] if self._spread_cache is not None else \
                    self._spread_rows(self._spread_states[layer])
                p_DE = p_E[None, :] * exp_spread_DE
                del exp_spread_DE
                p_DE /= p_DE.sum(axis=1, keepdims=True)
                counts_DE = self._rng.multinomial(self._assignments, p_DE)
                del p_DE
                counts_ED = np.ascontiguousarray(_narrow(counts_DE).T)
                total_E = counts_DE.sum(axis=0, dtype=np.int64)
            counts_ED.setflags(write=False)
            records.append(RoutingRecord(step, layer, total_E, counts_ED.T))
        if step + 1 == len(self._starts) and step + 1 < self.num_steps:
            self._starts.append((self._rng.bit_generator.state, z_LE))
        return records

    def step_records(self, step: int) -> list[RoutingRecord]:
        """The L records of ``step`` (generating the steps before it first, when they never were)."""
        if not 0 <= step < self.num_steps:
            raise ValueError(f"the trace has no step {step} (steps 0..{self.num_steps - 1})")
        records = self._cached.get(step)
        if records is None:
            while len(self._starts) <= step:         # the steps before it, for their end states
                self._generate(len(self._starts) - 1)
            records = self._cached[step] = self._generate(step)
            step_bytes = sum(r.tokens_per_device_expert.nbytes for r in records)
            while len(self._cached) > 1 and len(self._cached) * step_bytes > self.CACHE_BYTES:
                del self._cached[next(iter(self._cached))]
        return records

    def record(self, step: int, layer: int) -> RoutingRecord:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"the trace has no record for step {step}, layer {layer}")
        return self.step_records(step)[layer]

    def __len__(self) -> int:
        return self.num_steps * self.num_layers

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = int(index) + (len(self) if index < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(index)
        return self.record(i // self.num_layers, i % self.num_layers)


# --------------------------------------------------------------------------------------- JSONL
def write_jsonl(trace: RoutingTrace, path: str | Path) -> None:
    """Write ``trace`` as JSONL: the header line, then one record per line."""
    path = Path(path)
    with path.open("w") as fh:
        if trace.header:
            fh.write(json.dumps({"header": trace.header}) + "\n")
        for rec in trace.records:
            fh.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")


def _int_array(value: Any, ndim: int, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != ndim or (arr.size and arr.dtype.kind not in "iu"):
        if arr.ndim == ndim and arr.dtype.kind == "f" and np.all(arr == np.floor(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{where}: expected a {ndim}-D list of integers")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError(f"{where}: negative token counts")
    return arr


def read_jsonl(path: str | Path) -> RoutingTrace:
    """Read a JSONL routing trace (see the module docstring); ValueError names the bad line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    header: dict[str, Any] = {}
    records: list[RoutingRecord] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if "header" in obj:
                if records:
                    raise ValueError(f"{where}: a header must come before the records")
                header = dict(obj["header"] or {})
                continue
            for key in ("step", "layer", "tokens_per_expert"):
                if key not in obj:
                    raise ValueError(f"{where}: record lacks {key!r}")
            per_E = _int_array(obj["tokens_per_expert"], 1, where)
            per_DE = None
            if obj.get("tokens_per_device_expert") is not None:
                per_DE = _int_array(obj["tokens_per_device_expert"], 2, where)
                if per_DE.shape[1] != per_E.size:
                    raise ValueError(f"{where}: tokens_per_device_expert has {per_DE.shape[1]} experts, "
                                     f"tokens_per_expert {per_E.size}")
                if not np.array_equal(per_DE.sum(axis=0), per_E):
                    raise ValueError(f"{where}: tokens_per_device_expert does not sum to tokens_per_expert")
            records.append(RoutingRecord(int(obj["step"]), int(obj["layer"]), per_E, per_DE))
    if not records:
        raise ValueError(f"trace file {str(path)!r} holds no records")
    return RoutingTrace(records, header)
