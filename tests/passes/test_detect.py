"""Detection of MoE layers by structure and tracing: the reference model, HF Mixtral / Qwen3-MoE, and
blocks in other styles; rejected look-alikes with their reasons; explain()."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import themis_compile
from themis_compile.models import build_model
from themis_compile.passes.detect import SEARCHED, find_moe_layers
from themis_compile.passes.explain import explain_moe_layers
from tests.passes import moe_zoo as zoo



def _hf_models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128))
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=128, norm_topk_prob=True))
    return {"mixtral": mixtral, "qwen3_moe": qwen}


@pytest.mark.parametrize("form,expected_form", [("loop", "modulelist"), ("stacked", "stacked")])
def test_reference_model_both_forms(form, expected_form):
    model = build_model("tiny-moe", experts_form=form, shared_expert=True)
    infos, rejected = find_moe_layers(model)
    assert rejected == []
    assert [i.name for i in infos] == ["blocks.0.moe", "blocks.1.moe"]
    for info in infos:
        assert info.module is model.blocks[int(info.name.split(".")[1])].moe
        assert (info.num_experts, info.top_k, info.hidden_size) == (8, 2, 64)
        assert info.experts_form == expected_form and info.experts_attr == "experts"
        assert info.rewrite == "none"          # combine_experts dispatches to a non-ModuleList experts module
        assert info.router_path == "gate" and info.score_fn == "softmax"
        assert "softmax -> top-2" in info.router
        assert info.activation == "swiglu"
        assert info.shared_experts and info.shared_expert_names == ("shared_expert",)
        assert any("aux_loss" in a for a in info.aux_losses)


def test_reference_topk_softmax_routing_and_no_shared_expert():
    model = build_model("tiny-moe", experts_form="stacked", routing="topk_softmax", activation="gelu", top_k=1)
    infos, _ = find_moe_layers(model)
    assert len(infos) == 2
    assert all("top-1 -> softmax" in i.router and i.top_k == 1 for i in infos)
    assert all(i.activation == "gelu" and not i.shared_experts for i in infos)


@pytest.mark.parametrize("which", ["mixtral", "qwen3_moe"])
def test_hf_transformers_blocks(which):
    model = _hf_models()[which]
    infos, rejected = find_moe_layers(model)
    assert rejected == []
    assert [i.name for i in infos] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for info in infos:
        assert (info.num_experts, info.top_k, info.hidden_size) == (4, 2, 32)
        assert info.experts_form == "stacked" and info.rewrite == "none"
        assert info.router_path == "gate.weight" and info.score_fn == "softmax"
        assert info.activation == "silu"
        assert not info.shared_experts


def test_blocks_in_other_styles():
    model = nn.ModuleDict({"old_hf": zoo.OldHFBlock(), "setitem": zoo.SetitemLoopBlock(), "titan": zoo.TitanMoE(),
                           "untraceable": zoo.UntraceableBlock()})
    infos, rejected = find_moe_layers(model)
    assert rejected == []
    by_name = {i.name: i for i in infos}
    assert sorted(by_name) == ["old_hf", "setitem", "titan", "untraceable"]

    old = by_name["old_hf"]
    assert (old.rewrite, old.experts_form, old.num_experts, old.top_k) == ("inline-loop", "modulelist", 4, 2)
    assert old.activation == "silu (gated)"
    assert any("returns output 1" in a for a in old.aux_losses)   # router logits for the auxiliary loss

    setitem = by_name["setitem"]
    assert (setitem.rewrite, setitem.experts_attr, setitem.score_fn) == ("inline-loop", "mlps", "sigmoid")
    assert setitem.shared_expert_names == ("shared",)

    titan = by_name["titan"]
    assert (titan.rewrite, titan.experts_form, titan.router_path) == ("none", "stacked", "router.gate")
    assert titan.score_fn == "sigmoid" and titan.shared_expert_names == ("shared_experts",)
    assert any("tokens_per_expert" in a for a in titan.aux_losses)

    untraceable = by_name["untraceable"]
    assert untraceable.rewrite == "none" and "recorded on a probe" in untraceable.router
    assert untraceable.top_k == 2 and untraceable.router_path == "router.gate"


def test_stored_auxiliary_loss_is_reported():
    infos, _ = find_moe_layers(nn.Sequential(zoo.OldHFBlock(store_aux=True)))
    assert "stores self.aux_loss" in infos[0].aux_losses


@pytest.mark.parametrize("block,reason", [
    (lambda: zoo.OldHFBlock(expert_ffns=[64, 128, 64, 64]), "experts are not identical: expert 1"),
    (lambda: zoo.OldHFBlock(gate_width=6), "router 'gate' scores 6 experts but 'experts' holds 4"),
    (zoo.DenseSoftMoE, "no top-k selection"),
    (zoo.BlockWeightsMoE, "its expert weights are stacked parameters of the block itself (w_in [4, 32, 64]"),
])
def test_look_alikes_are_rejected_with_a_reason(block, reason):
    infos, rejected = find_moe_layers(nn.Sequential(block()))
    assert infos == []
    assert len(rejected) == 1 and rejected[0][0] == "0"
    assert reason in rejected[0][1]


def test_an_untraceable_loop_over_the_hit_experts_is_served_by_capture_and_replay():
    # HF MixtralExperts' own loop (`for e in (counts > 0).nonzero()`) cannot be traced; capture and replay
    # serves it, and since it runs only the experts that receive tokens the layer is marked so.
    infos, rejected = find_moe_layers(nn.Sequential(zoo.CurrentHFLoopBlock()))
    assert rejected == [] and [(i.name, i.rewrite, i.skips_empty_experts) for i in infos] == [("0", "replay", True)]


def test_calls_of_other_shapes_are_found_by_behaviour():
    """torchtitan's sort-based call experts(rows sorted by expert, counts) and gpt-fast's per-slot call
    experts(x, ids) -> [T, K, H]: found from what the experts call does, to be rewritten."""
    from tests.passes import zoo_models

    by_name = {}
    for name, block in (("sorted", zoo.SortedTitanMoE()), ("gpt_fast", zoo_models.GptFastMoE())):
        infos, rejected = find_moe_layers(nn.ModuleDict({name: block}))
        assert rejected == [] and [i.name for i in infos] == [name]
        by_name[name] = infos[0]
    assert (by_name["sorted"].rewrite, by_name["sorted"].top_k, by_name["sorted"].num_experts) == ("sorted-rows", 2, 4)
    assert (by_name["gpt_fast"].rewrite, by_name["gpt_fast"].experts_attr) == ("per-slot", "cond_ffn")
    assert "sigmoid" in by_name["sorted"].router and "topk(k=2)" in by_name["sorted"].router


def test_dense_models_are_neither_found_nor_rejected():
    for model in (zoo.DenseModel(), nn.TransformerEncoderLayer(32, 4, 64)):
        assert find_moe_layers(model) == ([], [])


def test_detection_leaves_the_model_untouched():
    model = nn.Sequential(zoo.OldHFBlock(store_aux=True), zoo.TitanMoE())
    model[1].tokens_per_expert.fill_(3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    aux = model[0].aux_loss
    infos, _ = find_moe_layers(model)
    assert len(infos) == 2
    assert torch.equal(torch.get_rng_state(), rng)
    assert model[0].aux_loss is aux and not hasattr(model[1], "last_load")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert type(model[0]) is zoo.OldHFBlock and type(model[0].experts) is nn.ModuleList


def test_explain_reports_layers_and_rejections():
    model = nn.ModuleDict({"moe": zoo.TitanMoE(), "odd": zoo.OldHFBlock(gate_width=6)})
    text = explain_moe_layers(model)
    assert text.startswith("1 MoE layer(s) found")
    for needle in ("moe:", "'router.gate' [E=4, H=32]: sigmoid -> top-2", "4 (stacked, attribute 'experts'), top-2",
                   "activation:     silu", "shared experts: shared_experts", "1 MoE-like module(s) rejected",
                   "odd: router 'gate' scores 6 experts"):
        assert needle in text, needle
    short = themis_compile.explain(model)
    assert "moe: 4 experts (stacked" in short and "rejected odd: router 'gate' scores 6" in short
    assert SEARCHED in explain_moe_layers(zoo.DenseModel())


def test_a_block_whose_hidden_size_equals_the_expert_count_is_not_its_parents_experts():
    """H == E: the MoE block (router Linear(16 -> 16), stacked [16, 16, 16] experts) has every parameter
    leading with 16, like stacked experts; it is the layer, and its decoder block is no rejected candidate
    (whose warning would say experts stay dense while they are sharded)."""
    import themis_compile
    from themis_compile.models import build_model

    model = build_model("tiny-moe", d_model=16, n_heads=2, d_ffn=16, n_layers=2, num_experts=16, top_k=2,
                        vocab_size=64, seq_len=16, experts_form="stacked")
    text = themis_compile.explain(model)
    assert text.startswith("2 MoE layer(s) found") and "rejected" not in text, text


class _StackedAtForward(nn.Module):
    """ModuleList experts whose weights the forward stacks itself and gathers by id (never calls them)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 16), nn.SiLU(), nn.Linear(16, 32)) for _ in range(4))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = self.gate(x).softmax(-1).topk(2)
        w1 = torch.stack([e[0].weight for e in self.experts])
        w2 = torch.stack([e[2].weight for e in self.experts])
        h = F.silu(torch.einsum("th,tkfh->tkf", x, w1[ids]))
        return (torch.einsum("tkf,tkhf->tkh", h, w2[ids]) * w[..., None]).sum(1).reshape(shape)


