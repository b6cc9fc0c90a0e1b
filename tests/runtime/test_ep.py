from __future__ import annotations

import pytest
import torch

import themis_compile
from themis_compile import ThemisConfig
from themis_compile.models import build_model, lm_loss
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import assert_equivalent, train_distributed, train_reference

STEPS, BATCH, SEQ = 10, 8, 16


def _ep_cases(rank, world_size, cases):
    out = [train_distributed(rank, world_size, mk, {"policy": "ep"}, STEPS, BATCH, SEQ) for mk in cases]
    out.append(train_distributed(rank, world_size, cases[0], {"policy": "ep", "dense_parallel": "ddp"}, 3, BATCH,
                                 SEQ, optimizer="sgd"))
    return out


CASES_2 = [
    dict(name="tiny-moe", experts_form="loop", top_k=2),
    dict(name="tiny-moe", experts_form="stacked", top_k=1, routing="topk_softmax", activation="gelu"),
]
CASES_4 = [
    dict(name="tiny-moe", experts_form="stacked", top_k=2, shared_expert=True),
    # E=6 over 4 ranks: 2, 2, 1, 1 experts; a strong skew leaves an expert without tokens.
    dict(name="tiny-moe", experts_form="loop", top_k=1, num_experts=6, router_skew=4.0),
]


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (4, CASES_4)])
def test_ep_matches_single_process(world_size, cases):
    results = run_multirank(_ep_cases, world_size, args=(cases,), timeout_s=60)
    for i, mk in enumerate(cases):
        reference = train_reference(mk, STEPS, BATCH, SEQ)
        assert_equivalent(reference, [r[i] for r in results])
    # SGD, unlike AdamW, would expose a wrong gradient scale on the experts.
    assert_equivalent(train_reference(cases[0], 3, BATCH, SEQ, "sgd"), [r[-1] for r in results])


def test_skewed_router_leaves_an_expert_without_tokens():
    torch.manual_seed(0)
    model = build_model("tiny-moe", num_experts=6, top_k=1, router_skew=4.0)
    tokens = torch.randint(0, 256, (BATCH, SEQ))
    model(tokens)
    counts = model.blocks[0].moe.last_tokens_per_expert
    assert (counts == 0).any() and counts.max() > counts.sum() // 2


def test_world_size_one_runs_without_process_group():
    torch.manual_seed(0)
    ref = build_model("tiny-moe", experts_form="stacked")
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe", experts_form="stacked"), ThemisConfig(policy="ep"))
    tokens = torch.randint(0, 256, (2, SEQ))
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_bad_input_names_the_layer():
    model = build_model("tiny-moe")
    model.blocks[1].moe.top_k = 9
    with pytest.raises(ValueError, match="blocks.1.moe.*top_k=9"):
        themis_compile.optimize(model, ThemisConfig(policy="ep"))
    model.blocks[1].moe.top_k = 0
    with pytest.raises(ValueError, match="blocks.1.moe.*top_k=0"):
        themis_compile.optimize(model, ThemisConfig(policy="ep"))
    with pytest.raises(ValueError, match="policy"):
        ThemisConfig(policy="fastest")
    with pytest.raises(ValueError, match="top_k"):
        build_model("tiny-moe", top_k=0)
