"""Lightning: a ``parallelize_fn`` for ``ModelParallelStrategy``.

Fabric::

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from themis_compile.integrations.lightning import parallelize

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=N, tensor_parallel_size=1)
    fabric = Fabric(strategy=strategy, devices=N)
    fabric.launch()
    model = fabric.setup_module(model)                     # optimize(model) over the data-parallel mesh
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    ...
    fabric.backward(loss)
    themis.clip_grad_norm_(model.parameters(), 1.0)        # not fabric.clip_gradients: torch's local norm

PyTorch Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` has no
``parallelize_fn`` argument: call ``self.model = parallelize(self.model, self.device_mesh)`` in the
LightningModule's ``configure_model`` and clip in ``configure_gradient_clipping`` with
``themis.clip_grad_norm_``.

Themis shards experts over the data-parallel ranks and needs no tensor parallelism: a mesh with a
``tensor_parallel`` dimension larger than one is refused (the strategy's default ``"auto"`` puts every
rank there). The other strategies wrap the model (``DDPStrategy`` in DDP, ``FSDPStrategy`` in FSDP), which
an optimized model refuses on every rank.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch import nn

from themis_compile.api import optimize
from themis_compile.config import ThemisConfig

__all__ = ["make_parallelize_fn", "parallelize"]


def parallelize(model: nn.Module, device_mesh, *, config: ThemisConfig | None = None, **optimize_kwargs) -> nn.Module:
    """``parallelize_fn(model, device_mesh) -> model``: ``themis_compile.optimize(model, config)`` over the
    mesh's ``data_parallel`` dimension (or the whole mesh when it is one-dimensional without that name)."""
    names = device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(f"themis_compile.integrations.lightning.parallelize: the device mesh has tensor_parallel size "
                         f"{device_mesh['tensor_parallel'].size()}; themis shards experts over data-parallel ranks "
                         f"only: use ModelParallelStrategy(parallelize_fn=..., data_parallel_size=<world size>, "
                         f"tensor_parallel_size=1)")
    mesh = device_mesh["data_parallel"] if "data_parallel" in names else device_mesh
    if mesh.ndim != 1 or mesh.size() != dist.get_world_size():
        raise ValueError(f"themis_compile.integrations.lightning.parallelize: needs a one-dimensional data-parallel "
                         f"mesh over all {dist.get_world_size()} ranks, got {device_mesh}")
    return optimize(model, config, group=mesh, **optimize_kwargs)


def make_parallelize_fn(config: ThemisConfig | None = None, **optimize_kwargs):
    """:func:`parallelize` with a :class:`ThemisConfig` (and more ``optimize`` arguments) bound."""
    return functools.partial(parallelize, config=config, **optimize_kwargs)
