"""themis_compile: Fully Sharded Sparse Data Parallelism (Themis) for MoE training, as a compiler pass.

    import themis_compile as themis
    model = themis.optimize(model)          # detect MoE layers, shard experts, balance load every step
"""

from __future__ import annotations

from themis_compile.config import ThemisConfig

__version__ = "0.1.0"

__all__ = ["ThemisConfig", "optimize", "explain", "clip_grad_norm_", "__version__"]


def __getattr__(name: str):
    # optimize/explain import the runtime (torch.distributed etc.) lazily so that the planner and the
    # simulator stay importable and fast on their own.
    if name == "optimize":
        from themis_compile.api import optimize

        return optimize
    if name == "explain":
        from themis_compile.api import explain

        return explain
    if name == "clip_grad_norm_":
        from themis_compile.runtime.clip import clip_grad_norm_

        return clip_grad_norm_
    raise AttributeError(f"module 'themis_compile' has no attribute {name!r}")
