"""What the Lightning / torchtitan test's ranks run: the tiny HF Mixtral trained through each stack's
parallelize function, in the equivalence tests' loop (each rank a slice of every global batch)."""

from __future__ import annotations

import dataclasses

import torch

from tests.runtime.equivalence import LR, _batches, global_losses, make_model, model_loss
from themis_compile.api import runtime_of

MIXTRAL = dict(hf="mixtral", num_experts=4)
STEPS, BATCH, SEQ = 4, 4, 16


@dataclasses.dataclass
class ParallelDims:
    """The fields of torchtitan's ``ParallelDims`` that a ``parallelize_fn`` reads (torchtitan itself is
    not installable here)."""
    dp_replicate: int
    dp_shard: int
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    world_size: int = 1


def _result(model, losses):
    from tests.runtime.equivalence import _dense_params

    owned = {(li, e): [t.detach().clone() for t in chunk]
             for li, experts in enumerate(runtime_of(model).layers.values())
             for e, chunk in experts.local_chunks().items()}
    return losses, _dense_params(model), owned, None


def _train(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches(STEPS, BATCH, SEQ, model.config.vocab_size)
    return global_losses(model, opt, batches, model_loss)


def stacks(rank: int, world_size: int) -> dict:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    from themis_compile.integrations import lightning, torchtitan

    out = {}
    strategy = ModelParallelStrategy(parallelize_fn=lightning.parallelize, data_parallel_size=world_size,
                                     tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    module = fabric.setup_module(make_model(MIXTRAL))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=LR))
    losses = []
    for tokens in _batches(STEPS, BATCH, SEQ, 128):
        local = BATCH // world_size
        loss = model_loss(module, tokens[rank * local:(rank + 1) * local])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world_size)
    out["fabric"] = _result(module.module, losses), type(module.module).__name__, runtime_of(module.module).dense_parallel

    model = torchtitan.parallelize(make_model(MIXTRAL), ParallelDims(dp_replicate=world_size, dp_shard=1,
                                                                     world_size=world_size), None)
    out["torchtitan"] = _result(model, _train(model)), runtime_of(model).dense_parallel

    refusals = []
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("data_parallel", "tensor_parallel"))
    for attempt in (lambda: lightning.parallelize(make_model(MIXTRAL), mesh),
                    lambda: torchtitan.parallelize(make_model(MIXTRAL), ParallelDims(1, world_size // 2, tp=2,
                                                                                     world_size=world_size)),
                    lambda: torchtitan.parallelize(make_model(MIXTRAL), ParallelDims(1, 1, world_size=world_size))):
        try:
            attempt()
            refusals.append(None)
        except (ValueError, NotImplementedError) as e:
            refusals.append(str(e))
    out["refusals"] = refusals
    return out
