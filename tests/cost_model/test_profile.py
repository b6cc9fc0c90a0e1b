"""Profiled cost-model inputs: T_attn hooks, bandwidth microbenchmark, cache, overrides, budgets, traces."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from themis_compile.config import ThemisConfig
from themis_compile.cost_model import profile as P
from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig, lm_loss
from themis_compile.planner.topology import Topology
from themis_compile.testing import run_multirank


def _model(seq_len: int = 8) -> GPTMoE:
    torch.manual_seed(0)
    return GPTMoE(MoEModelConfig(d_model=16, n_heads=2, n_layers=2, d_ffn=16, num_experts=4, top_k=2,
                                 seq_len=seq_len, vocab_size=16, experts_form="stacked"))


def _train(model, steps: int, seq_len: int = 8) -> None:
    tokens = torch.randint(0, 16, (2, seq_len))
    for _ in range(steps):
        lm_loss(model(tokens), tokens).backward()


def test_attention_profiler_medians_windows_and_removal():
    model = _model()
    done = []
    moe = {f"blocks.{i}.moe": b.moe for i, b in enumerate(model.blocks)}
    prof = P.AttentionProfiler(model, moe, warmup_steps=1, measure_steps=2, on_done=done.append)
    _train(model, 3)
    with torch.no_grad():            # evaluation forwards do not count as steps
        model(torch.randint(0, 16, (2, 8)))
    assert prof.profile is None
    _train(model, 1)                 # the 4th step's first attention closes the profile
    profile = prof.profile
    assert done == [profile] and profile.source == "measured"
    assert set(profile.attention) == {"blocks.0.attn", "blocks.1.attn"}
    for timing in profile.attention.values():
        assert timing.forward_s > 0 and timing.backward_s > 0 and timing.samples == 2
        assert timing.input_shape == (2, 8, 16)
    assert profile.preceding_attention == {"blocks.0.moe": "blocks.0.attn", "blocks.1.moe": "blocks.1.attn"}
    assert profile.t_attn("blocks.1.moe") == profile.attention["blocks.1.attn"].forward_s
    assert all(not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def test_profiler_failure_never_blocks_training(monkeypatch, caplog):
    model = _model()
    prof = P.AttentionProfiler(model, warmup_steps=0, measure_steps=2)

    def boom(_):
        raise RuntimeError("timer broke")

    monkeypatch.setattr(P, "_sync", boom)
    with caplog.at_level(logging.WARNING):
        _train(model, 2)
    assert prof.failed is not None and "timer broke" in prof.failed and prof.profile is None
    assert "falls back to defaults" in caplog.text
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_cache_roundtrip_keys_and_unreadable_file(tmp_path, caplog):
    model = _model()
    key = P.profile_key(model, 2, (2, 8, 16))
    assert key != P.profile_key(model, 4, (2, 8, 16))            # world size
    assert key != P.profile_key(model, 2, (2, 16, 16))           # shapes
    assert key != P.profile_key(model, 2, (2, 8, 16), hardware="cuda:H100")
    assert key != P.profile_key(_model(seq_len=8).half(), 2, (2, 8, 16))   # dtypes
    cache = P.ProfileCache(tmp_path / "p.json")
    assert cache.get(key) is None
    prof = P.Profile(attention={"blocks.0.attn": P.AttentionTiming(1e-3, 2e-3, (2, 8, 16), 3)},
                     preceding_attention={"blocks.0.moe": "blocks.0.attn"}, intra_node_bw=5e9, key=key)
    cache.put(prof)
    back = cache.get(key)
    assert back.source == "cache" and back.attention == prof.attention and back.intra_node_bw == 5e9
    (tmp_path / "p.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert cache.get(key) is None
    assert "unreadable" in caplog.text


def test_override_from_dict_and_file_and_bad_input(tmp_path):
    prof = P.load_override({"t_attn_s": 0.002, "inter_node_bw": 1e9})
    assert prof.source == "override" and prof.t_attn("any.layer") == 0.002 and prof.inter_node_bw == 1e9
    path = tmp_path / "o.json"
    path.write_text(json.dumps({"attention": {"a": {"forward_s": 0.5, "backward_s": 1.0}},
                                "preceding_attention": {"moe": "a"}}))
    assert P.load_override(path).t_attn("moe") == 0.5
    for bad in ({"t_attn_s": -1}, {"intra_node_bw": 0}, {"bogus": 1}):
        with pytest.raises(ValueError):
            P.load_override(bad)
    with pytest.raises(ValueError, match="cannot read"):
        P.load_override(tmp_path / "missing.json")
    # the override is applied on top of the cache
    model = _model()
    cache = P.ProfileCache(tmp_path / "c.json")
    cache.put(P.Profile(attention={"a": P.AttentionTiming(1.0, None)}, intra_node_bw=3e9,
                        key=P.profile_key(model, 1)))
    merged = P.resolve_profile(model, cache=cache, override={"intra_node_bw": 7e9})
    assert merged.intra_node_bw == 7e9 and merged.attention["a"].forward_s == 1.0


def test_budgets_formula_defaults_and_config(caplog):
    psi = 1 << 20
    prof = P.load_override({"t_attn_s": 0.01, "intra_node_bw": 1e9, "inter_node_bw": 1e8})
    cfg = ThemisConfig(memory_budget=64 * psi)
    b = P.budgets(prof, {"l0": psi, "l1": psi}, config=cfg)
    assert b["l0"].overlap_degree == math.floor(0.01 * 1e9 / psi)        # t = floor(T_attn * bw / Psi)
    assert b["l0"].bw == 1e9 and b["l0"].source == "override"
    # no re-materialization: 2 layers hold replicas at once, each replica slot costs 2 Psi + grad Psi
    assert b["l0"].materialization_budget == (64 * psi) // (2 * psi + psi)
    rm = P.budgets(prof, {"l0": psi, "l1": psi}, config=cfg.replace(policy="themis-rm"))
    assert rm["l0"].materialization_budget == (64 * psi) // (psi + psi)   # spans all layers (§4.2)
    two_nodes = P.budgets(prof, {"l0": psi}, config=cfg, topology=Topology.uniform(2, 2))
    assert two_nodes["l0"].bw == 1e8 and two_nodes["l0"].overlap_degree == math.floor(0.01 * 1e8 / psi)
    fixed = P.budgets(prof, {"l0": psi}, config=cfg.replace(overlap_degree=3, materialization_budget=2))
    assert (fixed["l0"].overlap_degree, fixed["l0"].materialization_budget, fixed["l0"].source) == (3, 2, "config")
    with caplog.at_level(logging.WARNING):
        d = P.budgets(None, {"l0": psi}, config=cfg)
    assert d["l0"].overlap_degree == P.DEFAULT_OVERLAP_DEGREE and d["l0"].source == "default"
    assert "conservative defaults" in caplog.text

    class Layer:
        overlap_degree = 0
        materialization_budget = 0

    layer = Layer()
    assert P.apply_budgets({"l0": layer, "x": object()}, b) == ["l0"]
    assert layer.overlap_degree == b["l0"].overlap_degree


def _bandwidth(rank, world_size, devices_per_node):
    topo = Topology.from_env(world_size, devices_per_node)
    return P.measure_bandwidth(topology=topo, nbytes=1 << 16, iters=2)


def test_measure_bandwidth_two_ranks_intra_and_inter():
    intra = run_multirank(_bandwidth, 2, args=(2,), devices_per_node=2)
    inter = run_multirank(_bandwidth, 2, args=(1,), devices_per_node=1)
    assert set(intra[0]) == {"intra"} and intra[0] == intra[1] and intra[0]["intra"] > 0
    assert set(inter[0]) == {"inter"} and inter[0] == inter[1] and inter[0]["inter"] > 0
    assert P.measure_bandwidth() == {}        # no process group: nothing to measure


def test_chrome_trace_has_attention_ranges(tmp_path):
    model = _model()
    handles = P.annotate_attention(model)
    path = P.export_chrome_trace(lambda: _train(model, 1), tmp_path / "trace.json")
    text = path.read_text()
    assert text.count(P.ATTENTION_RANGE) >= 2
    for h in handles:
        h.remove()
    assert P.hardware_id().startswith(("cpu:", "cuda:"))
