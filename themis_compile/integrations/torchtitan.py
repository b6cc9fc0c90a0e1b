"""torchtitan: ``parallelize(model, parallel_dims, job_config)``, its ``parallelize_fn`` convention.

torchtitan builds the model on every rank, then calls the model's registered ``parallelize_fn(model,
parallel_dims, job_config)``. Registering this function instead of the model's own (in the model's
``TrainSpec``: ``parallelize_fn=themis_compile.integrations.torchtitan.parallelize``) trains the MoE
model under FSSDP: ``optimize`` shards each expert onto one rank and makes the rest data-parallel,
through FSDP2 when ``parallel_dims`` shards data parallelism (``dp_shard`` = world size, torchtitan's
default) or DDP when it replicates (``dp_replicate`` = world size). In torchtitan's job config:

    [parallelism]
    data_parallel_shard_degree = -1        # or data_parallel_replicate_degree = <world size>
    tensor_parallel_degree = 1             # themis needs no TP, PP, CP or EP: each is refused when > 1
    expert_parallel_degree = 1
    [training]
    max_norm = 0                           # torchtitan clips with torch's local norm: clip with
                                           # themis_compile.clip_grad_norm_ in the train step instead

Activation checkpointing and ``torch.compile`` are the model's own ``parallelize_fn``'s business in
torchtitan and are not applied here (``torch.compile(model, backend="themis")`` after this call
compiles with the themis schedule).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn

from themis_compile.api import optimize
from themis_compile.config import ThemisConfig

__all__ = ["parallelize"]

_UNSUPPORTED = ("tp", "pp", "cp", "ep", "etp")


def parallelize(model: nn.Module, parallel_dims, job_config=None, *, config: ThemisConfig | None = None) -> nn.Module:
    """torchtitan's ``parallelize_fn``: ``themis_compile.optimize`` over the default group, FSDP2 or DDP for
    the dense parameters as ``parallel_dims`` says (see the module docstring). ``job_config`` is accepted
    for the convention's sake; ``config`` is the :class:`ThemisConfig` (its ``dense_parallel`` is set from
    ``parallel_dims``)."""
    del job_config
    degrees = {name: int(getattr(parallel_dims, name, 1) or 1) for name in _UNSUPPORTED}
    refused = {name: d for name, d in degrees.items() if d > 1}
    if refused:
        raise NotImplementedError(f"themis_compile.integrations.torchtitan.parallelize: {refused} > 1 is not "
                                  f"supported; themis shards experts over the data-parallel ranks: set those degrees "
                                  f"to 1")
    world = dist.get_world_size() if dist.is_initialized() else 1
    replicate, shard = int(parallel_dims.dp_replicate), int(parallel_dims.dp_shard)
    if replicate > 1 and shard > 1:
        raise NotImplementedError(f"themis_compile.integrations.torchtitan.parallelize: HSDP (dp_replicate "
                                  f"{replicate} x dp_shard {shard}) is not supported; use dp_shard = {world} (FSDP2) "
                                  f"or dp_replicate = {world} (DDP)")
    if max(replicate, shard) != world:
        raise ValueError(f"themis_compile.integrations.torchtitan.parallelize: data parallelism over "
                         f"{max(replicate, shard)} of {world} ranks; themis needs all of them")
    config = dataclasses.replace(config or ThemisConfig(), dense_parallel="ddp" if replicate > 1 else "fsdp2")
    return optimize(model, config)
