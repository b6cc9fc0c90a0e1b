"""Synthetic routing traces (skew as the Std of token proportions, drift, top-k) and the JSONL format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from themis_compile.sim.traces import (
    RoutingRecord,
    load_cv,
    load_skew,
    proportions_with_skew,
    read_jsonl,
    synthetic_trace,
    trace_statistics,
    write_jsonl,
)


@pytest.mark.parametrize("cv,top_k,E", [(2.56, 2, 32), (2.56, 4, 64), (2.56, 8, 128), (0.8, 5, 64)])
def test_proportions_hit_the_requested_cv(cv: float, top_k: int, E: int) -> None:
    z = np.random.default_rng(1).standard_normal(E)
    share = proportions_with_skew(z, cv / E, cap=1.0 / top_k)
    assert share.sum() == pytest.approx(1.0)
    assert (share <= 1.0 / top_k + 1e-12).all()
    assert share.std() * E == pytest.approx(cv, rel=1e-6)


def test_synthetic_trace_cv_drift_and_determinism() -> None:
    kw = dict(num_layers=2, num_experts=32, num_devices=8, tokens_per_device=8192, top_k=2, iterations=12,
              cv=1.28, drift=0.05, seed=3)
    trace = synthetic_trace(**kw)
    again = synthetic_trace(**kw)
    assert all(np.array_equal(a.tokens_per_device_expert, b.tokens_per_device_expert)
               for a, b in zip(trace.records, again.records))
    assert trace.num_layers == 2 and trace.steps == list(range(12)) and trace.top_k == 2
    rec = trace.record(5, 1)
    assert rec.tokens_per_expert.sum() == 8 * 8192 * 2            # every token makes k assignments
    assert trace.cv() == pytest.approx(1.28, rel=0.1)             # sampling noise only
    assert trace.skew() == pytest.approx(1.28 / 32, rel=0.1)      # Std of shares summing to 1
    # Slow drift: adjacent steps are much closer than distant ones.
    p = [trace.record(s, 0).tokens_per_expert / (8 * 8192 * 2) for s in range(12)]
    assert np.abs(p[1] - p[0]).sum() < np.abs(p[11] - p[0]).sum()
    other = synthetic_trace(**{**kw, "seed": 4})
    assert not np.array_equal(other.records[0].tokens_per_expert, trace.records[0].tokens_per_expert)
    # The CV is held as k changes: the shares of a top-5 trace are as skewed as those of a top-2 one.
    top5 = synthetic_trace(**{**kw, "top_k": 5})
    assert top5.cv() == pytest.approx(trace.cv(), rel=0.1)
    # Jitter lowers the step-to-step correlation and changes the hottest expert more often.
    calm, noisy = trace_statistics(trace), trace_statistics(synthetic_trace(**{**kw, "jitter": 0.5}))
    assert noisy["lag1"] < calm["lag1"] and noisy["hot_change"] >= calm["hot_change"]


def test_load_skew_and_even_split() -> None:
    assert load_skew(np.array([10, 10, 10, 10])) == 0.0
    assert load_skew(np.zeros(4)) == 0.0
    assert load_skew(np.array([3, 1])) == pytest.approx(0.25)
    assert load_cv(np.array([3, 1])) == pytest.approx(0.5)
    rec = RoutingRecord(0, 0, np.array([7, 0, 5]))
    tokens_ED = rec.tokens_ED(4)
    assert tokens_ED.shape == (3, 4)
    assert tokens_ED.sum(axis=1).tolist() == [7, 0, 5]
    assert tokens_ED.max() - tokens_ED.min() <= 2


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = synthetic_trace(3, 8, 4, 64, 2, 4, seed=0, model="tiny")
    path = tmp_path / "trace.jsonl"
    write_jsonl(trace, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["header"]["num_experts"] == 8 and first["header"]["world_size"] == 4
    back = read_jsonl(path)
    assert back.header["model"] == "tiny" and len(back.records) == len(trace.records)
    for a, b in zip(trace.records, back.records):
        assert (a.step, a.layer) == (b.step, b.layer)
        assert np.array_equal(a.tokens_per_expert, b.tokens_per_expert)
        assert np.array_equal(a.tokens_per_device_expert, b.tokens_per_device_expert)


def test_reader_is_lenient_but_names_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1, 2, 3]}\n\n'
                    '{"step": 1, "layer": 0, "tokens_per_expert": [3, 2, 1], "extra": true}\n')
    trace = read_jsonl(path)
    assert trace.num_experts == 3 and trace.steps == [0, 1] and trace.header == {}
    assert trace.record(1, 0).tokens_per_device_expert is None
    path.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1, 2]}\n{"step": 1, "layer": 0}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: record lacks 'tokens_per_expert'"):
        read_jsonl(path)
    path.write_text('{"step": 0, "layer": 0, "tokens_per_expert": [1, 2], '
                    '"tokens_per_device_expert": [[1, 1], [0, 0]]}\n')
    with pytest.raises(ValueError, match="does not sum"):
        read_jsonl(path)
    path.write_text('{"header": {"num_experts": 3}}\n{"step": 0, "layer": 0, "tokens_per_expert": [1, 2]}\n')
    with pytest.raises(ValueError, match="num_experts=3"):
        read_jsonl(path)


DEMO_TRACE = Path(__file__).parent / "data" / "demo_trace.jsonl"


def test_synthetic_dynamics_match_a_trace_the_demo_recorded() -> None:
    """tests/sim/data/demo_trace.jsonl is `make demo`'s trace_ep.jsonl (tiny-moe: 8 experts, top-2, aux
    weight 0.001, 2 ranks, 120 steps). A synthetic trace at its CV, with the default dynamics, has the
    same step-to-step statistics (averaged over seeds: a 120-step sample ACF is noisy)."""
    real = read_jsonl(DEMO_TRACE)
    h = real.header
    want = trace_statistics(real, skip=10)
    got = [trace_statistics(synthetic_trace(real.num_layers, real.num_experts, h["world_size"],
                                            h["seq_len"] * h["batch_per_rank"], h["top_k"], len(real.steps),
                                            cv=want["cv"], seed=seed), skip=10) for seed in range(3)]
    mean = {k: float(np.mean([g[k] for g in got])) for k in want}
    assert mean["cv"] == pytest.approx(want["cv"], rel=0.05)
    assert abs(mean["lag1"] - want["lag1"]) < 0.1
    assert abs(mean["hot_change"] - want["hot_change"]) < 0.1
    # The statistics discriminate: a trace that forgets its loads every step matches neither.
    memoryless = trace_statistics(synthetic_trace(real.num_layers, real.num_experts, h["world_size"],
                                                  h["seq_len"] * h["batch_per_rank"], h["top_k"],
                                                  len(real.steps), cv=want["cv"], drift=1.0, seed=0), skip=10)
    assert memoryless["lag1"] < want["lag1"] - 0.3 and memoryless["hot_change"] > want["hot_change"] + 0.3


def _eager_synthetic_counts(L, E, D, tokens_per_device, top_k, iterations, *, cv, drift, jitter, device_spread, seed):
    """The synthetic trace drawn all at once (how it was generated before its records became lazy)."""
    from themis_compile.sim.traces import proportions_with_skew

    rng = np.random.default_rng(seed)
    z_LE = rng.standard_normal((L, E))
    spread_LDE = device_spread * rng.standard_normal((L, D, E))
    keep, scale = math.sqrt(1.0 - drift * drift), 1.0 / math.sqrt(1.0 + jitter * jitter)
    out = {}
    for step in range(iterations):
        if step:
            z_LE = keep * z_LE + drift * rng.standard_normal((L, E))
        noisy_LE = scale * (z_LE + jitter * rng.standard_normal((L, E)))
        for layer in range(L):
            p_DE = proportions_with_skew(noisy_LE[layer], cv / E, 1.0 / top_k)[None, :] * np.exp(spread_LDE[layer])
            p_DE /= p_DE.sum(axis=1, keepdims=True)
            out[step, layer] = rng.multinomial(tokens_per_device * top_k, p_DE)
    return out


@pytest.mark.parametrize("jitter,cache_bytes", [(0.0, 0), (0.3, 0), (0.3, None)])
def test_lazy_synthetic_records_equal_drawing_them_all_at_once(monkeypatch, jitter: float, cache_bytes) -> None:
    """Records generated a step at a time, read in any order (regenerated when only the last step is
    kept), are the eager generator's draws."""
    from themis_compile.sim.traces import SyntheticRecords

    if cache_bytes is not None:             # regenerate steps and the spread
        monkeypatch.setattr(SyntheticRecords, "CACHE_BYTES", cache_bytes)
        monkeypatch.setattr(SyntheticRecords, "SPREAD_CACHE_BYTES", cache_bytes)
    kw = dict(cv=2.0, drift=0.1, jitter=jitter, device_spread=0.2, seed=5)
    eager = _eager_synthetic_counts(3, 40, 6, 300, 4, 5, **kw)
    trace = synthetic_trace(3, 40, 6, 300, 4, 5, **kw)
    for step, layer in [(3, 2), (0, 0), (4, 1), (3, 0), (1, 2), (4, 2)]:
        rec = trace.record(step, layer)
        assert np.array_equal(rec.tokens_per_device_expert, eager[step, layer])
        assert rec.tokens_per_expert.dtype == np.int64
        assert np.array_equal(rec.tokens_per_expert, eager[step, layer].sum(axis=0))
        tokens_ED = rec.tokens_ED(6)
        assert tokens_ED.flags.c_contiguous and not tokens_ED.flags.writeable and tokens_ED.itemsize == 2
    assert len(trace.records) == 15 and trace.records[-1].step == 4 and trace.records[7].layer == 1
    assert [r.step for r in trace.records[2:5]] == [0, 1, 1]
