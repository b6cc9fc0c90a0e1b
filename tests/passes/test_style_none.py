"""Style "none": experts(x, ids, weights), the runtime's own interface: HF transformers >= 5 and the reference model's
stacked form. Each witness found as this style, explained in its row's words, and rewritten exactly
(tests/passes/style_checks.py); how they train sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from themis_compile.models import build_model
from tests.passes import hf_families as hf
from tests.passes.style_checks import check_style


def hf_mixtral():
    torch.manual_seed(0)
    return hf.tiny_model("mixtral")


def hf_qwen3_moe():
    torch.manual_seed(0)
    return hf.tiny_model("qwen3_moe")


def reference_stacked():
    torch.manual_seed(0)
    return build_model("tiny-moe-stacked")


@pytest.mark.parametrize("build,layers", [(hf_mixtral, 2), (hf_qwen3_moe, 1), (reference_stacked, 2)],
                         ids=["hf_mixtral", "hf_qwen3_moe", "reference_stacked"])
def test_none_style(build, layers):
    check_style(build, "none", layers)
