"""MoE layers whose experts share parameters (tied weights, as HF DiffusionGemma's encoder and decoder
layers) are not sharded: a sharded layer holds its own copy of its experts, so tied experts would train
apart. Detection rejects every layer of a tie with the reason; the others are found as before."""

from __future__ import annotations

import pytest

import themis_compile
from themis_compile.models import build_model
from themis_compile.passes.detect import find_moe_layers


@pytest.mark.parametrize("tie", ["module", "parameter"])
def test_layers_with_tied_experts_are_rejected_naming_the_other(tie):
    model = build_model("tiny-moe", experts_form="stacked", n_layers=3)
    first, second = model.blocks[0].moe, model.blocks[2].moe
    if tie == "module":
        second.experts = first.experts
    else:    # one tensor of the experts tied, the others the layer's own
        name, param = next(iter(first.experts.named_parameters()))
        setattr(second.experts, name, param)
    infos, rejected = find_moe_layers(model)
    assert [i.name for i in infos] == ["blocks.1.moe"], rejected
    reasons = dict(rejected)
    assert sorted(reasons) == ["blocks.0.moe", "blocks.2.moe"], rejected
    assert "share parameters with those of MoE layer 'blocks.2.moe'" in reasons["blocks.0.moe"]
    assert "share parameters with those of MoE layer 'blocks.0.moe'" in reasons["blocks.2.moe"]
    assert "tied" in themis_compile.explain(model).split("rejected", 1)[1]


def test_untied_layers_are_all_found():
    infos, rejected = find_moe_layers(build_model("tiny-moe", experts_form="stacked", n_layers=3))
    assert [i.name for i in infos] == ["blocks.0.moe", "blocks.1.moe", "blocks.2.moe"] and not rejected
