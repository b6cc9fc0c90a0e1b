"""The whole trained model out of an optimized one: its full state dict, and a Hugging Face checkpoint.

    from themis_compile.checkpoint import full_state_dict, save_pretrained

    sd = full_state_dict(model)                 # collective; rank 0 gets every key of the unmodified model
    save_pretrained(model, "runs/export")       # collective; rank 0 writes what from_pretrained loads

An optimized model's ``state_dict()`` is a rank's view: dense parameters as FSDP2's ``DTensor`` shards (or
DDP's replicas), experts of a stacked ``[E, ...]`` weight as one ``ShardedTensor`` whose chunks lie on the
experts' owners, and experts of an ``nn.ModuleList`` under their own keys on their owner only.
`full_state_dict` turns that view into the unmodified model's state dict of plain tensors:

1. every rank lists the plain tensors it holds (key, shape, dtype) and the lists are exchanged: a key every
   rank holds is a replica (DDP's dense parameters, buffers) and is taken as it is; a key one rank holds
   is that rank's expert and travels from it;
2. a ``DTensor`` is all-gathered (FSDP2's dense parameters); a ``ShardedTensor`` is assembled from its
   chunks, each sent by the rank that holds it;
3. keys come out in the unmodified model's order (``model.state_dict()`` order on the rank that holds the
   most keys, experts placed as their owners list them).

Every transfer goes through the runtime's deadline collectives, so a rank that stops exporting makes the
others fail naming the exchange and the missing rank. Peak memory on a receiving rank is the full model
plus one tensor in flight.

*No partial state dict without an error.* At more than one rank, ``model.state_dict()`` of an optimized
model raises, naming what to call instead: a rank's view misses other ranks' ModuleList experts, and
torch's full-state-dict path (``get_model_state_dict(..., full_state_dict=True)``), which assembles
``ShardedTensor``s from dim-0 chunks in rank order, would put stacked experts in the wrong rows once
re-sharding has moved them. The view is given where it is what the caller needs: torch's sharded DCP
state-dict functions, and this package's own (`rank_view`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Shard

from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import collective_device
from themis_compile.runtime.registry import ThemisRuntime

__all__ = ["full_state_dict", "gather_view", "save_pretrained", "guard_state_dict", "bind_save_pretrained", "rank_view"]

_PURPOSE = "full state dict"
_RANK_VIEW = contextvars.ContextVar("themis_rank_view", default=False)


@contextlib.contextmanager
def rank_view():
    """Within it, ``model.state_dict()`` of an optimized model gives this rank's view without raising
    (what DCP saves and loads: every key is written by the rank that holds it)."""
    token = _RANK_VIEW.set(True)
    try:
        yield
    finally:
        _RANK_VIEW.reset(token)


def _torch_sharded_call() -> bool:
    """Whether ``state_dict()`` runs inside torch's ``get_model_state_dict`` / ``set_model_state_dict`` (and
    the ``get_state_dict`` / ``set_state_dict`` built on them) with sharded options: DCP's view, which is
    right as it is. With ``full_state_dict`` / ``broadcast_from_rank0`` torch would gather it wrongly."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _TORCH_STATE_DICT and frame.f_code.co_name in _TORCH_CALLERS:
            info = frame.f_locals.get("info")
            return info is not None and not info.full_state_dict and not info.broadcast_from_rank0
        frame = frame.f_back
    return False


_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_TORCH_CALLERS = ("_get_model_state_dict", "_load_model_state_dict")


def guard_state_dict(model: nn.Module) -> None:
    """Make ``model.state_dict()`` of an optimized model at more than one rank raise, except where its rank
    view is what the caller needs (`rank_view`, torch's sharded DCP state-dict functions); called by
    ``optimize``.

    A rank's view is no state dict of the model: ModuleList experts are listed only on their owner, and
    torch's full-state-dict path, which assumes dim-0 shards in rank order, would assemble stacked experts
    in the wrong order once re-sharding has moved them."""
    def check(module: nn.Module, state_dict, prefix: str, local_metadata) -> None:
        runtime = getattr(model, "_themis_runtime", None)
        if _RANK_VIEW.get() or runtime is None or runtime.world_size <= 1 or _torch_sharded_call():
            return
        raise RuntimeError(
            f"themis_compile: state_dict() of this optimized model is rank {runtime.rank}'s view only (each expert "
            f"lives on one of {runtime.world_size} ranks; the dense parameters are {runtime.config.dense_parallel}'s). "
            f"For the whole model call themis_compile.checkpoint.full_state_dict(model) or "
            f"themis_compile.checkpoint.save_pretrained(model, dir) on every rank (or "
            f"themis_compile.checkpoint.get_state_dict with StateDictOptions(full_state_dict=True)); for a "
            f"sharded checkpoint themis_compile.checkpoint.get_state_dict with torch.distributed.checkpoint.save.")

    model.register_state_dict_post_hook(check)


