"""Style "scores-call": experts(x, dense scores [T, E], weights, ids): HF DBRX before v5. Each witness found as this
style, explained in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train sharded:
test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style


def hf_dbrx_v4():
    torch.manual_seed(0)
    return zoo.ZooLM("hf_dbrx_v4")


@pytest.mark.parametrize("build,layers", [(hf_dbrx_v4, 2)],
                         ids=["hf_dbrx_v4"])
def test_scores_call_style(build, layers):
    check_style(build, "scores-call", layers)
