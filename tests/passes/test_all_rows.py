"""Experts that run on every row, the routing folded into their input (Llama 4: ``experts(x [E*T, H])``,
row ``e * T + t`` token t's copy for expert e, scaled by its router score): the all-rows rewrite serves
that call with one ``experts(x, ids, weights)`` call, equal to the original in values and in every
gradient (input and parameters, train and eval mode).

- gated bias-free experts (SwiGLU) keep zero rows at 0 in value and gradient: the sparse reading (only
  the nonzero rows, K = the router's top-k per token);
- experts that do not (a bias, an ungated activation, even one whose biases start at zero) take the
  plain reading (every row, K = E): exact, without sparsity;
- rows that are not expert-major copies are rejected with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from themis_compile.passes.candidates import RuntimeReference
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.find_behaviour import AllRowsPlan, all_rows_experts_class, serve_all_rows, zero_rows_reason
from themis_compile.passes.shard import AllRowsCall
from themis_compile.passes.styles import prepare_moe_layers

H, FFN, E = 16, 24, 4


class StackedExperts(nn.Module):
    """Every expert on every row by ``bmm`` over stacked weights, as Llama 4 writes it; ``gated`` selects
    SwiGLU (``up * silu(gate)``) or ``gelu(x W1) W2``, ``bias`` adds biases (``zero_bias``: zero-initialised),
    ``token_major`` reads row ``t * E + e`` as expert e's (not the ``[E, T, H]`` view)."""

    def __init__(self, gated: bool = True, bias: bool = False, zero_bias: bool = False,
                 token_major: bool = False) -> None:
        super().__init__()
        self.num_experts, self.gated, self.token_major = E, gated, token_major
        self.w_in = nn.Parameter(torch.randn(E, H, (2 if gated else 1) * FFN) * 0.2)
        self.w_out = nn.Parameter(torch.randn(E, FFN, H) * 0.2)
        if bias:
            init = torch.zeros if zero_bias else torch.randn
            self.b_in = nn.Parameter(init(E, 1, (2 if gated else 1) * FFN) * 0.2)
            self.b_out = nn.Parameter(init(E, 1, H) * 0.2)
        else:
            self.b_in = self.b_out = None

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        if self.token_major:   # row t * E + e for expert e
            x_ETH = x_NH.view(-1, self.num_experts, H).transpose(0, 1)
        else:
            x_ETH = x_NH.view(self.num_experts, -1, H)
        h = torch.bmm(x_ETH, self.w_in) + (self.b_in if self.b_in is not None else 0)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = up * F.silu(gate)
        else:
            h = F.gelu(h)
        y = torch.bmm(h, self.w_out) + (self.b_out if self.b_out is not None else 0)
        return (y.transpose(0, 1) if self.token_major else y).reshape(-1, H)


class AllRowsMoE(nn.Module):
    """A Llama-4-style block: top-k router, sigmoid of the chosen logits and 0 elsewhere, each expert's
    copy of the tokens scaled by its score, every expert on every row, summed over experts beside a
    shared expert. ``token_major`` lays the rows out ``t * E + e`` instead (``token_major_experts``: and
    the experts read them so)."""

    def __init__(self, top_k: int = 2, token_major: bool = False, token_major_experts: bool = False,
                 **expert_kwargs) -> None:
        super().__init__()
        self.top_k, self.token_major = top_k, token_major
        self.router = nn.Linear(H, E, bias=False)
        self.experts = StackedExperts(token_major=token_major_experts, **expert_kwargs)
        self.shared = nn.Sequential(nn.Linear(H, FFN), nn.SiLU(), nn.Linear(FFN, H))

    def forward(self, hidden_states: torch.Tensor):
        x_TH = hidden_states.reshape(-1, H)
        logits_TE = self.router(x_TH)
        top_TK, ids_TK = torch.topk(logits_TE, self.top_k, dim=1)
        scores_TE = torch.sigmoid(torch.full_like(logits_TE, float("-inf")).scatter(1, ids_TK, top_TK))
        if self.token_major:
            rows_NH = (x_TH[:, None, :] * scores_TE[:, :, None]).reshape(-1, H)
            y_TEH = self.experts(rows_NH).view(-1, E, H)
            routed_TH = y_TEH.sum(dim=1)
        else:
            rows_NH = x_TH.repeat(E, 1) * scores_TE.transpose(0, 1).reshape(-1, 1)
            routed_TH = self.experts(rows_NH).view(E, -1, H).sum(dim=0)
        return (self.shared(x_TH) + routed_TH).view(hidden_states.shape), logits_TE


