"""What ``optimize`` did to a model (:class:`ThemisRuntime`) and the live models it rewrote.

This is the bottom of the user-facing layer: ``api.optimize`` builds the record, and the helpers that
are handed only a model or its parameters (``clip_grad_norm_``, checkpointing, the benchmarks) read it
here, without importing ``api``. The registry is weak: an entry lives as long as its model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from themis_compile.config import ThemisConfig

if TYPE_CHECKING:
    from themis_compile.layer_info import MoELayerInfo
    from themis_compile.runtime.fssdp import FSSDPState, LayerStats
    from themis_compile.runtime.reshard import ReshardScheduler

__all__ = ["ThemisRuntime", "optimized_models", "register", "runtime_of"]

# The models `optimize` rewrote, for helpers handed only their parameters (`clip_grad_norm_`).
_OPTIMIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclass
class ThemisRuntime:
    """What ``optimize`` did to a model; reachable as ``themis_compile.api.runtime_of(model)``."""

    config: ThemisConfig
    rank: int
    world_size: int
    group: Any                                                     # ProcessGroup, or None at world size 1
    layers: dict[str, nn.Module] = field(default_factory=dict)   # layer name -> ShardedExperts
    layer_infos: dict[str, MoELayerInfo] = field(default_factory=dict)   # layer name -> what detection found
    unsharded: list[tuple[str, str]] = field(default_factory=list)  # (MoE-like module, why it is not sharded)
    fssdp: FSSDPState | None = None                                # under themis / themis-rm
    reshard_scheduler: ReshardScheduler | None = None              # Alg. 2 every k optimizer steps

    @property
    def stats(self) -> list[LayerStats]:
        """Per-layer, per-iteration load statistics (:class:`~themis_compile.runtime.fssdp.LayerStats`),
        oldest first, at most ``config.stats_max_bytes`` of them (summaries unless ``config.full_stats``);
        empty for policies other than themis / themis-rm."""
        return [] if self.fssdp is None else list(self.fssdp.stats)

    @property
    def dense_parallel(self) -> str | None:
        """How everything that is not a sharded expert is data-parallel: ``"fsdp2"``, ``"ddp"``, or
        ``None`` at world size 1."""
        return self.config.dense_parallel if self.world_size > 1 else None

    @property
    def layer_order(self) -> list[nn.Module]:
        """The sharded experts modules in the order the last forward ran them."""
        return list(self.layers.values()) if self.fssdp is None else list(self.fssdp.layer_order)


def register(model: nn.Module, runtime: ThemisRuntime) -> None:
    """Attach ``runtime`` to ``model`` and list the model among the optimized ones; its FSSDP state takes
    the config's statistics options (``full_stats``, ``stats_max_bytes``)."""
    if runtime.fssdp is not None:
        runtime.fssdp.configure_stats(runtime.config.full_stats, runtime.config.stats_max_bytes)
    model._themis_runtime = runtime
    _OPTIMIZED.add(model)


def optimized_models() -> list[nn.Module]:
    """The live models ``optimize`` rewrote (in no particular order)."""
    return list(_OPTIMIZED)


def runtime_of(model: nn.Module) -> ThemisRuntime:
    """The record ``optimize`` attached to ``model``; ``ValueError`` for a model it did not rewrite."""
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None:
        raise ValueError("this model was not optimized by themis_compile.optimize")
    return runtime
