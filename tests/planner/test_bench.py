"""Smoke test of `python -m themis_compile.bench planner --quick` (numbers are reported, not asserted)."""

from __future__ import annotations

from themis_compile.bench import planner


def test_planner_bench_quick(capsys):
    result = planner.main(["--quick"])
    assert '"benchmark": "planner"' in capsys.readouterr().out
    assert [s["num_experts"] for s in result["setups"]] == [64, 128]
    for setup in result["setups"]:
        assert setup["alg1_plus_alg3"]["median_us"] > 0
        assert setup["max_over_mean_device_load"]["themis_alg1"] < setup["max_over_mean_device_load"]["ep"]
    assert result["alg2"]["num_layers"] == 24
    assert set(result["target_met"]) == {"qwen1.5-moe", "deepseek-v3"}
    assert all(set(v) == {"per_layer_on_a_rank", "full_plan"} for v in result["target_met"].values())
