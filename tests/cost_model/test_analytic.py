"""The closed-form cost model: Ψ, T_attn, t, m and the symbolic forms with their solver."""

from __future__ import annotations

import math

import pytest

from themis_compile.cost_model import analytic
from themis_compile.models.presets import preset


def test_expert_bytes_counts_the_expert_matrices() -> None:
    phi = preset("phi-3.5-moe")                       # SwiGLU: three matrices
    gpt = preset("gpt-s-moe")                         # GeLU: two
    assert analytic.expert_bytes(phi) == 3 * 4096 * 6400 * 2
    assert analytic.expert_bytes(gpt, param_bytes=4) == 2 * 768 * 3072 * 4
    assert analytic.expert_flops_per_token(gpt) == 2 * 2 * 768 * 3072


def test_attention_time_and_overlap_degree() -> None:
    cfg = preset("gpt-s-moe")
    flops = 8 * 2 * 2048 * 768**2 + 4 * 2 * 2048**2 * 768
    assert analytic.attention_flops(cfg, 2) == flops
    t_attn = analytic.attention_time(cfg, 2, peak_flops=100e12, efficiency=0.5)
    assert t_attn == pytest.approx(flops / 50e12)
    psi = analytic.expert_bytes(cfg)
    assert analytic.overlap_degree(t_attn, 40e9, psi) == math.floor(t_attn * 40e9 / psi)
    assert analytic.overlap_degree(3.0, 2.0, 2.0) == 3          # exact multiples are not lost
    assert analytic.overlap_degree(0.0, 1e9, psi) == 0
    with pytest.raises(ValueError, match="bw"):
        analytic.overlap_degree(1.0, 0.0, psi)


def test_materialization_budget_spans_all_layers_with_rematerialization() -> None:
    psi = 100.0
    # Without re-materialization a replica slot costs L parameters + one gradient buffer.
    assert analytic.materialization_budget(1000.0, psi, num_layers=4) == 1000 // (4 * 100 + 100)
    assert analytic.materialization_budget(1000.0, psi, num_layers=4, rematerialize=True) == 1000 // 200
    assert analytic.materialization_budget(0.0, psi, num_layers=4) == 0
    with pytest.raises(ValueError, match="memory budget"):
        analytic.materialization_budget(-1.0, psi, num_layers=4)


def test_symbolic_model_matches_the_numeric_one() -> None:
    cfg = preset("phi-3.5-moe")
    sym = analytic.symbolic_cost_model()
    subs = {sym["d_model"]: cfg.d_model, sym["d_ffn"]: cfg.d_ffn, sym["seq_len"]: cfg.seq_len, sym["batch"]: 2,
            sym["bw"]: 40e9, sym["attn_throughput"]: 150e12, sym["n_mats"]: 3, sym["param_bytes"]: 2}
    t_attn = analytic.attention_time(cfg, 2, 150e12, 1.0)
    assert float(sym["t_attn"].subs(subs)) == pytest.approx(t_attn)
    assert float(sym["psi"].subs(subs)) == analytic.expert_bytes(cfg)
    assert int(sym["overlap_degree"].subs(subs)) == analytic.overlap_degree(t_attn, 40e9, analytic.expert_bytes(cfg))


@pytest.mark.parametrize("t", [1, 3, 8])
def test_min_seq_len_and_batch_are_the_smallest_that_fit(t: int) -> None:
    values = dict(d_model=1024, d_ffn=4096, bw=40e9, attn_throughput=150e12, n_mats=2, param_bytes=2)

    def fits(seq_len: int, batch: int) -> int:
        cfg = preset("gpt-s-moe").replace(d_model=1024, d_ffn=4096, seq_len=seq_len, n_heads=8)
        return analytic.overlap_degree(analytic.attention_time(cfg, batch, 150e12, 1.0), 40e9,
                                       analytic.expert_bytes(cfg))

    seq = analytic.min_seq_len_for(t, batch=4, **values)
    assert fits(seq, 4) >= t and fits(seq - 1, 4) < t
    batch = analytic.min_batch_for(t, seq_len=2048, **values)
    assert fits(2048, batch) >= t and (batch == 1 or fits(2048, batch - 1) < t)


def test_solver_rejects_missing_values() -> None:
    with pytest.raises(ValueError, match="missing"):
        analytic.min_seq_len_for(2, batch=1, d_model=8)