def _prepared(block: nn.Module):
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": block})
    reference = copy.deepcopy(model)
    (info,) = prepare_moe_layers(model, strict=True)
    return model["moe"], reference["moe"], info


def _assert_equal_with_gradients(block: nn.Module, reference: nn.Module, seeds=range(3)) -> None:
    """Outputs, the input's gradient and every parameter's gradient equal, in train and in eval mode."""
    for training in (True, False):
        block.train(training)
        reference.train(training)
        for seed in seeds:
            x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(seed), requires_grad=True)
            x_ref = x.detach().clone().requires_grad_(True)
            (out, logits), (out_ref, logits_ref) = block(x), reference(x_ref)
            torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + seed))
            block.zero_grad()
            reference.zero_grad()
            ((out * g).sum() + logits.square().sum()).backward()
            ((out_ref * g).sum() + logits_ref.square().sum()).backward()
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
            reference_params = dict(reference.named_parameters())
            for name, p in block.named_parameters():
                if name in reference_params:
                    q_grad = reference_params[name].grad
                else:   # the runtime's shard of expert e: "experts.<e>.<name>"
                    _, e, pname = name.split(".", 2)
                    q_grad = reference_params[f"experts.{pname}"].grad[int(e)]
                assert (p.grad is None) == (q_grad is None), name
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q_grad, rtol=1e-6, atol=1e-6, msg=name)


def test_gated_bias_free_experts_take_the_sparse_reading_and_match_the_original():
    block, reference, info = _prepared(AllRowsMoE(top_k=2))
    assert info.rewrite == "all-rows" and info.plan == AllRowsPlan(num_experts=E, slots=2, sparse=True)
    assert info.top_k == 2 and "the nonzero rows, top-2 per token" in info.router
    assert list(block.state_dict()) == list(reference.state_dict())
    calls = []
    block.experts.register_forward_pre_hook(lambda m, args: calls.append([tuple(a.shape) for a in args]))
    block(torch.randn(2, 5, H))
    assert calls == [[(10 * 2, H), (10 * 2, 1), (10 * 2, 1)]]   # one call, K rows per token: no dense rows
    _assert_equal_with_gradients(block, reference)


def test_sparse_reading_served_by_the_runtime_matches_the_original():
    """The experts swapped for the runtime's ShardedExperts (one rank holding every expert): the
    computation optimize trains, values and gradients."""
    from themis_compile.planner.placement import Placement
    from themis_compile.runtime.ep import ShardedExperts
    from themis_compile.runtime.experts import ExpertBank

    block, reference, info = _prepared(AllRowsMoE(top_k=1))
    bank = ExpertBank(block.experts, layer=info.name)
    assert (bank.num_experts, bank.form) == (E, "stacked")
    block.experts = ShardedExperts(bank, block.experts, Placement.contiguous(E, 1), rank=0, world_size=1,
                                   layer=info.name)
    _assert_equal_with_gradients(block, reference, seeds=range(2))


@pytest.mark.parametrize("expert_kwargs, why", [
    (dict(gated=False), "gradient of its input is not 0"),                 # gelu(x W1) W2: J(0) != 0
    (dict(gated=False, bias=True), "maps a zero row to"),                  # bias: f(0) != 0
    (dict(gated=True, bias=True, zero_bias=True), "maps a zero row to"),   # 0 at init, not once trained
])
def test_experts_that_do_not_keep_zero_rows_at_zero_take_the_plain_reading(expert_kwargs, why):
    block, reference, info = _prepared(AllRowsMoE(top_k=2, **expert_kwargs))
    assert info.rewrite == "all-rows" and info.plan == AllRowsPlan(num_experts=E, slots=E, sparse=False)
    assert f"every row, K = E = {E}" in info.router and why in info.router, info.router
    calls = []
    block.experts.register_forward_pre_hook(lambda m, args: calls.append(tuple(args[0].shape)))
    block(torch.randn(2, 5, H))
    assert calls == [(10 * E, H)]
    _assert_equal_with_gradients(block, reference)


def test_zero_rows_reason_checks_random_parameters():
    assert zero_rows_reason(StackedExperts(), H) is None
    experts = StackedExperts(bias=True, zero_bias=True)
    assert zero_rows_reason(experts, H) is not None
    assert not experts.b_in.any() and not experts.b_out.any()   # the user's weights are not touched