def _local_state_dict(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from themis_compile.passes.parallel_lists import internal_keys, to_user_keys

    with rank_view(), internal_keys():
        # torch's function: the unmodified names (no torch.compile or wrapper prefixes), this rank's view.
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False, cpu_offload=False))
    to_user_keys(model, sd)             # experts of parallel lists under the user's keys
    return sd


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The unmodified model's full state dict (plain tensors, its keys and shapes) of an optimized model.

    Collective: every rank of the model's group calls it. ``rank0_only``: ranks other than 0 return ``{}``
    (they still send what they hold); otherwise every rank gets the whole dict. ``cpu_offload``: the
    tensors on the CPU. On a model ``optimize`` did not distribute, its own state dict (detached copies).
    """
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None or runtime.world_size <= 1 or not dist.is_initialized():
        with rank_view():
            sd = model.state_dict()
        return {k: _plain(v, cpu_offload) for k, v in sd.items()}
    return gather_view(_local_state_dict(model), runtime, rank0_only=rank0_only, cpu_offload=cpu_offload)


def gather_view(local: dict[str, Any], runtime: ThemisRuntime, *, rank0_only: bool, cpu_offload: bool,
                what: str = _PURPOSE) -> dict[str, Any]:
    """Every rank's view of a flat state dict (the model's, or a flattened optimizer state dict) -> the
    whole dict, on rank 0 (``rank0_only``) or on every rank. Collective."""
    group, timeout_s = runtime.group, runtime.config.collective_timeout_s
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    # Per rank: its keys in order, and what each plain entry is (a tensor's shape and dtype, or an object).
    plain = {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else None for k, v in local.items()
             if not isinstance(v, (DTensor, ShardedTensor))}
    views = deadline.all_gather_object((list(local), plain), group=group, timeout_s=timeout_s,
                                       purpose=f"{what}: keys")
    order = _key_order([keys for keys, _ in views])
    receive = me == 0 or not rank0_only
    out: dict[str, Any] = {}
    for key in order:
        holders = [r for r, (_, held) in enumerate(views) if key in held]
        value = local.get(key)
        if isinstance(value, DTensor):
            value = _gather_dtensor(value, group, timeout_s, key)
        elif isinstance(value, ShardedTensor):
            value = _gather_sharded(value, group, ranks, me, receive, rank0_only, timeout_s, key)
        elif len(holders) == len(ranks):
            pass                                   # a replica: DDP's dense parameters, buffers, scalars
        elif len(holders) == 1 and views[holders[0]][1][key] is None:
            value = deadline.broadcast_object(value, holders[0], group=group, timeout_s=timeout_s,
                                              purpose=f"{what}: {key}")
        elif len(holders) == 1:
            value = _from_holder(value, views[holders[0]][1][key], holders[0], group, ranks, me, receive,
                                 rank0_only, timeout_s, key)
        else:
            raise RuntimeError(f"themis_compile: {what}: {key!r} is held by ranks {holders} of {len(ranks)}: "
                               f"neither a replica nor one owner's expert")
        if receive:
            out[key] = _plain(value, cpu_offload)
    return out


def _key_order(views: list[list[str]]) -> list[str]:
    """All keys of the ranks' views in the unmodified model's order: the keys as a tree of their dotted
    parts, each node's children in the order they first appear (the longest view first), except that
    numbered children (a list's entries: ``experts.5`` owned by one rank, ``experts.0`` by another) go by
    number."""
    tree: dict = {}
    for view in sorted(views, key=len, reverse=True):
        for key in view:
            node = tree
            for part in key.split("."):
                node = node.setdefault(part, {})
            node[None] = key                    # a key may also be the prefix of others
    out: list[str] = []

    def walk(node: dict) -> None:
        if None in node:
            out.append(node[None])
        children = [c for c in node if c is not None]
        if children and all(c.isdigit() for c in children):
            children.sort(key=int)
        for c in children:
            walk(node[c])

    walk(tree)
    return out


def _plain(t: Any, cpu_offload: bool) -> Any:
    if not torch.is_tensor(t):
        return t
    t = t.detach()
    return t.cpu().clone() if cpu_offload else t.clone()


def _gather_dtensor(value: DTensor, group, timeout_s: float, key: str) -> torch.Tensor:
    """FSDP2's ``Shard(0)`` over a 1-D mesh through the deadline all-gather; any other layout through
    torch's ``full_tensor``."""
    mesh = value.device_mesh
    if mesh.ndim != 1 or value.placements != (Shard(0),):
        return value.full_tensor()
    world = mesh.size()
    shape = tuple(value.shape)
    sizes = [len(c) for c in torch.empty(shape[0], device="meta").chunk(world)]
    sizes += [0] * (world - len(sizes))
    local = value.to_local()
    rows = max(sizes)
    padded = local.new_zeros((rows, *shape[1:]))
    padded[:local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    deadline.all_gather(parts, padded, group=mesh.get_group(), timeout_s=timeout_s, purpose=_PURPOSE, layer=key)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _transfer(buf: torch.Tensor, src: int, group, ranks: list[int], me: int, rank0_only: bool, timeout_s: float,
              key: str) -> None:
    """``buf`` from group rank ``src`` to rank 0 (``rank0_only``) or to every rank."""
    if not rank0_only:
        deadline.broadcast(buf, ranks[src], group=group, timeout_s=timeout_s, purpose=_PURPOSE, layer=key)
    elif src == 0:
        return
    elif me == src:
        deadline.send(buf.contiguous(), ranks[0], group=group, timeout_s=timeout_s, purpose=f"{_PURPOSE}: {key}")
    elif me == 0:
        deadline.recv(buf, ranks[src], group=group, timeout_s=timeout_s, purpose=f"{_PURPOSE}: {key}")


def _from_holder(value, spec, src: int, group, ranks, me: int, receive: bool, rank0_only: bool, timeout_s: float,
                 key: str):
    """One owner's tensor (an expert of a ModuleList) on the receiving ranks."""
    shape, dtype = spec
    if me == src:
        buf = value.detach()
    elif receive:
        buf = torch.empty(shape, dtype=dtype, device=collective_device(group))
    else:
        return None
    _transfer(buf, src, group, ranks, me, rank0_only, timeout_s, key)
    return buf if receive else None


def _gather_sharded(value: ShardedTensor, group, ranks: list[int], me: int, receive: bool, rank0_only: bool,
                    timeout_s: float, key: str):
    """A ``ShardedTensor`` assembled chunk by chunk, each chunk from the rank its metadata places it on."""
    md = value.metadata()
    local = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
    device = collective_device(group)
    full = torch.empty(tuple(md.size), dtype=md.tensor_properties.dtype, device=device) if receive else None
    for chunk in md.shards_metadata:
        src = ranks.index(chunk.placement.rank())
        offsets = tuple(chunk.shard_offsets)
        if me == src:
            buf = local[offsets].detach().to(device)
        elif receive:
            buf = torch.empty(tuple(chunk.shard_sizes), dtype=full.dtype, device=device)
        else:
            continue
        _transfer(buf, src, group, ranks, me, rank0_only, timeout_s, key)
        if receive:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shard_sizes))] = buf
    return full


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` of a Hugging Face model after ``optimize``:
    rank 0 writes the whole trained model (safetensors and config), which ``from_pretrained`` loads into
    the unmodified class; a model that is not an HF ``PreTrainedModel`` is written as ``model.pt`` (a
    ``torch.save`` of the full state dict). Collective: every rank calls it."""
    if "state_dict" in kwargs:
        raise TypeError("themis_compile.checkpoint.save_pretrained gathers the model's state dict itself; "
                        "state_dict= cannot be given")
    kwargs.pop("is_main_process", None)          # rank 0 writes, whatever the caller's process
    sd = full_state_dict(model, rank0_only=True, cpu_offload=True)
    runtime = getattr(model, "_themis_runtime", None)
    distributed = runtime is not None and runtime.world_size > 1 and dist.is_initialized()
    unwrapped = getattr(model, "_orig_mod", model)       # torch.compile's wrapper
    save = getattr(type(unwrapped), "save_pretrained", None)
    if not distributed or dist.get_rank(runtime.group) == 0:
        os.makedirs(save_directory, exist_ok=True)
        if save is not None:
            with rank_view():
                save(unwrapped, save_directory, state_dict=sd, is_main_process=True, **kwargs)
        else:
            torch.save(sd, os.path.join(save_directory, "model.pt"))
    if distributed:
        deadline.barrier(group=runtime.group, timeout_s=runtime.config.collective_timeout_s,
                         purpose="save_pretrained: rank 0 writes")


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir, ...)`` of an optimized HF model `save_pretrained` (called by
    ``optimize``): HF's own would write ``state_dict()``, which on a rank is not the whole model."""
    target = getattr(model, "_orig_mod", model)
    if callable(getattr(type(target), "save_pretrained", None)):
        target.save_pretrained = types.MethodType(save_pretrained, target)
