"""MoE blocks written as their projects write them (tests/passes/zoo_models.py), each in a small
transformer: which ones ``explain`` finds and the reason it gives for the others. How the found ones
train on 2 and 4 ranks under every policy: tests/passes/test_zoo_training.py."""

from __future__ import annotations

import pytest
import torch

import themis_compile
from tests.passes import zoo_models as zoo

# style -> None when found and sharded, else a phrase of the reason explain gives (docs/detection.md).
EXPECTED = {
    "hf_qwen2_moe_v4": None,
    "gpt_fast": None,      # experts(x, ids) -> [T, K, H]: the per-slot rewrite
    "torchtitan": None,    # experts(rows sorted by expert, counts): the sorted-rows rewrite
    "jetmoe": None,        # two ParallelExperts halves on sorted rows, row-wise code between: joined
    "deepseek_v3": None,   # untraceable counts loop that skips empty experts: capture and replay
    "switch": None,        # top-1 by max, weight after the loop: inline-loop rewrite with weights 1
    "fairseq_top2": None,  # [T, E, C] dispatch and combine tensors: the dense-dispatch rewrite
    "hf_switch_v4": None,  # ModuleDict experts run one by one with getattr, skipping empty ones: capture and replay
    "megablocks": "expert weights are flat parameters of the block itself",
    "hf_mixtral_v4": None,  # inline loop with `continue` and list indexing: the inline-loop rewrite
    "hf_dbrx_v4": None,    # experts(x, probs, weights, ids) over flat [E * F, H] weights: the scores-call rewrite
    "hf_llama4_v4": None,  # experts(x [E*T, H]), every expert on every row: the all-rows rewrite (sparse)
    "sort_topk_loop": None,  # torch.sort cut to [:, :k], ModuleList loop with index_add_: inline-loop rewrite
    "argsort_bmm": None,     # argsort cut to [..., :2], stacked experts(x, ids) -> [T, K, H] by bmm: per-slot
    "sort_nonzero": None,    # sort cut to k, untraceable loop over unique().tolist() with nonzero: replay
    "megatron": None,      # SequentialMLP wrapping local_experts, on rows sorted by expert: sorted-rows rewrite
    "deepspeed": None,     # Experts wrapping deepspeed_experts on [1, E, C, H] slots: dense-dispatch rewrite
    "mask_any": None,      # expert calls under `if mask.any():` (FX takes the branch as False): capture and replay
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