def test_rows_laid_out_by_token_take_the_plain_reading():
    """Rows ``t * E + e`` given to experts that read them ``[E, T, H]``: row n is still run by expert
    n // T, as served, but a column of the view holds several tokens, so its nonzero rows do not count
    one token's experts: every row is served."""
    block, reference, info = _prepared(AllRowsMoE(top_k=2, token_major=True))
    assert info.plan == AllRowsPlan(num_experts=E, slots=E, sparse=False)
    assert "are not copies of one hidden state" in info.router, info.router
    _assert_equal_with_gradients(block, reference, seeds=range(1))


def test_experts_that_run_rows_token_major_are_rejected_with_the_reason():
    torch.manual_seed(0)
    infos, rejected = find_moe_layers(nn.ModuleDict({"moe": AllRowsMoE(token_major=True, token_major_experts=True)}))
    assert not infos
    (name, why), = rejected
    assert name == "moe" and "called on every row alone" in why and "does not run its rows expert-major" in why, why


def test_serve_all_rows_pads_tokens_with_fewer_nonzero_rows_and_refuses_more():
    torch.manual_seed(0)
    experts = StackedExperts()
    served = copy.deepcopy(experts)
    served.__class__ = all_rows_experts_class(StackedExperts)
    runtime = RuntimeReference(served)
    T = 6
    x_ETH = torch.randn(E, T, H)
    keep_ET = torch.zeros(E, T, dtype=torch.bool)
    keep_ET[1, 0] = keep_ET[3, 0] = True          # token 0: two rows
    keep_ET[2, 1] = True                          # token 1: one row (a weight-0 slot pads it)
    keep_ET[0, 3] = keep_ET[2, 3] = True          # token 2: none; token 3: two rows ...
    keep_ET[3, 4] = keep_ET[1, 5] = True
    x_NH = (x_ETH * keep_ET[..., None]).reshape(E * T, H).requires_grad_(True)
    x_ref = x_NH.detach().clone().requires_grad_(True)
    y = AllRowsCall(runtime, AllRowsPlan(E, 2, sparse=True))(x_NH)
    y_ref = experts(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(y.shape)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x_NH.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for p, q in zip(served.parameters(), experts.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="more nonzero expert rows"):
        serve_all_rows(runtime, x_NH.detach(), AllRowsPlan(E, 1, sparse=True))
    with pytest.raises(ValueError, match="not a multiple"):
        serve_all_rows(runtime, x_NH.detach()[:-1], AllRowsPlan(E, 2, sparse=True))


def test_an_expert_without_rows_keeps_its_input_in_the_graph():
    """A rank whose expert gets no row still runs it: zero gradients for its weights *and* a gradient
    path to its (empty) input, or the runtime's exchange of those rows would skip its backward on that
    rank alone (a collective mismatch)."""
    from themis_compile.runtime.experts import ExpertBank

    experts = StackedExperts()
    experts.__class__ = all_rows_experts_class(StackedExperts)
    bank = ExpertBank(experts)
    params = [t.detach().clone().requires_grad_() for t in bank.chunk(experts, 0)]
    x_NH = torch.zeros(0, H, requires_grad=True)
    y_NH = bank.run(params, x_NH)
    assert y_NH.shape == (0, H) and y_NH.grad_fn is not None
    x_grad, *grads = torch.autograd.grad(y_NH.sum(), [x_NH] + params)
    assert x_grad.shape == (0, H) and all(not g.any() for g in grads)


def test_hf_llama4_block_is_served_sparse_and_matches_the_original():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4 import modeling_llama4

    config = transformers.Llama4TextConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E,
                                           num_experts_per_tok=2)
    torch.manual_seed(0)
    moe = modeling_llama4.Llama4TextMoe(config)
    with torch.no_grad():
        moe.experts.gate_up_proj.normal_(0, 0.2)   # HF initialises it to zeros
        moe.experts.down_proj.normal_(0, 0.2)
    block, reference, info = _prepared(moe)
    assert info.rewrite == "all-rows" and info.plan == AllRowsPlan(num_experts=E, slots=2, sparse=True)
    _assert_equal_with_gradients(block, reference, seeds=range(2))


def test_a_rewrite_with_wrong_gradients_is_caught_and_leaves_the_model_unchanged(monkeypatch):
    """prepare_moe_layers checks the rewrite's gradients too: an adapter equal in value whose rows reach
    the experts detached (no gradient to the router or the input through them) is refused."""
    from themis_compile.passes import shard

    serve = shard.serve_all_rows
    monkeypatch.setattr(shard, "serve_all_rows", lambda experts, x_NH, plan: serve(experts, x_NH.detach(), plan))
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": AllRowsMoE(top_k=2)})
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="all-rows rewrite does not reproduce the gradients"):
        prepare_moe_layers(model, strict=True)
    assert [type(m) for m in model.modules()] == classes
