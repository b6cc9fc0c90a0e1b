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


def test_planner_bench_devices(capsys):
    """``--devices``: the per-layer path on a rank at given sizes, DeepSeek-V3-like (E = 4 per device),
    with the simulator's (t, m) and with a binding budget."""
    result = planner.main(["--devices", "16,32", "--plans", "2", "--clock", "thread", "--budget", "6,6",
                           "--budget", "6,2"])
    assert '"benchmark": "planner_devices"' in capsys.readouterr().out
    assert result["clock"] == "thread"
    sizes = result["sizes"]
    assert [(s["devices"], s["overlap_degree"], s["materialization_budget"]) for s in sizes] == [
        (16, 6, 6), (16, 6, 2), (32, 6, 6), (32, 6, 2)]
    for s in sizes:
        assert s["num_experts"] == 4 * s["devices"] and s["nodes"] == s["devices"] // 8
        for suffix in ("", "_sparse"):
            assert s["per_layer_on_a_rank" + suffix]["median_us"] >= s["alg1" + suffix]["min_us"] > 0
            assert isinstance(s["target_met" + suffix], bool)


def test_planner_bench_devices_rejects_bad_sizes(capsys):
    import pytest

    for bad in ("", "12,x", "-8"):
        with pytest.raises(SystemExit):
            planner.main(["--devices", bad])
    for bad in ("6", "6,x", "-1,2"):
        with pytest.raises(SystemExit):
            planner.main(["--devices", "16", "--budget", bad])
    with pytest.raises(ValueError, match="multiple of 8"):
        planner.main(["--devices", "12", "--plans", "2", "--budget", "2,1"])
