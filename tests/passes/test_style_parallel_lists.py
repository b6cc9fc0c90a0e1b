"""MoE blocks whose expert e is entry e of two parallel ``nn.ModuleList`` s of ``nn.Linear`` (an up and a down
projection), with the block's own activation between the two calls, as research code and Step / Hunyuan-like
blocks write them:

- ``SortedSplitMoE``: tokens sorted by expert id (``argsort``), split by ``bincount(...).tolist()`` counts,
  ``down_proj[i](act(up_proj[i](chunk)))`` per split, the result scattered back and combined per slot;
- ``NonzeroLoopMoE`` (``tests/passes/test_research_styles.py``'s ``ParallelListsMoE``): a loop over the experts with
  ``nonzero`` and ``index_add_``, biases and dropout, skipping experts without tokens;
- ``AllUpsFirstMoE``: every up projection first (a list comprehension over the splits), then every down
  projection, the lists named ``experts_up`` / ``experts_down``.

Neither holds an expert as one module, so ``optimize`` used to leave them data-parallel ("spread over parallel
ModuleLists"). Now entry e of each list is joined into expert e of a ModuleList of experts and the block is
served by capture and replay (``rewrite == "parallel-lists"``, docs/detection.md). Held here: found and
explained, the rewrite exact on a probe, the user's state-dict keys kept, each expert owned by one rank, and
2 gloo ranks under ``themis``, ``themis-rm`` and ``ep`` train equal to one process on the whole batch (losses
per step, dense parameters and every expert at the end), with the router skewed towards one expert so that
``themis`` / ``themis-rm`` add replicas.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import themis_compile
from tests.passes import zoo_models as zoo
from tests.passes.test_research_styles import ParallelListsMoE
from tests.passes.style_training import (POLICIES, check_sharded_and_equal,
                                         checkpoint_resumes_in_the_users_keys, reference, train)

H, FFN, E, K = zoo.H, zoo.FFN, zoo.E, zoo.K
SKEW = 3.0


class SortedSplitMoE(nn.Module):
    def __init__(self, dim: int = H, ffn_dim: int = FFN, num_experts: int = E, top_k: int = K) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.up_proj = nn.ModuleList([nn.Linear(dim, ffn_dim, bias=False) for _ in range(num_experts)])
        self.down_proj = nn.ModuleList([nn.Linear(ffn_dim, dim, bias=False) for _ in range(num_experts)])
        self.act = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        topk_weight = (topk_weight / topk_weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        flat_idx = topk_idx.view(-1)
        sort_idx = flat_idx.argsort()
        tokens_per_expert = flat_idx.bincount(minlength=len(self.up_proj)).tolist()
        x_sorted = x[sort_idx // self.top_k]
        outs = []
        for i, chunk in enumerate(x_sorted.split(tokens_per_expert)):
            h = self.act(self.up_proj[i](chunk))
            outs.append(self.down_proj[i](h))
        y_sorted = torch.cat(outs)
        y = torch.empty_like(y_sorted)
        y[sort_idx] = y_sorted
        y = (y.view(-1, self.top_k, d) * topk_weight.unsqueeze(-1)).sum(dim=1)
        return y.view(b, s, d)


class AllUpsFirstMoE(nn.Module):
    """Every up projection first (a list comprehension over the splits), then every down projection; lists
    whose names say "experts" (which detection also tries as one experts child)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts_up = nn.ModuleList(nn.Linear(H, FFN) for _ in range(E))
        self.experts_down = nn.ModuleList(nn.Linear(FFN, H) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, H)
        w, ids = self.router(x).softmax(-1).topk(K, -1)
        order = ids.flatten().argsort(stable=True)
        chunks = x[order // K].split(torch.bincount(ids.flatten(), minlength=E).tolist())
        hs = [F.relu(up(c)) for up, c in zip(self.experts_up, chunks)]
        ys = torch.cat([down(h) for down, h in zip(self.experts_down, hs)])
        y = torch.zeros_like(ys).index_copy(0, order, ys).view(-1, K, H)
        return (y * w.unsqueeze(-1)).sum(1).view(shape)


BLOCKS = {"sorted_split": SortedSplitMoE, "nonzero_loop": ParallelListsMoE, "all_ups_first": AllUpsFirstMoE}
LISTS = {"sorted_split": ("up_proj", "down_proj"), "nonzero_loop": ("up", "down"),
         "all_ups_first": ("experts_up", "experts_down")}
ROUTER = {"sorted_split": "gate", "nonzero_loop": "router", "all_ups_first": "router"}
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
def test_parallel_lists_are_found_and_explained(style):
    text = themis_compile.explain(_model(style))
    assert text.startswith("2 MoE layer(s) found"), text
    first, second = LISTS[style]
    assert "(parallel-lists, 'experts'), top-2" in text, text
    assert f"activation {first}[e] -> " in text and f"-> {second}[e]" in text, text
    assert "parallel ModuleLists per expert" in text, text


@pytest.mark.parametrize("style", sorted(BLOCKS))
def test_rewrite_is_exact_and_keeps_the_users_keys(style):
    from themis_compile.passes.styles import prepare_moe_layers

    model, original = _model(style), _model(style)
    keys = list(original.state_dict())
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [(n, "parallel-lists", E, K)
                                                                            for n in LAYERS]
    # Same parameter objects, now expert e of one ModuleList; keys as the user wrote them, both ways.
    block = model.layers[0].moe
    first, second = LISTS[style]
    assert getattr(block.experts[1], first).weight is not None and not hasattr(block, first)
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = original.layers[0].moe(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g_want = torch.autograd.grad(want.square().sum(), [x, getattr(original.layers[0].moe, first)[0].weight])
    g_got = torch.autograd.grad(got.square().sum(), [x, getattr(block.experts[0], first).weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_three_lists_stay_rejected_with_the_reason():
    class GatedLists(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(H, E, bias=False)
            self.w1 = nn.ModuleList(nn.Linear(H, FFN, bias=False) for _ in range(E))
            self.w3 = nn.ModuleList(nn.Linear(H, FFN, bias=False) for _ in range(E))
            self.w2 = nn.ModuleList(nn.Linear(FFN, H, bias=False) for _ in range(E))

        def forward(self, x):
            shape, x = x.shape, x.reshape(-1, H)
            w, ids = self.router(x).softmax(-1).topk(K, -1)
            out = torch.zeros_like(x)
            for e in range(E):
                tok, slot = torch.where(ids == e)
                out.index_add_(0, tok, w[tok, slot, None] * self.w2[e](F.silu(self.w1[e](x[tok])) * self.w3[e](x[tok])))
            return out.view(shape)

    torch.manual_seed(0)
    text = themis_compile.explain(zoo.ZooLM("gated", blocks={"gated": GatedLists}))
    assert text.startswith("0 MoE layer(s) found"), text
    assert "are spread over parallel ModuleLists 'w1' (4 x Linear), 'w3' (4 x Linear), 'w2' (4 x Linear)" in text


def test_parallel_lists_train_like_one_process_on_2_ranks():
    from themis_compile.testing.multirank import run_multirank

    cases = [(style, policy) for style in sorted(BLOCKS) for policy in POLICIES]
    references = {style: reference(lambda: _model(style), _is_expert(style)) for style in BLOCKS}
    results = run_multirank(_ranks, 2, args=(cases,), timeout_s=180)
    for i, (style, policy) in enumerate(cases):
        check_sharded_and_equal(references[style], [r[i] for r in results], LAYERS, E, f"{style} under {policy}",
                                replicas=policy != "ep")


def test_random_code_between_the_lists_stays_rejected():
    """Dropout with p > 0 between the two calls draws other numbers when replayed as part of an expert:
    not joined, the block stays data-parallel with the old reason."""
    def block():
        moe = ParallelListsMoE()
        moe.dropout.p = 0.1
        return moe

    torch.manual_seed(0)
    text = themis_compile.explain(zoo.ZooLM("dropout", blocks={"dropout": block}))
    assert text.startswith("0 MoE layer(s) found"), text
    assert "are spread over parallel ModuleLists 'up' (4 x Linear), 'down' (4 x Linear)" in text, text


@pytest.mark.parametrize("style", ["sorted_split"])
def test_checkpoint_and_export_in_the_users_keys(style, tmp_path):
    """torch.distributed.checkpoint through themis_compile.checkpoint holds the user's keys and resumes the
    run exactly; the full state dict is the unmodified model's, equal to one process's training."""
    checkpoint_resumes_in_the_users_keys(functools.partial(_model, style), tmp_path)