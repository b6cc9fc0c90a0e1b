"""The simulator's inputs as derived from the paper (docs/simulator.md), and the mechanisms its §5 rows rest on."""

from __future__ import annotations

import pytest

from themis_compile.cost_model import analytic
from themis_compile.cost_model.cluster import get_cluster
from themis_compile.sim import paper, setup as S
from themis_compile.sim.traces import PAPER_CV, model_cv


def _setup(model: str, cluster: str = "A", **kw: object) -> S.SimSetup:
    c = get_cluster(cluster)
    return S.build_setup(S.resolve_model_config(model, c.num_devices, cluster), c, **kw)


def test_attention_efficiency_is_calibrated_once_from_fig12() -> None:
    # Fig. 12's parameter memory implies ~5 replicas per layer for Phi-3.5-MoE on A; t lands there.
    implied = S.fig12_replicas_per_layer()
    assert 4.5 < implied < 6.0
    phi = _setup("phi-3.5-moe")
    assert phi.overlap_degree == round(implied)
    assert 0.05 < S.ATTENTION_EFFICIENCY < 0.5
    # The same efficiency on every model and cluster: T_attn scales with each model's attention FLOPs.
    qwen = _setup("qwen1.5-moe", "B")
    flops = analytic.attention_flops(qwen.model, qwen.batch, S.attention_shape(qwen.model))
    assert qwen.t_attn_s == pytest.approx(flops / (get_cluster("B").peak_flops * S.ATTENTION_EFFICIENCY))


def test_attention_the_model_really_has() -> None:
    ds = S.resolve_model_config("deepseek-v3")
    mla = S.attention_shape(ds)
    assert mla.kind == "mla"
    assert analytic.attention_flops(ds, 1, mla) / analytic.attention_flops(ds, 1) == pytest.approx(1.34, abs=0.01)
    phi = S.resolve_model_config("phi-3.5-moe")
    assert analytic.attention_params(phi, S.attention_shape(phi)) == 4096 * (4096 + 2 * 1024 + 4096)


def test_pipeline_stage_models_have_no_embeddings_or_head() -> None:
    ds, gpt = _setup("deepseek-v3"), _setup("gpt-s-moe")
    assert ds.pipeline_stage and ds.head_s == 0 and ds.embedding_params == 0 and ds.head_params == 0
    assert not gpt.pipeline_stage and gpt.head_s > 0 and gpt.embedding_params > 0
    res = paper.run_config("deepseek-v3", get_cluster("A"), policies=("ep",), iterations=2)
    names = {e["name"] for e in res.policies["ep"].events}
    assert "LM head fwd+bwd" not in names


def test_budget_counts_activations_and_flexmoe_reserve_follows_fig12() -> None:
    small, large = _setup("gpt-l-moe", "B", batch=2), _setup("gpt-l-moe", "B", batch=12)
    assert large.activation_bytes > 5 * small.activation_bytes
    assert small.memory_budget_bytes - large.memory_budget_bytes == pytest.approx(
        large.activation_bytes - small.activation_bytes)
    assert large.materialization_budget < small.materialization_budget
    # Fig. 12: FlexMoE's model states are 3.0x Themis's (1.356x EP's): about 7-8 slots per layer on Phi.
    assert _setup("phi-3.5-moe").replica_slots in (7, 8)


def test_one_skew_for_every_model_std_held_as_the_ep_degree_grows() -> None:
    # Fig. 16a's Std 0.04 over Qwen1.5-MoE's 64 experts read both ways (shares summing to 1 or to k = 4).
    assert PAPER_CV == pytest.approx((64 * 0.04 * 64 * 0.04 / 4) ** 0.5) == pytest.approx(1.28)
    for per_device, top in ((2, "gpt/qwen"), (1, "phi"), (4, "deepseek")):
        assert model_cv(per_device, 32 * per_device, 32) == pytest.approx(PAPER_CV), top
    # Weak scaling (E = 4 per device): the Std of the shares is held, so the CV grows with E.
    assert model_cv(4, 64, 16) == pytest.approx(0.64)
    assert model_cv(4, 256, 64) == pytest.approx(2.56)
    assert model_cv(4, 1024, 256) == model_cv(4, 256, 64)                    # past the paper's 64 GPUs: held
    assert model_cv(None, 64, 16) == PAPER_CV                                # E fixed: no scaling


def test_weak_scaling_widens_themis_lead_as_ep_imbalance_worsens() -> None:
    """§5.4 / Fig. 13b: "baseline systems suffer increasing latency at larger EP degrees due to worsening
    load imbalance, Themis maintains near-constant latency, widening its advantage" (16 -> 64 GPUs)."""
    runs = {n: paper.run_config("deepseek-v3", get_cluster("A", n // 8), policies=("ep", "themis"), iterations=12)
            for n in (16, 64)}
    ep = {n: r.policies["ep"].mean_iteration_s for n, r in runs.items()}
    themis = {n: r.policies["themis"].mean_iteration_s for n, r in runs.items()}
    assert ep[64] > 2.0 * ep[16]
    assert themis[64] / themis[16] < 0.75 * ep[64] / ep[16]
    assert runs[64].speedup_over("ep")["themis"] > 1.5 * runs[16].speedup_over("ep")["themis"]


def test_themis_rm_materializes_more_and_wins_under_a_binding_budget() -> None:
    """§5.2: "Themis-RM's released replicas raise its per-layer materialization budget, and the better
    balance the larger budget admits outweighs the additional sparse collective invocations". Phi-3.5-MoE
    on Cluster A (Fig. 9 / 11) with 1.5 GB per device left for replicas: m < m_rm < t."""
    res = paper.run_config("phi-3.5-moe", get_cluster("A"), policies=("ep", "themis", "themis-rm"),
                           iterations=12, memory_budget_bytes=1.5e9)
    s = res.setup
    assert s.materialization_budget < s.materialization_budget_rm < s.overlap_degree
    themis, rm = res.policies["themis"], res.policies["themis-rm"]
    assert rm.bytes_moved["spag"] > themis.bytes_moved["spag"]              # more replicas per layer
    assert rm.bytes_moved["spag_remat"] > 0
    assert rm.mean_iteration_s < themis.mean_iteration_s < res.policies["ep"].mean_iteration_s
    # The runtime keeps the last layer's replicas: nothing re-gathers it.
    names = {e["name"] for e in rm.events}
    assert f"SpAG remat L{s.num_layers - 2}" in names and f"SpAG remat L{s.num_layers - 1}" not in names