def test_experts_read_without_being_called_are_rejected_with_what_to_do():
    found, rejected = find_moe_layers(nn.ModuleDict({"moe": _StackedAtForward()}))
    assert found == [] and [name for name, _ in rejected] == ["moe"]
    why = rejected[0][1]
    assert why.startswith("the forward never calls the 4 experts of 'experts' on the probe"), why
    assert "call each expert as a module on its rows" in why and "stacked [E, ...] in the block itself" in why


class _MLPRouterMoE(nn.Module):
    """A router that is a small MLP (Linear -> tanh -> Linear(E)), the top-k over its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 32)) for _ in range(4))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = torch.topk(self.router(x), 2)
        w = w.softmax(-1)
        out = torch.zeros_like(x)
        for e in range(4):
            t, k = torch.where(ids == e)
            out = out.index_add(0, t, self.experts[e](x[t]) * w[t, k, None])
        return out.reshape(shape)


def test_a_router_mlp_is_read_by_its_last_linear_and_its_first_linears_input():
    from themis_compile.passes.styles import prepare_moe_layers

    torch.manual_seed(0)
    block = _MLPRouterMoE()
    (info,), rejected = find_moe_layers(nn.ModuleDict({"moe": block}))
    assert not rejected
    assert (info.rewrite, info.router_path, info.num_experts, info.top_k, info.hidden_size) == (
        "inline-loop", "router.2", 4, 2, 32)
    reference = copy.deepcopy(block)
    (prepared,) = prepare_moe_layers(nn.ModuleDict({"moe": block}), strict=True)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(block(x), reference(x))


class _SharedBesideParamLists(nn.Module):
    """Routed experts as ParameterLists (found by behaviour, no graph to read) and a shared expert MLP whose
    output the block adds."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 4, bias=False)
        self.w1 = nn.ParameterList(nn.Parameter(torch.randn(16, 32) * 0.1) for _ in range(4))
        self.w2 = nn.ParameterList(nn.Parameter(torch.randn(32, 16) * 0.1) for _ in range(4))
        self.shared = nn.Sequential(nn.Linear(32, 16), nn.SiLU(), nn.Linear(16, 32))
        self.unused = nn.Sequential(nn.Linear(32, 16), nn.SiLU(), nn.Linear(16, 32))   # never called

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = self.shared(x)
        for e in range(4):
            t, k = torch.where(ids == e)
            if t.numel():
                out = out.index_add(0, t, F.linear(F.silu(F.linear(x[t], self.w1[e])), self.w2[e]) * w[t, k, None])
        return out.reshape(shape)


def test_shared_experts_are_reported_where_no_graph_shows_them():
    (info,), rejected = find_moe_layers(nn.ModuleDict({"moe": _SharedBesideParamLists()}))
    assert not rejected and info.rewrite == "param-lists"
    assert info.shared_expert_names == ("shared",) and info.shared_experts
    assert "    shared experts: shared\n" in explain_moe_layers(nn.ModuleDict({"moe": _SharedBesideParamLists()}))
