"""The synthetic traces' two samplers (`traces.SyntheticRecords`): records up to ``EXACT_CELLS`` cells (up to
1,024 devices) keep numpy's multinomial stream, so those figures stay bit for bit what they were (the small
ones pinned below); larger records are drawn by the exact Poisson sampler, which must be the same
multinomial distribution."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from themis_compile.sim import paper
from themis_compile.sim.traces import SyntheticRecords, proportions_with_skew, synthetic_trace

# `simulate --weak-scaling 32,256` before the Poisson sampler and the layer-major engine (docs/simulator.md,
# "Scale"): mean iteration seconds of EP / FasterMoE / Themis. Any change of the multinomial stream, the
# plans or the charges at these sizes moves them.
PINNED = {
    ("deepseek-v3", 32): (1.394907208618667, 1.2486292276709745, 0.7819760644660513),
    ("deepseek-v3", 256): (3.4430138657148714, 2.770461310273641, 1.3566911332890257),
    ("qwen1.5-moe", 32): (4.731656596845711, 3.7859733056759546, 1.4323262461918238),
}


@pytest.mark.parametrize("model,devices", sorted(PINNED))
def test_weak_scaling_at_small_sizes_is_pinned(model, devices):
    row, = paper.weak_scaling([devices], model=model)
    got = row["mean_iteration_s"]
    assert (got["ep"], got["fastermoe"], got["themis"]) == pytest.approx(PINNED[model, devices], rel=1e-12, abs=0)


def _poisson(monkeypatch):
    monkeypatch.setattr(SyntheticRecords, "EXACT_CELLS", 0)


def test_records_to_1024_devices_use_the_multinomial_and_larger_ones_the_poisson_sampler(monkeypatch):
    assert 4096 * 1024 <= SyntheticRecords.EXACT_CELLS < 8192 * 4096       # DeepSeek-V3 at 1,024, Qwen at 4,096
    assert synthetic_trace(2, 1024, 256, 4096, 8, 2).records._poisson is False
    monkeypatch.setattr(SyntheticRecords, "EXACT_CELLS", 1024 * 256 - 1)
    assert synthetic_trace(2, 1024, 256, 4096, 8, 2).records._poisson is True


def test_poisson_records_sum_to_the_assignments_and_are_read_only(monkeypatch):
    _poisson(monkeypatch)
    monkeypatch.setattr(SyntheticRecords, "BLOCK_CELLS", 40 * 3)                           # several blocks
    trace = synthetic_trace(2, 40, 16, 300, 4, 3, cv=2.0, seed=1)
    for step in range(3):
        for layer in range(2):
            rec = trace.record(step, layer)
            tokens_ED = rec.tokens_ED(16)
            assert tokens_ED.dtype == np.uint16 and tokens_ED.flags.c_contiguous and not tokens_ED.flags.writeable
            assert (tokens_ED.sum(axis=0) == 1200).all()
            assert np.array_equal(rec.tokens_per_expert, tokens_ED.sum(axis=1))
            assert rec.tokens_per_expert.dtype == np.int64


def test_poisson_records_do_not_depend_on_caching_or_reading_order(monkeypatch):
    _poisson(monkeypatch)
    monkeypatch.setattr(SyntheticRecords, "BLOCK_CELLS", 40 * 4)
    kw = dict(cv=2.0, drift=0.1, jitter=0.3, device_spread=0.2, seed=5)
    whole = synthetic_trace(3, 40, 10, 300, 4, 4, **kw)
    expect = {(s, l): whole.record(s, l).tokens_ED(10).copy() for s in range(4) for l in range(3)}
    monkeypatch.setattr(SyntheticRecords, "CACHE_BYTES", 0)
    monkeypatch.setattr(SyntheticRecords, "SPREAD_CACHE_BYTES", 0)                         # spread drawn again
    lazy = synthetic_trace(3, 40, 10, 300, 4, 4, **kw)
    assert lazy.records._spread_cache is None and whole.records._spread_cache is not None
    for s, l in [(3, 2), (0, 0), (2, 1), (3, 0), (1, 2)]:
        assert np.array_equal(lazy.record(s, l).tokens_ED(10), expect[s, l])


def test_the_poisson_sampler_draws_the_multinomial(monkeypatch):
    """Without device spread and drift every device's counts are Multinomial(n, p) draws of one p: their
    means, variances and covariances are n·p, n·p(1-p) and -n·p_i·p_j, within sampling error."""
    _poisson(monkeypatch)
    E, D, n, S = 12, 64, 60, 150
    trace = synthetic_trace(1, E, D, n // 2, 2, S, cv=1.3, drift=0.0, device_spread=0.0, seed=3)
    c_NE = np.concatenate([trace.record(s, 0).tokens_per_device_expert.astype(np.int64) for s in range(S)])
    p_E = proportions_with_skew(np.random.default_rng(3).standard_normal((1, E))[0], 1.3 / E, 0.5)
    N = c_NE.shape[0]
    assert (c_NE.sum(axis=1) == n).all()
    z_E = (c_NE.mean(axis=0) - n * p_E) / np.sqrt(n * p_E * (1 - p_E) / N)
    assert np.abs(z_E).max() < 4 and (z_E ** 2).sum() < 2 * E + 6 * np.sqrt(2 * E)
    var_ratio_E = c_NE.var(axis=0, ddof=1) / (n * p_E * (1 - p_E))
    assert np.abs(var_ratio_E - 1).max() < 6 * np.sqrt(2 / N)
    cov = np.cov(c_NE[:, 0], c_NE[:, 1])[0, 1]
    assert cov == pytest.approx(-n * p_E[0] * p_E[1], abs=6 * np.sqrt(n * p_E[0] * n * p_E[1] / N))


def test_the_poisson_sampler_gives_the_same_figures_statistically(monkeypatch):
    """The weak-scaling setup at 32 devices with either sampler over four seeds: EP, FasterMoE and
    Themis iterate alike, within three standard errors of the difference of the means (seed to seed the
    figures spread by several per cent: the latent loads follow other draws)."""
    from themis_compile.cost_model.cluster import get_cluster

    def times():
        runs = [paper.run_config("deepseek-v3", get_cluster("A", 4), policies=("ep", "fastermoe", "themis"),
                                 iterations=12, seed=seed) for seed in range(4)]
        return {n: np.array([r.policies[n].mean_iteration_s for r in runs]) for n in ("ep", "fastermoe", "themis")}

    multinomial = times()
    _poisson(monkeypatch)
    poisson = times()
    for name, a in multinomial.items():
        b = poisson[name]
        assert not np.array_equal(a, b)
        stderr = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        assert abs(a.mean() - b.mean()) < 3 * stderr + 1e-3 * a.mean(), name


# The Poisson sampler's records at fixed seeds (sha256 of the int64 [E, D] counts, first 16 hex digits):
# several blocks of devices; one block with jitter; more than 2^16 assignments a device with one expert
# past 2^16 tokens (the record widened to uint32). A change of the sampler's random stream moves them.
POISSON_RECORDS = [
    (dict(num_layers=2, num_experts=40, num_devices=16, tokens_per_device=300, top_k=4, iterations=3, cv=2.0,
          seed=1), 40 * 3, np.uint16,
     ["e8903a206bbf9531", "05d17f8c8fed456b", "50112c64c2977561", "309b84feb57e688c", "be505df8ec142aca",
      "a040f563ff37059c"]),
    (dict(num_layers=1, num_experts=64, num_devices=24, tokens_per_device=512, top_k=2, iterations=2, cv=1.28,
          jitter=0.2, seed=7), 2 ** 20, np.uint16, ["fb5d2fdbd332aa84", "bf1c5b24c10b7347"]),
    (dict(num_layers=1, num_experts=8, num_devices=4, tokens_per_device=70000, top_k=1, iterations=1, cv=2.5,
          seed=2), 8 * 2, np.uint32, ["d43c53b2333dbd97"]),
]


@pytest.mark.parametrize("kw,block_cells,dtype,digests", POISSON_RECORDS)
def test_the_poisson_samplers_records_are_pinned(monkeypatch, kw, block_cells, dtype, digests):
    _poisson(monkeypatch)
    monkeypatch.setattr(SyntheticRecords, "BLOCK_CELLS", block_cells)
    trace = synthetic_trace(**kw)
    D, got = kw["num_devices"], []
    for step in range(kw["iterations"]):
        for layer in range(kw["num_layers"]):
            tokens_ED = trace.record(step, layer).tokens_ED(D)
            assert tokens_ED.dtype == dtype
            assert (tokens_ED.sum(axis=0, dtype=np.int64) == kw["tokens_per_device"] * kw["top_k"]).all()
            got.append(hashlib.sha256(tokens_ED.astype(np.int64).tobytes()).hexdigest()[:16])
    assert got == digests
