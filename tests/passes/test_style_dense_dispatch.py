"""Style "dense-dispatch": each expert on its capacity slots between [T, E, C] dispatch and combine tensors: fairseq
Top2Gate, DeepSpeed. Each witness found as this style, explained in its row's words, and rewritten exactly
(tests/passes/style_checks.py); how they train sharded: test_zoo_training.py, test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style


def fairseq_top2():
    torch.manual_seed(0)
    return zoo.ZooLM("fairseq_top2")


def deepspeed():
    torch.manual_seed(0)
    return zoo.ZooLM("deepspeed")


@pytest.mark.parametrize("build,layers", [(fairseq_top2, 2), (deepspeed, 2)],
                         ids=["fairseq_top2", "deepspeed"])
def test_dense_dispatch_style(build, layers):
    check_style(build, "dense-dispatch", layers)
