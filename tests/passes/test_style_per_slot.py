"""Style "per-slot": experts(x, ids) -> [T, K, H], combined by the block: gpt-fast, argsort + bmm. Each witness found
as this style, explained in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train
sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style


def gpt_fast():
    torch.manual_seed(0)
    return zoo.ZooLM("gpt_fast")


def argsort_bmm():
    torch.manual_seed(0)
    return zoo.ZooLM("argsort_bmm")


@pytest.mark.parametrize("build,layers", [(gpt_fast, 2), (argsort_bmm, 2)],
                         ids=["gpt_fast", "argsort_bmm"])
def test_per_slot_style(build, layers):
    check_style(build, "per-slot", layers)
