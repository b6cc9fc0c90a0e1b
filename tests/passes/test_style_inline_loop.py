"""Style "inline-loop": an inline loop over a ModuleList of experts, rewritten in the graph to one experts call: HF
transformers < 5, Switch by max, a sort cut to k, an index_put combine. Each witness found as this style, explained
in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train sharded:
test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.passes import outside_styles as outside
from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style
from tests.passes.style_training import trains_like_one_process


class LinearExpertsMoE(nn.Module):
    """Each expert a single ``nn.Linear`` (a ModuleList of them, the block's only such list), top-2 of a
    softmax, the loop's combine an in-place ``index_add_``."""

    def __init__(self, dim: int = zoo.H, num_experts: int = zoo.E, top_k: int = zoo.K) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_experts))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights_TK, ids_TK = self.gate(x_TH).softmax(-1).topk(self.top_k)
        out_TH = torch.zeros_like(x_TH)
        for e, expert in enumerate(self.experts):
            token_N, slot_N = torch.where(ids_TK == e)
            out_TH.index_add_(0, token_N, expert(x_TH[token_N]) * weights_TK[token_N, slot_N, None])
        return out_TH.reshape(x_BSH.shape)


def hf_mixtral_v4():
    torch.manual_seed(0)
    return zoo.ZooLM("hf_mixtral_v4")


def switch():
    torch.manual_seed(0)
    return zoo.ZooLM("switch")


def sort_topk_loop():
    torch.manual_seed(0)
    return zoo.ZooLM("sort_topk_loop")


def linear_experts():
    torch.manual_seed(0)
    return zoo.skew_routers(zoo.ZooLM("linear_experts", blocks={"linear_experts": LinearExpertsMoE}), "gate", 3.0)


def searchsorted_index_put():
    torch.manual_seed(0)
    return zoo.ZooLM("searchsorted_index_put", blocks=outside.BLOCKS)


@pytest.mark.parametrize("build,layers", [(hf_mixtral_v4, 2), (switch, 2), (sort_topk_loop, 2),
                                          (searchsorted_index_put, 2), (linear_experts, 2)],
                         ids=["hf_mixtral_v4", "switch", "sort_topk_loop", "searchsorted_index_put", "linear_experts"])
def test_inline_loop_style(build, layers):
    check_style(build, "inline-loop", layers)


def test_single_linear_experts_train_like_one_process_on_2_ranks():
    trains_like_one_process(linear_experts, lambda name: ".experts." in name, ["layers.0.moe", "layers.1.moe"],
                            zoo.E, 2)
