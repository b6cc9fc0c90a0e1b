"""The profiled cost model's records: profile keys, cache, overrides and the budgets formula (the
measurements themselves: tests/runtime/test_profiling.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from themis_compile.config import ThemisConfig
from themis_compile.cost_model import profile as P
from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig
from themis_compile.planner.topology import Topology


def _model(seq_len: int = 8) -> GPTMoE:
    torch.manual_seed(0)
    return GPTMoE(MoEModelConfig(d_model=16, n_heads=2, n_layers=2, d_ffn=16, num_experts=4, top_k=2,
                                 seq_len=seq_len, vocab_size=16, experts_form="stacked"))


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


def test_hardware_id_names_the_device_kind():
    assert P.hardware_id().startswith(("cpu:", "cuda:"))
