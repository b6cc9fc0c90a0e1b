"""Style "sorted-rows": experts(rows sorted by expert, counts): torchtitan GroupedExperts, Megatron-Core SequentialMLP.
Each witness found as this style, explained in its row's words, and rewritten exactly
(tests/passes/style_checks.py); how they train sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style


def torchtitan():
    torch.manual_seed(0)
    return zoo.ZooLM("torchtitan")


def megatron():
    torch.manual_seed(0)
    return zoo.ZooLM("megatron")


@pytest.mark.parametrize("build,layers", [(torchtitan, 2), (megatron, 2)],
                         ids=["torchtitan", "megatron"])
def test_sorted_rows_style(build, layers):
    check_style(build, "sorted-rows", layers)
