"""MoE blocks written as their projects write them (tests/passes/zoo_models.py), each in a small
transformer: which ones ``explain`` finds, the reason it gives for the others, and, for those found,
2 gloo ranks under ``themis`` training like one process (one process group for every style)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import themis_compile
from tests.passes import zoo_models as zoo

# style -> None when found and sharded, else a phrase of the reason explain gives (docs/detection.md).
EXPECTED = {
    "hf_qwen2_moe_v4": None,
    "gpt_fast": None,      # experts(x, ids) -> [T, K, H]: the per-slot rewrite
    "torchtitan": None,    # experts(rows sorted by expert, counts): the sorted-rows rewrite
    "jetmoe": "called as input_linear(Tensor[16, 32], list)",
    # An untraceable loop served by capture and replay, but it skips experts without tokens
    # (tests/passes/test_replay.py trains the same block without the skip).
    "deepseek_v3": "capture and replay cannot serve it either: it skips experts that receive no tokens",
    "switch": None,        # top-1 by max, weight after the loop: inline-loop rewrite with weights 1
    "fairseq_top2": None,  # [T, E, C] dispatch and combine tensors: the dense-dispatch rewrite
    "hf_switch_v4": "runs the experts in 'experts' (ModuleDict) one by one itself",
    "megablocks": "expert weights are flat parameters of the block itself",
}
FOUND = [s for s, why in EXPECTED.items() if why is None and s != "megablocks"]


def _model(style: str) -> zoo.ZooLM:
    torch.manual_seed(0)
    return zoo.ZooLM(style)


@pytest.mark.parametrize("style", sorted(zoo.BLOCKS))
def test_each_style_is_found_or_rejected_with_its_reason(style):
    report = themis_compile.explain(_model(style))
    if style in FOUND:
        assert report.startswith("2 MoE layer(s) found"), report
        assert "layers.0.moe" in report and "layers.1.moe" in report
    elif EXPECTED[style] is None:
        assert report == "0 MoE layer(s) found", report
    else:
        assert report.startswith("0 MoE layer(s) found"), report
        assert f"rejected layers.0.moe: " in report and EXPECTED[style] in report, report


STEPS, BATCH, SEQ = 3, 4, 8


def _train(model: zoo.ZooLM, rank: int, world_size: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    local = BATCH // world_size
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, zoo.VOCAB, (BATCH, SEQ), generator=g)
        loss = model.loss(tokens[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world_size)
    return losses


def _ranks(rank: int, world_size: int, styles: list[str]) -> dict[str, list[float]]:
    out = {}
    for style in styles:
        model = themis_compile.optimize(_model(style), themis_compile.ThemisConfig(policy="themis"), strict=True)
        out[style] = _train(model, rank, world_size)
    return out


def test_found_styles_train_like_one_process_on_two_ranks():
    from themis_compile.testing.multirank import run_multirank

    results = run_multirank(_ranks, 2, args=(FOUND,), timeout_s=120)
    for style in FOUND:
        reference = _train(_model(style), 0, 1)
        for step, (a, b) in enumerate(zip(results[0][style], reference)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{style} step {step}: {a} vs {b}"
