"""Which modules are attention layers: the overlap windows of the scheduling pass (§4.2).

An attention module is one marked with `mark_attention` (or a ``themis_attention = True`` attribute;
``False`` opts a module out), or one whose class ``forward`` calls ``F.scaled_dot_product_attention``, flex
attention or an HF attention interface (``attention_interface``). The scheduling pass
(`themis_compile.passes.schedule`), its hook path (`themis_compile.passes.windows`) and the cost model's
T_attn profiler (`themis_compile.runtime.profiling`, through `themis_compile.cost_model.profile`) all
recognise attention through this module. It imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

__all__ = ["ATTENTION_ATTR", "REGION_KEY", "mark_attention", "is_attention_module", "class_calls_attention"]

ATTENTION_ATTR = "themis_attention"
REGION_KEY = "themis_region"          # meta["custom"][REGION_KEY] == "attn" marks attention nodes under compile

_ATTENTION_CALLS = ("scaled_dot_product_attention", "flex_attention", "attention_interface")


def mark_attention(module: nn.Module) -> nn.Module:
    """Mark ``module`` as an attention layer (an overlap window) for the scheduling pass; returns it."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"mark_attention expects an nn.Module, got {type(module).__name__}")
    setattr(module, ATTENTION_ATTR, True)
    return module


@functools.lru_cache(maxsize=None)
def class_calls_attention(cls: type) -> bool:
    """True when the source of ``cls.forward`` calls SDPA, flex attention or an HF attention interface."""
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(s in source for s in _ATTENTION_CALLS)


def is_attention_module(module: nn.Module) -> bool:
    """True for modules marked with `mark_attention` (or ``themis_attention = True``) and for modules whose
    ``forward`` calls ``F.scaled_dot_product_attention`` (or flex attention / an HF attention interface)."""
    flag = getattr(module, ATTENTION_ATTR, None)
    if flag is not None:
        return bool(flag)
    return class_calls_attention(type(module))
