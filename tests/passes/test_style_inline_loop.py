"""Style "inline-loop": an inline loop over a ModuleList of experts, rewritten in the graph to one experts call: HF
transformers < 5, Switch by max, a sort cut to k, an index_put combine. Each witness found as this style, explained
in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train sharded:
test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import outside_styles as outside
from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style


def hf_mixtral_v4():
    torch.manual_seed(0)
    return zoo.ZooLM("hf_mixtral_v4")


def switch():
    torch.manual_seed(0)
    return zoo.ZooLM("switch")


def sort_topk_loop():
    torch.manual_seed(0)
    return zoo.ZooLM("sort_topk_loop")


def searchsorted_index_put():
    torch.manual_seed(0)
    return zoo.ZooLM("searchsorted_index_put", blocks=outside.BLOCKS)


@pytest.mark.parametrize("build,layers", [(hf_mixtral_v4, 2), (switch, 2), (sort_topk_loop, 2),
                                          (searchsorted_index_put, 2)],
                         ids=["hf_mixtral_v4", "switch", "sort_topk_loop", "searchsorted_index_put"])
def test_inline_loop_style(build, layers):
    check_style(build, "inline-loop", layers)
