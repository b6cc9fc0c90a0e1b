"""The rewrite of inline expert loops into one experts(x, ids, weights) call: numerics (forward and
backward, train and eval), what stays unchanged, the swap the runtime performs, probe verification."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from themis_compile.models import build_model
from themis_compile.passes import shard, styles
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.fx_graph import trace_block
from themis_compile.passes.shard import ExpertLoop, verify_rewrite
from themis_compile.passes.styles import prepare_moe_layers, rewrite_moe_layer
from tests.passes import moe_zoo as zoo



def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    loss = (_first(out) ** 2).sum()
    if isinstance(out, tuple):
        loss = loss + out[1].float().sum()
    aux = getattr(model[0], "aux_loss", None) if isinstance(model, nn.Sequential) else None
    return loss + (aux if isinstance(aux, torch.Tensor) else 0)


def _rewritten(block: nn.Module) -> tuple[nn.Module, nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(block)
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    infos = prepare_moe_layers(model)
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    return model, reference, infos


@pytest.mark.parametrize("make", [lambda: zoo.OldHFBlock(store_aux=True), zoo.SetitemLoopBlock,
                                  lambda: zoo.OldHFBlock(jitter_noise=0.1)],
                         ids=["old_hf", "setitem_bs_routing", "old_hf_jitter"])
@pytest.mark.parametrize("training", [True, False])
def test_rewrite_matches_original_forward_and_backward(make, training):
    model, reference, infos = _rewritten(make())
    assert len(infos) == 1 and infos[0].rewritten
    block = model[0]
    assert isinstance(getattr(block, infos[0].experts_attr), ExpertLoop)
    assert isinstance(block, type(reference[0])) and type(block) is not type(reference[0])
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.train(training)
    reference.train(training)
    for seed in range(3):
        x = torch.randn(3, 5, zoo.H, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        torch.manual_seed(seed)   # the same jitter noise in train mode
        out = model(x.clone())
        torch.manual_seed(seed)
        out_ref = reference(x_ref.clone())
        torch.testing.assert_close(_first(out), _first(out_ref), rtol=1e-6, atol=1e-6)
        if getattr(reference[0], "store_aux", False):
            torch.testing.assert_close(block.aux_loss, reference[0].aux_loss)
        model.zero_grad()
        reference.zero_grad()
        torch.manual_seed(seed)
        _loss(model, x.clone()).backward()
        torch.manual_seed(seed)
        _loss(reference, x_ref.clone()).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_rewritten_graph_keeps_routing_and_calls_experts_once():
    model, reference, infos = _rewritten(zoo.OldHFBlock())
    block = model[0]
    traced = trace_block(block, block.experts)
    graph = traced.gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("experts")]
    assert [n.target for n in calls] == ["experts"]          # the loop's E expert calls became one
    assert sum(n.target in ("index_add_",) for n in graph.nodes) == 0
    kept = [str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert any("topk" in t for t in kept) and any("softmax" in t for t in kept)   # the user's routing
    graph.lint()
    again, _ = find_moe_layers(model)
    assert again[0].rewrite == "none"                          # the rewritten block calls experts(x, ids, w)
    assert "FX graph" in again[0].router                       # and is itself FX-traceable


def test_runtime_can_swap_the_experts_of_a_rewritten_block():
    from themis_compile.planner.placement import Placement
    from themis_compile.runtime.ep import ShardedExperts
    from themis_compile.runtime.experts import ExpertBank

    model, reference, infos = _rewritten(zoo.OldHFBlock())
    block, info = model[0], infos[0]
    experts = getattr(block, info.experts_attr)
    bank = ExpertBank(experts, layer=info.name)
    assert bank.num_experts == 4 and bank.form == "modulelist"
    sharded = ShardedExperts(bank, experts, Placement.contiguous(4, 1), rank=0, world_size=1, layer=info.name)
    setattr(block, info.experts_attr, sharded)
    x = torch.randn(2, 6, zoo.H)
    torch.testing.assert_close(model(x)[0], reference(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: build_model("tiny-moe", experts_form="loop"),
    lambda: build_model("tiny-moe", experts_form="stacked", shared_expert=True),
    zoo.TitanMoE,
])
def test_blocks_calling_experts_already_are_not_rewritten(make):
    torch.manual_seed(0)
    model = make()
    classes = [type(m) for m in model.modules()]
    infos = prepare_moe_layers(model)
    assert infos and all(i.rewrite == "none" and not i.rewritten for i in infos)
    assert [type(m) for m in model.modules()] == classes


def test_hf_mixtral_is_not_rewritten():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128))
    infos = prepare_moe_layers(model)
    assert [i.name for i in infos] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(type(i.module).__name__ == "MixtralSparseMoeBlock" and not i.rewritten for i in infos)


def test_no_moe_layer_warns_or_raises():
    model = zoo.DenseModel()
    state = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match="found no MoE layer.*searched for"):
        assert prepare_moe_layers(model) == []
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="found no MoE layer"):
        prepare_moe_layers(model, strict=True)
    with pytest.raises(ValueError, match="rejected: 0: experts are not identical"):
        prepare_moe_layers(nn.Sequential(zoo.OldHFBlock(expert_ffns=[64, 128, 64, 64])), strict=True)


def _drop_last_expert(self, x_TH, ids_TK, weights_TK):
    return shard.loop_combine(self[:-1], x_TH, ids_TK, weights_TK)


def test_probe_mismatch_raises_under_strict_and_leaves_the_model_unchanged(monkeypatch):
    model = nn.ModuleDict({"good": zoo.SetitemLoopBlock(), "bad": zoo.OldHFBlock()})
    reference = copy.deepcopy(model)
    monkeypatch.setattr(ExpertLoop, "forward", _drop_last_expert)
    with pytest.raises(ValueError, match=r"MoE layer 'good'.*does not match the original.*left unchanged"):
        prepare_moe_layers(model, strict=True)
    for name in ("good", "bad"):
        assert type(model[name]) is type(reference[name])
        assert type(getattr(model[name], "mlps" if name == "good" else "experts")) is nn.ModuleList
    x = torch.randn(2, 3, zoo.H)
    torch.testing.assert_close(model["bad"](x)[0], reference["bad"](x)[0])
    torch.testing.assert_close(model["good"](x), reference["good"](x))


def test_faulty_rewrite_function_is_caught(monkeypatch):
    real = styles.rewrite_moe_layer

    def faulty(info):
        real(info)
        info.module.gate = nn.Linear(zoo.H, 4, bias=False)   # a rewrite that loses the user's router weights

    model = nn.Sequential(zoo.OldHFBlock())
    gate = model[0].gate
    monkeypatch.setattr(styles, "rewrite_moe_layer", faulty)
    with pytest.raises(ValueError, match="MoE layer '0'.*does not match the original"):
        prepare_moe_layers(model, strict=True)
    assert model[0].gate is gate and type(model[0]) is zoo.OldHFBlock


def test_a_layer_whose_rewrite_fails_is_left_as_it_is_with_a_warning():
    """Without strict, a layer whose rewrite cannot be made stays as written (its experts dense, data-parallel
    under optimize), named with the reason in a warning; the other layers are rewritten as usual."""
    class GuardedBlock(zoo.OldHFBlock):
        def forward(self, hidden_states):
            if hidden_states.abs().max() > 1e6:   # a branch in the routing part: no generated forward keeps it
                hidden_states = hidden_states.clamp(-1e6, 1e6)
            return super().forward(hidden_states)

    torch.manual_seed(0)
    model = nn.ModuleDict({"guarded": GuardedBlock(), "plain": zoo.OldHFBlock()})
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"(?s)1 MoE layer\(s\) left as they are.*\n  guarded: MoE layer 'guarded': "
                                         r"the forward branches on a traced value outside the expert loop"):
        infos = prepare_moe_layers(model)
    assert [(i.name, i.rewritten) for i in infos] == [("plain", True)]
    assert type(model["guarded"]) is GuardedBlock and type(model["guarded"].experts) is nn.ModuleList
    assert isinstance(model["plain"].experts, ExpertLoop)
    x = torch.randn(2, 3, zoo.H)
    for name in ("guarded", "plain"):
        torch.testing.assert_close(model[name](x)[0], reference[name](x)[0])


def test_verify_rewrite_compares_outputs():
    block = zoo.OldHFBlock()
    probe = torch.randn(2, 4, zoo.H)
    verify_rewrite(block, copy.deepcopy(block), probe, layer="same")
    other = copy.deepcopy(block)
    with torch.no_grad():
        other.experts[0].w2.weight.mul_(1.01)
    with pytest.raises(ValueError, match="MoE layer 'changed'"):
        verify_rewrite(block, other, probe, layer="changed")


def test_rewrite_rejects_branches_on_routing_values():
    class GuardedBlock(zoo.OldHFBlock):
        def forward(self, hidden_states):
            if hidden_states.abs().max() > 1e6:   # a branch in the routing part, not in the expert loop
                hidden_states = hidden_states.clamp(-1e6, 1e6)
            return super().forward(hidden_states)

    model = nn.Sequential(GuardedBlock())
    (info,), _ = find_moe_layers(model)
    with pytest.raises(ValueError, match="branches on a traced value outside the expert loop"):
        rewrite_moe_layer(info)
    assert type(model[0]) is GuardedBlock


@pytest.mark.parametrize("top_k,message", [(9, "top_k=9 exceeds its 8 experts"), (0, "top_k=0 must be >= 1")])
def test_broken_top_k_raises_naming_the_layer(top_k, message):
    model = build_model("tiny-moe")
    model.blocks[1].moe.top_k = top_k
    infos, _ = find_moe_layers(model)
    assert [i.name for i in infos] == ["blocks.0.moe", "blocks.1.moe"] and infos[1].top_k == top_k
    with pytest.raises(ValueError, match=f"'blocks.1.moe': {message}"):
        prepare_moe_layers(model)


def test_per_slot_experts_call_is_rewritten_to_one_experts_call():
    """gpt-fast's cond_ffn(x, ids) -> [T, K, H], combined by the block: found by behaviour, rewritten so
    that one experts(x, ids, weights) call serves it; names, outputs and gradients unchanged."""
    from tests.passes import zoo_models

    torch.manual_seed(0)
    block = zoo_models.GptFastMoE()
    original = copy.deepcopy(block)
    (info,) = styles.prepare_moe_layers(nn.ModuleDict({"moe": block}))
    assert (info.rewrite, info.experts_attr, info.top_k, info.num_experts) == ("per-slot", "cond_ffn", 2, 4)
    assert list(block.state_dict()) == list(original.state_dict())
    calls = []
    block.cond_ffn.register_forward_pre_hook(lambda m, args: calls.append([tuple(a.shape) for a in args]))
    x = torch.randn(2, 4, zoo_models.H)
    out, ref = block(x), original(x)
    assert calls == [[(16, zoo_models.H), (16, 1), (16, 1)]]   # one call, one row per (token, slot)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(block.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
