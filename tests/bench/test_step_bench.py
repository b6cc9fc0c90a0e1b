from __future__ import annotations

from themis_compile.bench import step


def test_step_benchmark_quick_reports_every_policy():
    out = step.main(["--quick"])
    assert set(out["policies"]) == {"ep", "themis", "themis-rm", "uniform"}
    for policy, res in out["policies"].items():
        assert res["step_time_s"] > 0
        assert len(res["memory_bytes_per_rank"]) == 2
    # The skewed router leaves EP imbalanced; Themis materializes replicas and balances it.
    assert out["policies"]["ep"]["imbalance_max_over_mean"] > 1.3
    assert out["policies"]["themis"]["mean_delta_p_per_layer"] > 0
    assert out["policies"]["themis"]["imbalance_max_over_mean"] < out["policies"]["ep"]["imbalance_max_over_mean"]
    assert out["policies"]["themis"]["memory_bytes_per_rank"][0]["replica_buffers_peak"] > 0
    assert "themis_speedup_over_ep" in out["ratios"]
