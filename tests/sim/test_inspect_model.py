"""`themis-compile inspect`: per-layer cost model, heat-map PNG, JSON, symbolic forms, profiles, factories."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from themis_compile.cost_model import analytic
from themis_compile.sim import inspect_model as insp
from themis_compile.models.gpt_moe import MoEModelConfig

TINY = ["--cluster", "A", "--nodes", "2", "--devices-per-node", "2"]


def tiny_config() -> MoEModelConfig:
    """A factory for ``module:factory`` loading (used by the test below)."""
    return MoEModelConfig(name="factory-moe", d_model=256, d_ffn=512, n_layers=3, num_experts=8, top_k=2,
                          seq_len=512, n_heads=4)


def tiny_module():
    from themis_compile.models import GPTMoE

    return GPTMoE(MoEModelConfig(d_model=32, d_ffn=64, n_layers=2, num_experts=4, top_k=2, seq_len=32))


def test_json_report_per_layer(capsys: pytest.CaptureFixture[str]) -> None:
    insp.main(["phi-3.5-moe", *TINY, "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_experts"] == 4 and len(rep["layers"]) == 4          # 1 expert per GPU, 4 GPUs, 4 layers
    row = rep["layers"][0]
    assert row["psi_bytes"] == 3 * 4096 * 6400 * 2 and row["t_attn_source"] == "modeled"
    assert row["overlap_degree"] == analytic.overlap_degree(row["t_attn_s"], row["bw"], row["psi_bytes"])
    assert row["spag_exposed_s"] == pytest.approx(max(0.0, row["spag_s"] - row["t_attn_s"]))
    assert row["materialization_budget_rm"] >= row["materialization_budget"]
    plan = rep["sample_plan"]
    assert plan["added_replicas"] > 0 and plan["spag_bytes"] == plan["added_replicas"] * row["psi_bytes"]


def test_profile_overrides_t_attn_and_bw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"t_attn_fwd_s": {"1": 0.05}, "bw_inter": 10e9}))
    insp.main(["phi-3.5-moe", *TINY, "--json", "--profile", str(prof)])
    rows = json.loads(capsys.readouterr().out)["layers"]
    assert rows[1]["t_attn_s"] == 0.05 and rows[1]["t_attn_source"] == "profiled"
    assert rows[0]["t_attn_source"] == "modeled" and rows[0]["bw"] == 10e9
    assert rows[1]["overlap_degree"] == math.floor(0.05 * 10e9 / rows[1]["psi_bytes"])
    with pytest.raises(SystemExit, match="does not exist"):
        insp.main(["phi-3.5-moe", "--profile", str(tmp_path / "missing.json")])


def test_symbolic_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "heat.png"
    insp.main(["gpt-s-moe", *TINY, "--symbolic", "--t", "3", "--png", str(png)])
    out = capsys.readouterr().out
    assert "T_attn = (8*batch*d_model**2*seq_len + 4*batch*d_model*seq_len**2)/attn_throughput" in out
    assert "3 experts fit the window from seq_len >=" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_factories(capsys: pytest.CaptureFixture[str]) -> None:
    insp.main([f"{__name__}:tiny_config", *TINY, "--json", "--batch", "2"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == "factory-moe" and len(rep["layers"]) == 3
    assert rep["layers"][0]["psi_bytes"] == 3 * 256 * 512 * 2
    insp.main([f"{__name__}:tiny_module", *TINY, "--json"])        # a model with a .config attribute
    assert json.loads(capsys.readouterr().out)["num_experts"] == 4
    with pytest.raises(SystemExit, match="cannot load model factory"):
        insp.main(["no_such_module_xyz:f", *TINY])
    with pytest.raises(SystemExit, match="unknown model preset"):
        insp.main(["gpt-xl-moe", *TINY])
