"""Gradient-norm clipping for an optimized model: one global norm, the same on every rank.

``torch.nn.utils.clip_grad_norm_`` computes the norm of the gradients this process holds. After
``optimize`` that is not the norm of the model's gradient:

- the dense gradients are data-parallel: under FSDP2 they are DTensor shards, under DDP plain tensors
  that hold the same all-reduced values on every rank;
- each expert's gradient exists on one rank only, its owner (after the SparseReduceScatter of FSSDP, or
  because EP computes it there), as a plain tensor.

So under FSDP2 torch's ``_foreach_norm`` refuses the list that mixes DTensors and plain tensors, and under
DDP each rank leaves out the experts it does not own: ranks compute different norms and clip by different
factors, and the training is no longer that of one process. :func:`clip_grad_norm_` sums each kind where
it lives:

    norm^p = ||dense plain||^p                  local: identical on every rank, counted once
           + sum over meshes ||dense DTensor||^p   torch's DTensor norm, reduced over its mesh
           + sum over groups allreduce_SUM(||owned experts||^p)    each expert counted by its owner
    (p = inf: max instead of sum, allreduce_MAX)

then multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``, as torch does. Which parameters
are experts, and over which process group their owners add up, comes from the themis runtime of each
optimized model (`ThemisRuntime.layers`); parameters of no optimized model keep torch's semantics (a
local norm).

Contract: collective over the group of every optimized model one of whose parameters is passed (dense
ones included, so a rank that owns no expert still joins); every rank passes the same models'
parameters, in the same order.
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from themis_compile.runtime.collectives import collective_device
from themis_compile.runtime.registry import optimized_models, runtime_of

__all__ = ["clip_grad_norm_"]


def _expert_groups(params: list[torch.Tensor], model: nn.Module | None) -> list[tuple[Any, set[int]]]:
    """(process group, ids of this rank's expert parameters) of every optimized model that ``params``
    touch, ordered by the first parameter of each model in ``params`` (the same order on every rank)."""
    if model is not None:
        models = [model] if getattr(model, "_themis_runtime", None) is not None else []
    else:
        position = {id(p): i for i, p in reversed(list(enumerate(params)))}
        first = {}
        for m in optimized_models():
            hits = [position[id(p)] for p in m.parameters() if id(p) in position]
            if hits:
                first[min(hits)] = m
        models = [first[i] for i in sorted(first)]
    out: list[tuple[Any, set[int]]] = []
    for m in models:
        runtime = runtime_of(m)
        if runtime.world_size == 1:
            continue     # one process: its experts are local tensors like any other
        ids = {id(p) for layer in runtime.layers.values() for p in layer.expert_parameters()}
        for group, known in out:
            if group is runtime.group:
                known |= ids
                break
        else:
            out.append((runtime.group, ids))
    return out


def _upcast(norm: torch.Tensor) -> torch.Tensor:
    return norm.to(torch.float32 if norm.dtype in (torch.float16, torch.bfloat16) else norm.dtype)


def _local_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if isinstance(norm, DTensor):      # reduced over the DTensors' mesh
        norm = norm.full_tensor()
    return _upcast(norm)


def _dtensor_norm(grads: list[DTensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The norm of DTensor gradients on one mesh. The inf-norm is each rank's largest magnitude, maxed
    over the mesh (right for sharded and replicated placements alike): torch's foreach norm refuses it
    on the empty shards FSDP2 leaves on some ranks when a tensor has fewer rows than the mesh has ranks."""
    if not math.isinf(norm_type):
        return _local_norm(grads, norm_type, foreach)
    if any(p.is_partial() for g in grads for p in g.placements):
        raise ValueError("clip_grad_norm_: the inf-norm of a DTensor gradient with a Partial placement")
    mesh = grads[0].device_mesh
    locals_ = [g.to_local() for g in grads]
    local = torch.zeros((), dtype=torch.promote_types(torch.float32, grads[0].dtype), device=locals_[0].device)
    for t in locals_:
        if t.numel():
            local = torch.maximum(local, t.detach().abs().amax().to(local.dtype))
    for dim in range(mesh.ndim):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return local


def _reduced_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None, group) -> torch.Tensor:
    """The norm of the gradients every rank of ``group`` holds a disjoint part of."""
    local = _local_norm(grads, norm_type, foreach).to(collective_device(group))
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    power = local.pow(norm_type)
    dist.all_reduce(power, op=dist.ReduceOp.SUM, group=group)
    return power.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models ``optimize`` rewrote: the norm of the whole model's
    gradient, equal on every rank to one process's, and every gradient clipped by the same factor.

    Args:
        parameters: an iterable of parameters, a single tensor, or the (optimized) model itself.
        max_norm: the largest norm the gradients keep.
        norm_type: p of the p-norm, > 0; ``float("inf")`` (or ``"inf"``) for the largest absolute value.
        error_if_nonfinite: raise (on every rank) if the total norm is nan or inf.
        foreach: use torch's foreach kernels; ``None`` picks them where supported.

    Returns:
        The total norm of the gradients, a 0-dim tensor (float32 or wider), the same on every rank.
    """
    model = parameters if isinstance(parameters, nn.Module) else None
    if model is not None:
        params = list(model.parameters())
    elif isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")

    # Step 1: sort the gradients by where their norm is complete: experts per group, DTensors per mesh,
    # plain dense tensors here.
    groups = _expert_groups(params, model)
    experts: list[list[torch.Tensor]] = [[] for _ in groups]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    local: list[torch.Tensor] = []
    with_grad = [p for p in params if p.grad is not None]
    for p in with_grad:
        g = p.grad
        if isinstance(g, DTensor):
            by_mesh.setdefault(g.device_mesh, []).append(p)
            continue
        for i, (_, ids) in enumerate(groups):
            if id(p) in ids:
                experts[i].append(p)
                break
        else:
            local.append(p)

    # Step 2: one norm per part, then the norm of the norms (what torch computes over all tensors).
    grads = lambda ps: [p.grad for p in ps]  # noqa: E731
    device = with_grad[0].grad.device if with_grad else (collective_device(groups[0][0]) if groups else
                                                         torch.device("cpu"))
    norms = [_local_norm(grads(local), norm_type, foreach)]
    norms += [_dtensor_norm(grads(ps), norm_type, foreach) for ps in by_mesh.values()]
    norms += [_reduced_norm(grads(ps), norm_type, foreach, group) for ps, (group, _) in zip(experts, groups)]
    dtype = norms[0].dtype
    for n in norms[1:]:
        dtype = torch.promote_types(dtype, n.dtype)
    total = torch.linalg.vector_norm(torch.stack([n.to(device, dtype) for n in norms]), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")

    # Step 3: the same factor for every gradient, applied per kind (torch's foreach kernels refuse a list
    # that mixes DTensors and plain tensors).
    for ps in (local, *by_mesh.values(), *experts):
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach)
    return total
