"""The simulator at scale: sparse plans charge what the dense [E, D, D] plans did, sizes past the memory
limit are refused with the size and the limit, and 1,024+ devices run (docs/simulator.md, "Scale")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from themis_compile import sim
from themis_compile.cost_model.cluster import get_cluster
from themis_compile.models.presets import preset
from themis_compile.planner import baselines, reference
from themis_compile.planner.cost import all_to_all_time
from themis_compile.planner.dispatch import DispatchTraffic
from themis_compile.sim import cli, engine, paper
from themis_compile.sim import setup as sim_setup
from themis_compile.sim.costs import LayerCost
from themis_compile.sim.traces import synthetic_trace

ALL = ("ep", "uniform", "fastermoe", "smartmoe", "flexmoe", "eplb", "themis", "themis-rm")


def _dense_traffic(placement, tokens_ED, topology, links=None, *, tokens_checked=False):
    """The readable reference's dense plan, summed: what the simulator charged before its plans were sparse."""
    return DispatchTraffic.from_plan(reference.topology_aware_dispatch(placement, tokens_ED, topology),
                                     topology if links is None else links)


def _dense_layer_cost(coster, charges, layer, step, predicted_E):
    """The engine's per-layer charge as it was on dense plans: every number from R[e, d, d2]."""
    s, R_EDD = coster.setup, step.R
    lc = LayerCost()
    lc.a2a_s = all_to_all_time(R_EDD, s.token_bytes, coster.topo) + s.cluster.collective_latency_s
    flow_DD = R_EDD.sum(axis=0)
    np.fill_diagonal(flow_DD, 0)
    assert step.bytes_moved["a2a"] == int(round(int(flow_DD.sum()) * s.token_bytes))
    assert step.bytes_moved["a2a_inter"] == int(round(int(flow_DD[~coster.topo.same_node].sum()) * s.token_bytes))
    lc.a2a_bytes, lc.a2a_inter_bytes = step.bytes_moved["a2a"], step.bytes_moved["a2a_inter"]
    load_D = R_EDD.sum(axis=(0, 1))
    lc.comp_mean_s = float(load_D.mean()) * s.time_per_token_s
    lc.comp_max_s = float(load_D.max()) * s.time_per_token_s
    charges.charge(coster, layer, step, predicted_E, lc)
    return lc


def _numbers(res: sim.SimResult) -> dict:
    out = res.as_dict()
    out.pop("wall_s")
    for p in out["policies"].values():
        p.pop("plan_us_median")                  # wall time of Alg. 1 on this machine
    return json.loads(json.dumps(out, default=float))


@pytest.mark.parametrize("model,epd", [("gpt-s-moe", 2), ("deepseek-v3", 4)])
def test_sparse_simulation_equals_the_dense_one(monkeypatch, model, epd):
    """2 nodes x 4 devices, every policy: the sparse totals give the dense plans' results bit for bit."""
    cluster = get_cluster("A").replace(name="test", num_nodes=2, devices_per_node=4)
    cfg = preset(model, devices=8).replace(n_layers=2)
    setup = sim.build_setup(cfg, cluster, batch=1, overlap_degree=3, reshard_interval=5)

    def run():
        trace = synthetic_trace(2, cfg.num_experts, 8, setup.tokens_per_device, cfg.top_k, 10, cv=1.5, seed=1)
        return _numbers(sim.simulate(setup, trace, ALL, warmup=4))

    sparse = run()
    with monkeypatch.context() as m:
        m.setattr(baselines, "dispatch_traffic", _dense_traffic)
        m.setattr(engine, "_layer_cost", _dense_layer_cost)
        dense = run()
    assert sparse == dense
    assert sparse["policies"]["themis"]["mean_iteration_s"] < sparse["policies"]["ep"]["mean_iteration_s"]


def test_a_size_past_the_memory_limit_is_refused_with_the_size_and_the_limit(monkeypatch):
    limit = sim_setup.SIM_BASE_BYTES + 2 ** 20          # 16 devices fit, 256 do not
    monkeypatch.setattr(sim_setup, "MAX_SIM_BYTES", limit)
    assert sim_setup.simulation_bytes(4 * 16, 16, 2) < limit < sim_setup.simulation_bytes(4 * 256, 256, 2)
    with pytest.raises(ValueError, match=r"256 devices x 1024 experts x 2 MoE layers .* GiB .*limit 1\.0 GiB"):
        sim.build_setup(preset("deepseek-v3", devices=256), get_cluster("A", 32))
    with pytest.raises(SystemExit, match=r"simulate: 256 devices x 1024 experts .*--max-memory-gb"):
        cli.main(["--model", "deepseek-v3", "--nodes", "32", "--policy", "themis,ep", "--no-progress"])
    # Weak scaling checks every size before running the first.
    with pytest.raises(ValueError, match=r"256 devices x 1024 experts"):
        paper.weak_scaling([16, 256], iterations=2)
    with pytest.raises(SystemExit, match=r"--weak-scaling: 256 devices x 512 experts x 12 MoE layers \(qwen1.5-moe\)"):
        cli.main(["--weak-scaling", "16,256", "--model", "qwen1.5-moe", "--no-progress"])
    # --max-memory-gb raises the limit.
    cli.main(["--weak-scaling", "16", "--iterations", "2", "--json", "--no-progress", "--max-memory-gb", "64"])


def test_deepseek_v3_at_scale_runs_themis_and_ep(capsys):
    """`simulate --model deepseek-v3 --policy themis,ep` at 32 x 8 devices (the 128 x 8 run is the same
    code at 4x the experts and devices; docs/simulator.md times it)."""
    cli.main(["--model", "deepseek-v3", "--nodes", "32", "--devices-per-node", "8", "--policy", "themis,ep",
              "--iterations", "3", "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert out["setup"]["cluster"]["num_nodes"] == 32 and out["setup"]["model"] == "deepseek-v3"
    assert out["throughput_vs_ep"]["themis"] > 1.0


def test_weak_scaling_takes_the_model(capsys):
    rows = paper.weak_scaling([16], iterations=2, model="qwen1.5-moe")
    assert rows[0]["model"] == "qwen1.5-moe" and rows[0]["num_experts"] == 32 and rows[0]["num_layers"] == 12
    assert rows[0]["wall_s"] > 0 and rows[0]["cpu_s"] > 0 and rows[0]["peak_rss_bytes"] > 0
    assert "qwen1.5-moe" in paper.format_weak_scaling(rows)
