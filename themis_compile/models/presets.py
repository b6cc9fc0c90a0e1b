"""Model presets named after the paper's Table 1, plus tiny CPU variants.

Table 1 gives d_model, d_ffn, sequence length, layers (Cluster A/B), experts per GPU and top-k. The
preset's ``num_experts`` assumes the paper's default of 32 devices (4 nodes x 8 GPUs); pass
``devices=N`` to :func:`build_model` / :func:`preset` to scale it.
"""

from __future__ import annotations

from themis_compile.models.gpt_moe import MoEModelConfig

PAPER_DEVICES = 32

# name: (d_model, d_ffn, seq_len, layers A, layers B, experts/GPU, top-k, n_heads, vocab, act, shared)
_TABLE1 = {
    "gpt-s-moe": (768, 3072, 2048, 12, 12, 2, 2, 12, 50257, "gelu", False),
    "gpt-l-moe": (1536, 6144, 2048, 12, 12, 2, 2, 16, 50257, "gelu", False),
    "phi-3.5-moe": (4096, 6400, 4096, 4, 8, 1, 2, 32, 32064, "swiglu", False),
    "qwen1.5-moe": (2048, 1408, 4096, 12, 24, 2, 4, 16, 151936, "swiglu", True),
    "deepseek-v3": (7168, 2048, 4096, 2, 4, 4, 8, 128, 129280, "swiglu", True),
}

PAPER_PRESETS = tuple(_TABLE1)


def preset(name: str, *, devices: int = PAPER_DEVICES, cluster: str = "A") -> MoEModelConfig:
    """The configuration of a named preset (``"<paper name>"`` or ``"<paper name>-tiny"``, ``"tiny-moe"``)."""
    if name == "tiny-moe":
        return MoEModelConfig(name=name)
    if name == "tiny-moe-stacked":
        return MoEModelConfig(name=name, experts_form="stacked")
    base, tiny = (name[: -len("-tiny")], True) if name.endswith("-tiny") else (name, False)
    if base not in _TABLE1:
        raise ValueError(f"unknown model preset {name!r}; choose from {available_presets()}")
    if cluster not in ("A", "B"):
        raise ValueError(f"cluster must be 'A' or 'B', got {cluster!r}")
    d, f, s, la, lb, epd, k, heads, vocab, act, shared = _TABLE1[base]
    if tiny:
        # Same structure (top-k, activation, shared expert, experts per device), CPU-sized.
        return MoEModelConfig(
            name=name, vocab_size=256, d_model=32, n_heads=4, n_layers=2, d_ffn=64, seq_len=64,
            num_experts=max(epd * 4, k), top_k=k, activation=act, shared_expert=shared,
            experts_per_device=epd,
        )
    return MoEModelConfig(
        name=name, vocab_size=vocab, d_model=d, n_heads=heads, n_layers=la if cluster == "A" else lb,
        d_ffn=f, seq_len=s, num_experts=epd * devices, top_k=k, activation=act, shared_expert=shared,
        experts_per_device=epd,
    )


def available_presets() -> list[str]:
    return ["tiny-moe", "tiny-moe-stacked", *PAPER_PRESETS, *(f"{n}-tiny" for n in PAPER_PRESETS)]
