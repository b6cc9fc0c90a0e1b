"""Reference MoE models: a GPT-style decoder with an MoE FFN in every layer, in two expert forms."""

from __future__ import annotations

from torch import nn

from themis_compile.models.gpt_moe import (
    GPTMoE,
    ExpertMLP,
    MoEFeedForward,
    MoEModelConfig,
    StackedExperts,
    lm_loss,
)
from themis_compile.models.presets import PAPER_PRESETS, available_presets, preset

__all__ = [
    "GPTMoE", "ExpertMLP", "MoEFeedForward", "MoEModelConfig", "StackedExperts", "lm_loss",
    "build_model", "preset", "available_presets", "PAPER_PRESETS",
]


def build_model(name: str = "tiny-moe", *, devices: int | None = None, cluster: str = "A", **overrides) -> nn.Module:
    """Build a reference model by preset name; keyword overrides change any ``MoEModelConfig`` field.

    ``model(tokens_BS) -> logits_BSV``; ``model.aux_loss()`` returns the summed auxiliary loss of the
    last forward.
    """
    kwargs = {} if devices is None else {"devices": devices}
    cfg = preset(name, cluster=cluster, **kwargs).replace(**overrides)
    return GPTMoE(cfg)
