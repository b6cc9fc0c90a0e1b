"""`themis_compile.attention` under its earlier name, for code that imports it from here (the profiler's
error message and docs/compiler.md name it). The package itself imports `themis_compile.attention`."""

from themis_compile.attention import (ATTENTION_ATTR, REGION_KEY, class_calls_attention, is_attention_module,
                                      mark_attention)

__all__ = ["ATTENTION_ATTR", "REGION_KEY", "mark_attention", "is_attention_module", "class_calls_attention"]
