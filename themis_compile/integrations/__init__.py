"""The training stacks an optimized model runs under, each in its own module (imported on use, so that
none of their packages is needed by the library itself):

- ``transformers``: ``ThemisTrainer``, HF ``Trainer`` for optimized models (clipping, gradient
  accumulation, checkpoints and ``resume_from_checkpoint``);
- ``accelerate``: ``ThemisAccelerator``, an ``Accelerator`` whose ``prepare`` keeps optimized models
  unwrapped and whose ``clip_grad_norm_`` is the global norm;
- ``lightning``: ``parallelize`` for ``ModelParallelStrategy(parallelize_fn=...)``;
- ``torchtitan``: ``parallelize`` in torchtitan's ``parallelize_fn(model, parallel_dims, job_config)`` form.

An optimized model is already data-parallel; a ``DistributedDataParallel`` or a second ``fully_shard``
around it refuses on every rank with what to do instead (``themis_compile.api.RefuseDDPWrap``).
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_optimized"]


def is_optimized(model: nn.Module) -> bool:
    """Whether ``themis_compile.optimize`` rewrote ``model``."""
    return getattr(model, "_themis_runtime", None) is not None
