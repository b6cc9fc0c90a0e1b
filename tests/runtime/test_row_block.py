"""ThemisConfig.expert_row_block: its validation and the block size ``"auto"`` picks.

That blocks train like one process is held in tests/runtime/test_fssdp.py (themis and ep, SGD)."""

from __future__ import annotations

import pytest
import torch

from themis_compile import ThemisConfig
from themis_compile.runtime.experts import CPU_ROW_BLOCK_BYTES, MIN_ROW_BLOCK, row_block


@pytest.mark.parametrize("bad", [0, -3, 2.5, "big", True])
def test_bad_row_block_is_rejected(bad):
    with pytest.raises(ValueError, match="expert_row_block"):
        ThemisConfig(expert_row_block=bad)


def test_row_block_settings():
    rows = torch.zeros(5, 128)
    swiglu_bytes = 3 * 128 * 2048 * 4          # one SwiGLU expert, H = 128, F = 2048, fp32
    assert row_block(7, swiglu_bytes, rows) == 7
    assert row_block(None, swiglu_bytes, rows) is None
    # auto on CPU: a block's intermediates (Psi / H values per row) take CPU_ROW_BLOCK_BYTES.
    assert row_block("auto", swiglu_bytes, rows) == CPU_ROW_BLOCK_BYTES * 128 // swiglu_bytes == 1024
    assert row_block("auto", swiglu_bytes * 2, rows) == 512        # twice the width: half the rows
    assert row_block("auto", 64 * swiglu_bytes, rows) == MIN_ROW_BLOCK
    # Not on CPU (here the meta device): no blocks.
    assert row_block("auto", swiglu_bytes, torch.zeros(5, 128, device="meta")) is None
