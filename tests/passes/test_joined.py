"""Experts held in two stacked halves with the block's code between them (JetMoE ``ParallelExperts``):
joined into one experts module when that code is row-wise, rejected with the reason when it is not
(themis_compile/passes/joined.py). Training on 2 and 4 ranks: the zoo matrix (test_zoo_training.py,
style ``jetmoe``) and the HF sweep (``jetmoe``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import themis_compile
from tests.passes import zoo_models as zoo
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.joined import JoinedExperts, row_mixing_reason
from themis_compile.passes.styles import prepare_moe_layers
from themis_compile.runtime.experts import ExpertBank


class SplitExpertsMoE(nn.Module):
    """JetMoE's MoE block with the code between its two halves as a method, so that variants can change it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(zoo.H, zoo.E, bias=False)
        self.input_linear = zoo.JetMoeMoE.ParallelExperts(zoo.E, zoo.H, 2 * zoo.FFN)
        self.output_linear = zoo.JetMoeMoE.ParallelExperts(zoo.E, zoo.FFN, zoo.H)
        self.scale = nn.Parameter(torch.ones(zoo.FFN))

    def between(self, h: torch.Tensor) -> torch.Tensor:
        h, gate = h.chunk(2, dim=-1)
        return F.silu(gate) * h

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        x_TH = x_BSH.reshape(-1, H)
        weights_TK, ids_TK = torch.softmax(self.router(x_TH), -1).topk(zoo.K, dim=-1)
        counts = torch.bincount(ids_TK.flatten(), minlength=zoo.E).tolist()
        order_N = ids_TK.flatten().argsort(stable=True)
        token_N = order_N // zoo.K
        y_NH = self.output_linear(self.between(self.input_linear(x_TH[token_N], counts)), counts)
        y_NH = y_NH * weights_TK.flatten()[order_N, None]
        return torch.zeros_like(x_TH).index_add(0, token_N, y_NH).view(B, S, H)


class CumsumBetween(SplitExpertsMoE):
    def between(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(super().between(h), dim=0)      # mixes the rows of every expert


class ParameterBetween(SplitExpertsMoE):
    def between(self, h: torch.Tensor) -> torch.Tensor:
        return super().between(h) * self.scale               # a parameter of the block inside the expert


class BranchBetween(SplitExpertsMoE):
    def between(self, h: torch.Tensor) -> torch.Tensor:
        h = super().between(h)
        return h * 0.5 if (h.abs() > 100).any() else h      # Python control flow on the rows' values


class Holder(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.moe = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def test_two_halves_are_joined_and_the_rewrite_equals_the_original():
    model = Holder(SplitExpertsMoE())
    original = copy.deepcopy(model)
    (info,), rejected = find_moe_layers(model)
    assert (info.name, info.rewrite, info.experts_form, info.top_k, info.num_experts) == ("moe", "joined", "joined",
                                                                                          zoo.K, zoo.E), rejected
    assert info.activation == "input_linear -> chunk silu mul -> output_linear"
    assert "experts" not in model.moe._modules              # detection is read-only
    keys, w_in = list(original.state_dict()), model.moe.input_linear.weight

    prepare_moe_layers(model, strict=True)
    experts = model.moe.experts
    assert isinstance(experts, JoinedExperts) and experts.input_linear.weight is w_in   # the same parameters
    assert sorted(model.state_dict()) == sorted(keys)       # the user's keys: moe.input_linear.weight ...

    x = torch.randn(2, 8, zoo.H, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = model(x), original(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in original.named_parameters():
        if n == "moe.scale":
            continue       # unused by this block
        torch.testing.assert_close(grads[n.replace("moe.", "moe.experts.", 1) if "_linear" in n else n], p.grad)

    # Each expert alone, as the runtime runs it: output_linear[e] o between o input_linear[e].
    bank = ExpertBank(experts, num_experts=zoo.E)
    assert bank.form == "stacked" and bank.names == ("input_linear.weight", "output_linear.weight")
    rows = torch.randn(5, zoo.H)
    for e in range(zoo.E):
        w_in, w_out = (t.detach() for t in bank.chunk(experts, e))
        expected = F.linear(original.moe.between(F.linear(rows, w_in)), w_out)
        torch.testing.assert_close(bank.run([w_in, w_out], rows), expected)


def test_state_dict_and_checkpoint_keys_stay_the_users():
    """After optimize (one process: every expert held), the model's state dict has the unmodified model's
    keys and values, loads into it and from it, and torch.distributed.checkpoint resolves every key."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, unmodified, fresh = Holder(SplitExpertsMoE()), Holder(SplitExpertsMoE()), Holder(SplitExpertsMoE())
    with torch.no_grad():
        fresh.moe.output_linear.weight.add_(1.0)
    themis_compile.optimize(model)
    assert themis_compile.api.runtime_of(model).layers      # sharded (every expert on this one rank)
    state = model.state_dict()
    assert sorted(state) == sorted(unmodified.state_dict())
    assert state["moe.input_linear.weight"].shape == (zoo.E, 2 * zoo.FFN, zoo.H)
    for k, v in unmodified.state_dict().items():
        assert torch.equal(state[k], v), k
    unmodified.load_state_dict(state)
    model.load_state_dict(fresh.state_dict())
    assert torch.equal(model.state_dict()["moe.output_linear.weight"], fresh.moe.output_linear.weight)
    assert sorted(get_model_state_dict(model)) == sorted(state)
    set_model_state_dict(model, unmodified.state_dict())
    assert torch.equal(model.state_dict()["moe.output_linear.weight"], unmodified.moe.output_linear.weight)


@pytest.mark.parametrize("block, phrase", [
    (CumsumBetween, "the code between 'input_linear' and 'output_linear' cannot be part of an expert: the code "
                    "between the two calls mixes rows"),
    (ParameterBetween, "mul uses a tensor [32] that is not computed from the first half's rows"),
    (BranchBetween, "__bool__ reads values of the rows into Python"),
])
def test_code_between_the_halves_that_is_not_row_wise_is_rejected(block, phrase):
    model = Holder(block())
    found, rejected = find_moe_layers(model)
    assert not found and [n for n, _ in rejected] == ["moe"], rejected
    assert phrase in rejected[0][1], rejected[0][1]
    assert "only part of each expert" in rejected[0][1]


def test_row_mixing_reason():
    h = torch.randn(7, 6)
    assert row_mixing_reason(lambda t: torch.tanh(t) * 2, h) is None
    assert "mixes rows" in row_mixing_reason(lambda t: t - t.mean(0), h)
    assert "fails on other rows" in row_mixing_reason(lambda t: t.view(7, 2, 3).sum(1), h)
