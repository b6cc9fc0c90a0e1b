"""Style "flatten": experts(x [B, S, H], ids, weights) on unflattened hidden states: HF DBRX >= 5. Each witness found
as this style, explained in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train
sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import hf_families as hf
from tests.passes.style_checks import check_style


def hf_dbrx():
    torch.manual_seed(0)
    return hf.tiny_model("dbrx")


@pytest.mark.parametrize("build,layers", [(hf_dbrx, 2)],
                         ids=["hf_dbrx"])
def test_flatten_style(build, layers):
    check_style(build, "flatten", layers)
