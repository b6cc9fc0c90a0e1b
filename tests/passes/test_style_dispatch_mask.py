"""Style "dispatch-mask": experts(x, one-hot mask [T, K, E], weights): HF Switch Transformers >= 5. Each witness found
as this style, explained in its row's words, and rewritten exactly (tests/passes/style_checks.py); how they train
sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import hf_families as hf
from tests.passes.style_checks import check_style


def hf_switch():
    torch.manual_seed(0)
    return hf.tiny_model("switch_transformers")


@pytest.mark.parametrize("build,layers", [(hf_switch, 2)],
                         ids=["hf_switch"])
def test_dispatch_mask_style(build, layers):
    check_style(build, "dispatch-mask", layers)
