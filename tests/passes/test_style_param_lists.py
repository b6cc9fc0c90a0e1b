"""MoE blocks whose expert e is entry e of one or more ``nn.ParameterList`` s of bare weights, applied by the
block's own code, as research code writes them:

- ``NonzeroParamListsMoE``: ``w_in`` / ``b_in`` / ``w_out`` / ``b_out`` lists, a loop over ``zip(self.w_in,
  self.w_out)`` with ``nonzero``, ``F.linear(F.gelu(F.linear(rows, w_in, b_in[e])), w_out, b_out[e])`` per
  expert, experts without tokens skipped;
- ``GatedParamListsMoE``: ``w1`` / ``w3`` / ``w2`` lists (a SwiGLU expert, two lists read on the same rows,
  each weight transposed where it is applied: ``rows @ w1[e].t()``), tokens sorted by expert and split by
  ``bincount(...).tolist()`` counts, every split run (empty ones too);
- ``OneParamListMoE``: a single list of ``[H, H]`` weights, ``torch.tanh(rows @ w[e])`` (the ``tanh`` is the
  block's code on the expert's result), skipping experts without tokens.

No module is an expert, so ``optimize`` used to leave them data-parallel ("spread over parallel
ParameterLists"). Now the code on entry e's weights, read off a probe, moves with the entries into expert e
of a ModuleList of experts and the block is served by capture and replay (``rewrite == "param-lists"``,
docs/detection.md). Held here: found and explained, the rewrite exact on a probe (values and gradients) with
the user's parameter objects and state-dict keys, each expert owned by one rank, and gloo ranks under
``themis``, ``themis-rm`` and ``ep`` train equal to one process on the whole batch (losses per step, dense
parameters and every expert at the end) on 2 ranks and on 4 (2 nodes x 2), with the router skewed towards one
expert so that ``themis`` / ``themis-rm`` add replicas; the checkpoint holds the user's keys (``w_in.3``).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import themis_compile
from tests.passes import zoo_models as zoo
from tests.passes.style_training import (POLICIES, check_sharded_and_equal, checkpoint_resumes_in_the_users_keys,
                                         reference, train, trains_like_one_process)

H, FFN, E, K = zoo.H, zoo.FFN, zoo.E, zoo.K
SKEW = 3.0


def _weights(n: int, *shape: int) -> nn.ParameterList:
    return nn.ParameterList(nn.Parameter(torch.randn(*shape) * shape[-1] ** -0.5) for _ in range(n))


class NonzeroParamListsMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w_in = _weights(E, FFN, H)
        self.b_in = _weights(E, FFN)
        self.w_out = _weights(E, H, FFN)
        self.b_out = _weights(E, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, H)
        w_TK, ids_TK = self.router(x).softmax(-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for e, (w_in, w_out) in enumerate(zip(self.w_in, self.w_out)):
            tok, slot = torch.nonzero(ids_TK == e, as_tuple=True)
            if tok.numel():
                y = F.linear(F.gelu(F.linear(x[tok], w_in, self.b_in[e])), w_out, self.b_out[e])
                out = out.index_add(0, tok, y * w_TK[tok, slot, None])
        return out.view(shape)


class GatedParamListsMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1, self.w3, self.w2 = _weights(E, FFN, H), _weights(E, FFN, H), _weights(E, H, FFN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, H)
        top, ids = torch.topk(F.softmax(self.gate(x), dim=-1, dtype=torch.float), K, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        order = ids.flatten().argsort(stable=True)
        chunks = x[order // K].split(torch.bincount(ids.flatten(), minlength=E).tolist())
        outs = []
        for e, rows in enumerate(chunks):
            outs.append((F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())) @ self.w2[e].t())
        y = torch.zeros(ids.numel(), H, dtype=x.dtype).index_copy(0, order, torch.cat(outs))
        return (y.view(-1, K, H) * top.unsqueeze(-1).to(x.dtype)).sum(1).view(shape)


class OneParamListMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = _weights(E, H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, H)
        w_TK, ids_TK = self.router(x).topk(K, dim=-1)
        w_TK = w_TK.softmax(-1)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tok, slot = torch.where(ids_TK == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, torch.tanh(x[tok] @ self.experts[e]) * w_TK[tok, slot, None])
        return out.view(shape)


BLOCKS = {"nonzero": NonzeroParamListsMoE, "gated": GatedParamListsMoE, "one_list": OneParamListMoE}
LISTS = {"nonzero": ("w_in", "b_in", "w_out", "b_out"), "gated": ("w1", "w3", "w2"), "one_list": ("experts",)}
ROUTER = {"nonzero": "router", "gated": "gate", "one_list": "router"}
CODE = {"nonzero": "linear gelu linear", "gated": "t matmul silu t matmul mul t matmul", "one_list": "matmul"}
SKIPS = {"nonzero": True, "gated": False, "one_list": True}
ATTR = {"nonzero": "experts", "gated": "experts", "one_list": "experts_2"}   # (a name the block does not use)
LAYERS = ["layers.0.moe", "layers.1.moe"]


def _model(style: str) -> zoo.ZooLM:
    """The block in the zoo's small transformer, seeded, its router skewed towards expert 0 from outside the
    block (as ``tests/passes/test_zoo_training.py`` does)."""
    torch.manual_seed(0)
    return zoo.skew_routers(zoo.ZooLM(style, blocks=BLOCKS), ROUTER[style], SKEW)


def _is_expert(style: str):
    return lambda n: any(f".moe.{a}." in n for a in LISTS[style])


def _ranks(rank: int, world_size: int, cases):
    torch.set_num_threads(1)
    return [train(lambda: _model(style), policy, LAYERS) for style, policy in cases]


@pytest.mark.parametrize("style", sorted(BLOCKS))
def test_param_lists_are_found_and_explained(style):
    text = themis_compile.explain(_model(style))
    assert text.startswith("2 MoE layer(s) found"), text
    assert f"(param-lists, '{ATTR[style]}'), top-2" in text, text
    assert f"activation {CODE[style]} on entry e of {', '.join(LISTS[style])}" in text, text
    assert "applies entry e of each of its ParameterLists per expert" in text, text


@pytest.mark.parametrize("style", sorted(BLOCKS))
def test_rewrite_is_exact_and_keeps_the_users_keys(style):
    from themis_compile.passes.styles import prepare_moe_layers

    model, original = _model(style), _model(style)
    keys = list(original.state_dict())
    block, ref = model.layers[0].moe, original.layers[0].moe
    first = LISTS[style][0]
    w = getattr(block, first)[1]
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k, i.skips_empty_experts) for i in infos] == [
        (n, "param-lists", E, K, SKIPS[style]) for n in LAYERS]
    # The same parameter objects, now expert e's; keys as the user wrote them (w_in.3), both ways.
    experts = getattr(block, ATTR[style])
    assert getattr(experts[1], first) is w and first not in block._modules
    assert f"layers.0.moe.{first}.1" in keys and list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = ref(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weights = lambda m: [m.router.weight if style != "gated" else m.gate.weight]  # noqa: E731
    g_want = torch.autograd.grad(want.square().sum(), [x, *weights(ref), *(getattr(ref, a)[0] for a in LISTS[style])])
    g_got = torch.autograd.grad(got.square().sum(), [x, *weights(block),
                                                     *(getattr(experts[0], a) for a in LISTS[style])])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_param_lists_train_like_one_process_on_2_ranks():
    from themis_compile.testing.multirank import run_multirank

    cases = [(style, policy) for style in sorted(BLOCKS) for policy in POLICIES]
    references = {style: reference(lambda: _model(style), _is_expert(style)) for style in BLOCKS}
    results = run_multirank(_ranks, 2, args=(cases,), timeout_s=240)
    for i, (style, policy) in enumerate(cases):
        check_sharded_and_equal(references[style], [r[i] for r in results], LAYERS, E, f"{style} under {policy}",
                                replicas=policy != "ep")


def test_param_lists_train_like_one_process_on_4_ranks_as_2_nodes():
    """Every expert on one of 4 ranks (2 emulated nodes x 2), the experts without tokens skipped."""
    trains_like_one_process(functools.partial(_model, "nonzero"), _is_expert("nonzero"), LAYERS, E, 4,
                            devices_per_node=2, timeout_s=240)


def test_code_that_differs_per_expert_stays_rejected():
    """Code on the weights that is not the same for every expert (a scale by the expert's id) is no expert
    code to move: the block stays data-parallel with the reason."""
    class PerExpertScale(NonzeroParamListsMoE):
        def forward(self, x):
            shape, x = x.shape, x.reshape(-1, H)
            w_TK, ids_TK = self.router(x).softmax(-1).topk(K, dim=-1)
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.nonzero(ids_TK == e, as_tuple=True)
                y = F.linear(F.gelu(F.linear(x[tok], self.w_in[e], self.b_in[e])) * (e + 1), self.w_out[e])
                out = out.index_add(0, tok, y * w_TK[tok, slot, None])
            return out.view(shape)

    torch.manual_seed(0)
    text = themis_compile.explain(zoo.ZooLM("scaled", blocks={"scaled": PerExpertScale}))
    assert text.startswith("0 MoE layer(s) found"), text
    assert ("are entry e of each of the ParameterLists 'w_in' (4 x Parameter [32, 32]), 'b_in' (4 x Parameter "
            "[32]), 'w_out' (4 x Parameter [32, 32]), 'b_out' (4 x Parameter [32]); step 1") in text, text
    assert "does not give what the block computes for expert 1" in text, text


def test_checkpoint_and_export_in_the_users_keys(tmp_path):
    """torch.distributed.checkpoint through themis_compile.checkpoint holds the user's keys (``w_in.3``) and
    resumes the run exactly; the full state dict is the unmodified model's, equal to one process's training."""
    checkpoint_resumes_in_the_users_keys(functools.partial(_model, "nonzero"), tmp_path)


class EveryExpertParamListsMoE(nn.Module):
    """Top-1 over a biased router whose last expert is never chosen, a ``torch.where`` loop that calls every
    expert, those without tokens on no rows (their gradient zero in one process, not None)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E)
        with torch.no_grad():
            self.router.bias[E - 1] = -100.0
        self.w_in, self.w_out = _weights(E, FFN, H), _weights(E, H, FFN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, H)
        w_TK, ids_TK = self.router(x).softmax(-1).topk(1, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids_TK == e)
            y = F.linear(F.gelu(F.linear(x[tok], self.w_in[e])), self.w_out[e])
            out.index_add_(0, tok, y * w_TK[tok, slot, None])
        return out.view(shape)


def _every_expert_model() -> zoo.ZooLM:
    torch.manual_seed(0)
    return zoo.ZooLM("every", blocks={"every": EveryExpertParamListsMoE})


def test_an_expert_without_tokens_in_a_loop_calling_every_expert():
    """The check of the rewrite runs such an expert on no rows, as the runtime does for a block that calls every
    expert: the layer is accepted (it was refused, the reference leaving that gradient None), its never-chosen
    expert gets a zero gradient as in one process, and 2 ranks train equal to one process."""
    from themis_compile.passes.styles import prepare_moe_layers

    model, original = _every_expert_model(), _every_expert_model()
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.rewrite, i.top_k, i.skips_empty_experts) for i in infos] == [("param-lists", 1, False)] * len(LAYERS)
    block, ref = model.layers[0].moe, original.layers[0].moe
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    ref(x).square().sum().backward()
    block(x).square().sum().backward()
    unused = block.experts[E - 1].w_in
    assert unused.grad is not None and not unused.grad.any()
    torch.testing.assert_close(unused.grad, ref.w_in[E - 1].grad)
    trains_like_one_process(_every_expert_model, lambda n: any(f".moe.{a}." in n for a in ("w_in", "w_out")),
                            LAYERS, E, 2, timeout_s=240)
