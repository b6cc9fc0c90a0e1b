"""The cluster simulator: invariants of the cost model, outputs (chrome trace, plots, JSON) and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from themis_compile import sim
from themis_compile.sim import cli
from themis_compile.cost_model.cluster import Cluster, get_cluster, load_cluster
from themis_compile.sim.traces import synthetic_trace
from themis_compile.models.presets import preset

ALL = ("ep", "uniform", "fastermoe", "smartmoe", "flexmoe", "eplb", "themis", "themis-rm")


def _cluster(**kw: float) -> Cluster:
    return get_cluster("A").replace(name="test", num_nodes=2, devices_per_node=4, **kw)


def _model():
    return preset("gpt-s-moe", devices=8).replace(n_layers=2)     # E = 16 experts on 8 devices


def _trace(iterations: int = 12, seed: int = 0):
    cfg = _model()
    return synthetic_trace(cfg.n_layers, cfg.num_experts, 8, 2 * cfg.seq_len, cfg.top_k, iterations,
                           cv=0.8, seed=seed)


@pytest.fixture(scope="module")
def result() -> sim.SimResult:
    setup = sim.build_setup(_model(), _cluster(), batch=2, overlap_degree=3, reshard_interval=5)
    return sim.simulate(setup, _trace(), ALL, warmup=4)


def test_uniform_is_the_floor_of_imbalance(result: sim.SimResult) -> None:
    uniform = result.policies["uniform"]
    for name, res in result.policies.items():
        assert uniform.straggler_s <= res.straggler_s + 1e-12, name
    # Without replicas nothing beats balanced routing inside the all-to-all.
    for name in ("ep", "smartmoe"):
        assert uniform.breakdown_s["A2A"] <= result.policies[name].breakdown_s["A2A"] + 1e-12, name
    assert result.policies["ep"].straggler_s > 0


def test_breakdown_adds_up_and_policies_are_charged(result: sim.SimResult) -> None:
    for name, res in result.policies.items():
        assert sum(res.breakdown_s.values()) == pytest.approx(res.mean_iteration_s, rel=1e-9), name
        assert res.memory_bytes["Total"] == pytest.approx(sum(res.memory_bytes[k] for k in ("Param", "Grad", "Opt")))
    assert result.policies["fastermoe"].bytes_moved["broadcast"] > 0
    assert result.policies["flexmoe"].bytes_moved["allreduce"] > 0
    assert result.policies["themis"].bytes_moved["spag"] > 0
    assert result.policies["themis-rm"].bytes_moved["spag_remat"] > 0
    mem = {n: r.memory_bytes for n, r in result.policies.items()}
    assert mem["ep"]["Total"] < mem["themis-rm"]["Total"] <= mem["themis"]["Total"]
    assert mem["flexmoe"]["Opt"] > mem["ep"]["Opt"] == mem["themis"]["Opt"]   # replicas carry no optimizer state
    speed = result.speedup_over("ep")
    assert speed["ep"] == 1.0 and speed["themis"] > 1.0


def test_themis_with_zero_budget_equals_ep() -> None:
    setup = sim.build_setup(_model(), _cluster(), batch=2, overlap_degree=0, materialization_budget=0,
                            reshard_interval=0)
    res = sim.simulate(setup, _trace(8), ("ep", "themis"))
    ep, themis = res.policies["ep"], res.policies["themis"]
    assert themis.iteration_s == ep.iteration_s
    assert themis.breakdown_s == ep.breakdown_s
    assert themis.memory_bytes == ep.memory_bytes


def test_doubling_bandwidth_never_slows_anything() -> None:
    trace = _trace(10, seed=1)
    kw = dict(batch=2, overlap_degree=3, materialization_budget=4, memory_budget_bytes=4e9, reshard_interval=5)
    slow = sim.simulate(sim.build_setup(_model(), _cluster(), **kw), trace, ALL, warmup=3)
    fast = sim.simulate(sim.build_setup(_model(), _cluster().scaled_bandwidth(2.0), **kw), trace, ALL, warmup=3)
    for name in ALL:
        assert fast.policies[name].mean_iteration_s <= slow.policies[name].mean_iteration_s + 1e-12, name
        for t_fast, t_slow in zip(fast.policies[name].iteration_s, slow.policies[name].iteration_s):
            assert t_fast <= t_slow + 1e-12, name


def test_chrome_trace_is_valid_json_with_the_expected_events(result: sim.SimResult, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(sim.chrome_trace(result)))
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == sorted(ALL)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 and {"name", "cat", "pid", "tid"} <= set(e) for e in spans)
    by_policy: dict[str, set[str]] = {}
    for e in spans:
        by_policy.setdefault(procs[e["pid"]], set()).add(e["name"])
    for name in ALL:
        names = by_policy[name]
        assert {"attention fwd L0", "A2A dispatch L0", "experts fwd L1", "attention bwd L0",
                "optimizer step", "AllReduce embeddings"} <= names, name
    assert "SpAG L0" in by_policy["themis"] and "SpRS L1" in by_policy["themis"]
    assert "SpAG remat L0" in by_policy["themis-rm"]
    assert any(n.startswith("shadow broadcast") for n in by_policy["fastermoe"])
    assert {e["cat"] for e in spans} <= set(sim.CATEGORIES)
    # Compute-stream spans of one policy tile the iteration without overlap.
    ep_pid = next(p for p, n in procs.items() if n == "ep")
    compute = sorted((e["ts"], e["dur"]) for e in spans if e["pid"] == ep_pid and e["tid"] == 0)
    assert all(a[0] + a[1] <= b[0] + 1e-3 for a, b in zip(compute, compute[1:]))


def test_plots_are_written(result: sim.SimResult, tmp_path: Path) -> None:
    paths = sim.write_plots(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["throughput.png", "breakdown.png", "memory.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_cli_json_and_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "gpt-s-moe-tiny", "--cluster", "B", "--nodes", "2", "--devices-per-node", "2",
            "--iterations", "4", "--no-progress"]
    cli.main(base + ["--policy", "themis,fastermoe", "--json", "--trace-out", str(tmp_path / "t.json"),
                     "--plot-dir", str(tmp_path / "p"), "--write-trace", str(tmp_path / "r.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"ep", "themis", "fastermoe"}        # EP is always the reference
    assert out["throughput_vs_ep"]["ep"] == 1.0 and out["setup"]["cluster"]["num_devices"] == 4
    assert len(out["plots"]) == 3 and json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # The saved routing trace replays to the same numbers.
    cli.main(base + ["--policy", "themis,fastermoe", "--json", "--trace", str(tmp_path / "r.jsonl")])
    again = json.loads(capsys.readouterr().out)
    assert again["throughput_vs_ep"] == out["throughput_vs_ep"]
    cli.main(base + ["--policy", "ep,uniform"])
    text = capsys.readouterr().out
    assert "throughput relative to EP" in text and "model-state memory" in text
    with pytest.raises(SystemExit, match="unknown cluster"):
        cli.main(["--cluster", "C", "--no-progress"])


def test_custom_cluster_files(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('name = "mine"\ndevices_per_node = 4\nnum_nodes = 2\ninter_node_bw = 25e9\n')
    cluster = load_cluster(toml)
    assert (cluster.name, cluster.num_devices, cluster.inter_node_bw) == ("mine", 8, 25e9)
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"cluster": {"devices_per_node": 2, "peak_flops": 1e15}}))
    assert get_cluster(str(js), num_nodes=3).num_devices == 6
    js.write_text(json.dumps({"devices_per_node": 2, "nvlink": 1}))
    with pytest.raises(ValueError, match="unknown field"):
        load_cluster(js)
    topo = get_cluster("B").topology()
    assert topo.num_devices == 32 and topo.inter_node_bw == pytest.approx(400e9 * 0.8)


def test_trace_must_match_the_model() -> None:
    setup = sim.build_setup(_model(), _cluster(), batch=2)
    wrong = synthetic_trace(2, 8, 8, 128, 2, 3)
    with pytest.raises(ValueError, match="experts"):
        sim.simulate(setup, wrong, ("ep",))
    with pytest.raises(ValueError, match="fewer than"):
        sim.simulate(setup, _trace(3), ("ep",), iterations=5)


def test_paper_report_rows() -> None:
    report = sim.paper_report(iterations=3, quick=True, max_layers=2)
    metrics = [r["metric"] for r in report["rows"]]
    assert "Themis vs EP, average (cluster A)" in metrics and "memory: Themis-RM over EP" in metrics
    assert "plan time per MoE layer, median (us)" in metrics and len(metrics) == 15
    assert set(report["fig9"]["B"]) == {"gpt-s-moe", "phi-3.5-moe"}
    for r in report["rows"]:
        assert np.isfinite(r["ours"]) and np.isfinite(r["ours_over_paper"])
        assert r["within"] == (abs(r["rel_diff"]) <= 0.2)
        assert bool(r["explanation"]) == (not r["within"])
    text = sim.format_paper_report(report)
    assert "modeling assumption" in text or all(r["within"] for r in report["rows"])
    assert "ours/paper" in text and "rows within" in text


def test_the_engine_never_branches_on_policy_names() -> None:
    """Each policy charges its own costs (sim/policies.py); the engine and the reports only ask."""
    import ast
    import inspect

    from themis_compile.planner import POLICY_NAMES
    from themis_compile.sim import engine, policies

    literals = {node.value for node in ast.walk(ast.parse(inspect.getsource(engine)))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not literals & set(POLICY_NAMES)
    assert set(policies.CHARGES) == set(POLICY_NAMES)
    setup = sim.build_setup(_model(), _cluster(), batch=2, overlap_degree=3)
    for name in POLICY_NAMES:
        charges = sim.charges_for(name, setup)
        assert charges.policy.name == name
    with pytest.raises(ValueError, match="unknown policy"):
        sim.charges_for("nope", setup)


def test_paper_rows_compare_ranges_and_costs():
    """A range matches inside it; a cost the paper reports (the planning time) also below it."""
    from themis_compile.sim.paper import _rel

    assert _rel((24.0, 51.0), 30.0) == 0.0
    assert _rel((24.0, 51.0), 12.0) == pytest.approx(-0.5)
    assert _rel((24.0, 51.0), 12.0, ceiling=True) == 0.0
    assert _rel((24.0, 51.0), 61.2, ceiling=True) == pytest.approx(0.2)
    assert _rel(2.0, 2.5) == pytest.approx(0.25)


def test_planner_bench_devices_uses_the_simulators_budgets():
    """`bench planner --devices` times DeepSeek-V3 with the t and m this simulator derives (Cluster A)."""
    from themis_compile.bench import planner

    cfg = sim.resolve_model_config("deepseek-v3", devices=32, cluster="A")
    setup = sim.build_setup(cfg, get_cluster("A"))
    t, m = setup.overlap_degree, setup.materialization_budget
    assert planner.simulator_budgets(32) == [("simulator", t, m), ("binding_budget", t, min(planner.BINDING_BUDGET, t))]


def test_weak_scaling_past_the_papers_scale(capsys):
    """`simulate --weak-scaling`: DeepSeek-V3 at whole nodes of Cluster A, Themis vs EP and FasterMoE;
    sizes past the memory limit are refused (tests/sim/test_scale.py)."""
    from themis_compile.sim.paper import weak_scaling

    rows = weak_scaling([16, 32], iterations=3)
    assert [(r["devices"], r["num_experts"]) for r in rows] == [(16, 64), (32, 128)]
    for r in rows:
        assert r["themis_vs_ep"] > 1.0 and r["themis_vs_fastermoe"] > 0
        assert set(r["mean_iteration_s"]) == {"ep", "fastermoe", "themis"}
    with pytest.raises(ValueError, match="bench planner --devices 65536"):
        weak_scaling([65536])
    with pytest.raises(ValueError, match="whole nodes"):
        weak_scaling([12])
    cli.main(["--weak-scaling", "16", "--iterations", "2", "--json", "--no-progress"])
    assert json.loads(capsys.readouterr().out)[0]["devices"] == 16
    with pytest.raises(SystemExit, match="GiB"):
        cli.main(["--weak-scaling", "16,65536", "--no-progress"])


def test_themis_resharding_is_amortized_over_its_interval() -> None:
    """§5.3: re-sharding latency amortized over its interval. The one Alg. 2 re-sharding of a short run
    (in the warm-up) is paid by every measured iteration, a 1/interval share of it."""
    trace = _trace(10)
    rearr = {}
    for interval in (50, 100):
        setup = sim.build_setup(_model(), _cluster(), batch=2, overlap_degree=3, reshard_interval=interval)
        res = sim.simulate(setup, trace, ("ep", "themis"), warmup=4)
        rearr[interval] = res.policies["themis"].breakdown_s["Rearr"]
        assert res.policies["ep"].breakdown_s["Rearr"] == 0.0
    assert rearr[100] > 0
    assert rearr[50] == pytest.approx(2.0 * rearr[100], rel=1e-9)
