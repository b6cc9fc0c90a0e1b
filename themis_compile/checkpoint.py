"""Checkpoints of optimized models in the unmodified model's keys and shapes, through
``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from themis_compile.checkpoint import get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)           # save
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)           # resume
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)

``get_state_dict`` / ``set_state_dict`` have the signatures of torch's
``torch.distributed.checkpoint.state_dict`` functions and call them; on a model that ``optimize`` did not
touch they are torch's. On an optimized model they add what torch's cannot do:

- *Stacked experts' optimizer state.* A stacked ``[E, ...]`` weight (``gate_up_proj`` of HF transformers
  v5), or a flat ``[E * F, ...]`` one (HF DBRX's ``w1``: each expert's rows at offset ``e * F``), is held as
  per-expert parameters, so torch's functions see one optimizer state per owned expert
  under internal names. They are merged here into the unmodified weight's entry: each tensor of the
  parameter's shape becomes a ``ShardedTensor`` of the global shape with one chunk per owned expert at its
  global offset (the model state dict already does this for the weights themselves), shared scalars
  (Adam's ``step``) stay one value. Experts given as an ``nn.ModuleList`` need nothing: their parameters
  already carry the unmodified names, so torch's own functions give the same result.
- *The runtime's state* under :data:`RUNTIME_STATE_KEY` of the optimizer state dict (one JSON string):
  per FSSDP layer the load-predictor window, the iteration counter and the shard placement, and the
  re-sharding schedule. ``set_state_dict`` restores them after the tensors: at the same world size the
  experts then move (parameters and optimizer state, as re-sharding moves them) to the saved placement,
  so that a resumed run is the uninterrupted one bit for bit; at another world size the tensors stay in
  the loading run's own placement and the predictor windows and the schedule still carry over.
- *Experts the optimizer has not stepped yet.* An expert that no token has reached since training began
  (its layer's experts module runs only the experts that receive tokens) has no optimizer state, as in
  one process; torch's functions would leave it out of the checkpoint, and loading into a fresh optimizer
  (which torch gives state for every parameter) would then miss its keys. Under Adam / AdamW it is
  given the state those optimizers create lazily on an expert's first step (``step`` 0, zero moments),
  which trains the same as no state; under other optimizers ``get_state_dict`` raises naming the experts.
- *Param groups that name every rank's parameters.* An unflattened optimizer state dict's groups list the
  parameters of all ranks (one gather of the lists), so that the one copy DCP writes of each list names
  every rank's experts: an optimizer whose experts have a group of their own (HF Trainer's under FSDP2,
  which groups plain tensors apart from DTensors) resumes with that group's hyperparameters on every rank.
- *No re-sharding inside the state-dict calls.* torch's functions create missing optimizer state with a
  zero-lr ``step()``; the re-sharding schedule does not count it.

Every expert's parameters and optimizer state are written once, by their current owner, whatever
placement re-sharding produced; DCP re-shards on load by chunk offsets, so a checkpoint saved at N ranks
loads at M ranks, under another policy, or into the unmodified model (``dcp_to_torch_save``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import state_dict as _dsd

from themis_compile.export import _key_order, full_state_dict, gather_view, rank_view, save_pretrained
from themis_compile.passes.parallel_lists import internal_keys, to_user_keys, user_key
from themis_compile.planner import Placement
from themis_compile.runtime import deadline
from themis_compile.runtime.ep import (ShardedExperts, expert_sharded_tensor, expert_slice, leading_rows,
                                       zero_rows_sharded_tensor)
from themis_compile.runtime.experts import ZERO_ROWS_CHILD, zero_rows_of
from themis_compile.runtime.fssdp import FSSDPExperts
from themis_compile.runtime.registry import ThemisRuntime
from themis_compile.runtime.reshard import move_experts

logger = logging.getLogger(__name__)

__all__ = ["get_state_dict", "set_state_dict", "runtime_state_dict", "load_runtime_state_dict",
           "full_state_dict", "save_pretrained", "RUNTIME_STATE_KEY"]

RUNTIME_STATE_KEY = "themis_runtime"
_STATE, _PG, _PARAMS = "state", "param_groups", "params"


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: _dsd.StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` for optimized models: the model and
    optimizer state dicts in the unmodified model's keys and full shapes, plus the runtime's state."""
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None:
        return _dsd.get_state_dict(model, optimizers, submodules=submodules, options=options)
    full = options is not None and options.full_state_dict and runtime.world_size > 1
    if full:
        if optimizers and not options.flatten_optimizer_state_dict:
            raise NotImplementedError(
                "themis_compile.checkpoint.get_state_dict: a full optimizer state dict of an optimized model "
                "needs StateDictOptions(flatten_optimizer_state_dict=True) (its keys name parameters, so the "
                "ranks' experts merge); the full model alone: pass optimizers=()")
        if submodules is not None:
            raise NotImplementedError("themis_compile.checkpoint.get_state_dict: full_state_dict with submodules")
        full_options, options = options, dataclasses.replace(options, full_state_dict=False, cpu_offload=False)
    _check_options(runtime, options)
    optimizers = _as_tuple(optimizers)
    for optimizer in optimizers:
        _initial_state_of_unstepped_experts(runtime, optimizer)
    with _schedule_paused(runtime), rank_view(), internal_keys():
        model_sd, optim_sd = _dsd.get_state_dict(model, optimizers, submodules=submodules, options=options)
    _parallel_lists_keys(model, model_sd, optim_sd, loading=False)
    if optimizers:
        _stack_optimizer_state(optim_sd, _stacked_layers(model, runtime), runtime.config.collective_timeout_s)
        _param_groups_of_every_rank(optim_sd, runtime)
        optim_sd[RUNTIME_STATE_KEY] = json.dumps(runtime_state_dict(model))
    if full:
        # As torch's full state dicts: on every rank, or with cpu_offload on rank 0 only (``{}`` elsewhere).
        gather = dict(runtime=runtime, rank0_only=full_options.cpu_offload, cpu_offload=full_options.cpu_offload)
        model_sd = gather_view(model_sd, **gather)
        optim_sd = gather_view(optim_sd, what="full optimizer state dict", **gather) if optimizers else {}
    return model_sd, optim_sd


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: _dsd.StateDictOptions | None = None,
):
    """``torch.distributed.checkpoint.state_dict.set_state_dict`` for optimized models: loads state dicts
    in the unmodified model's keys (what this module's ``get_state_dict`` gave and ``dcp.load`` filled,
    from a checkpoint of any world size and policy or of the unmodified model) into the experts this rank
    owns, then restores the runtime's state when ``optim_state_dict`` carries it (see the module
    docstring)."""
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None:
        return _dsd.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                   optim_state_dict=optim_state_dict, options=options)
    _check_options(runtime, options)
    optimizers = _as_tuple(optimizers)
    runtime_state = None
    if optim_state_dict:
        optim_state_dict = _shallow_copy(optim_state_dict)
        runtime_state = optim_state_dict.pop(RUNTIME_STATE_KEY, None)
        _unstack_optimizer_state(optim_state_dict, _stacked_layers(model, runtime))
    model_state_dict = dict(model_state_dict)
    _parallel_lists_keys(model, model_state_dict, optim_state_dict, loading=True)
    with _schedule_paused(runtime), rank_view(), internal_keys():
        result = _dsd.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                     optim_state_dict=optim_state_dict, options=options)
    if runtime_state is not None:
        load_runtime_state_dict(model, optimizers, runtime_state)
    return result


# ---------------------------------------------------------------------------------- unstepped experts
_LAZY_ZERO_STATE = (torch.optim.Adam, torch.optim.AdamW)


def _initial_state_of_unstepped_experts(runtime: ThemisRuntime, optimizer: torch.optim.Optimizer) -> None:
    """Give owned trainable experts of ``optimizer`` without state the state Adam / AdamW create on a
    first step (``step`` 0, zero moments: the same training as no state), so that the checkpoint holds
    every expert's keys; raise for other optimizers (their first-step state is not zeros in general)."""
    state = optimizer.state
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [(name, e, p) for name, layer in runtime.layers.items() for e, chunk in layer.local_chunks().items()
               for p in chunk if id(p) in params and p.requires_grad and not state.get(p)]
    if not missing:
        return
    ref = next((v for g in optimizer.param_groups for q in g["params"] if (v := state.get(q))), None)
    if ref is None:
        return      # nothing stepped yet: torch's functions create every parameter's state alike
    if not isinstance(optimizer, _LAZY_ZERO_STATE):
        experts = sorted({f"{name}[{e}]" for name, e, _ in missing})
        raise RuntimeError(f"checkpoint: experts {experts} have no {type(optimizer).__name__} state yet (no token "
                           "reached them since training began); only Adam and AdamW, whose first-step state "
                           "is zeros, can be given one for the checkpoint")
    for _, _, p in missing:
        state[p] = {k: (torch.zeros_like(v) if v.dim() == 0 else torch.zeros_like(p, memory_format=torch.preserve_format))
                    if torch.is_tensor(v) else 0 if isinstance(v, (int, float)) else v for k, v in ref.items()}


# ---------------------------------------------------------------------------------- the runtime's state
def runtime_state_dict(model: nn.Module) -> dict[str, Any]:
    """What a resumed run needs to continue exactly (plain Python values, the same on every rank): per
    FSSDP layer its iteration counter, load-predictor window (oldest first) and shard placement as its
    owners [E] (checkpoints written before kept the [E][D] matrix as ``shard_placement``; both load);
    the re-sharding schedule; the world size and policy they belong to."""
    runtime = _runtime(model)
    layers = {}
    for name, layer in runtime.layers.items():
        if isinstance(layer, FSSDPExperts):
            layers[name] = {
                "iteration": int(layer.iteration),
                "load_history": layer.predictor.history(0).tolist(),
                "shard_owners": layer.shard_placement.owners().tolist(),
            }
    scheduler = runtime.reshard_scheduler
    return {"world_size": runtime.world_size, "policy": runtime.config.policy, "layers": layers,
            "reshard_schedule": None if scheduler is None else scheduler.state_dict()}


def load_runtime_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                            state: dict[str, Any] | str) -> int:
    """Restore :func:`runtime_state_dict` after the model's and optimizers' tensors are loaded; returns
    how many experts moved to adopt the saved shard placement (same world size only).

    Collective: every rank calls it with the same ``state``.
    """
    runtime = _runtime(model)
    if isinstance(state, str):
        state = json.loads(state)
    same_world = int(state["world_size"]) == runtime.world_size
    targets: dict[str, Placement] = {}
    for name, saved in state["layers"].items():
        layer = runtime.layers.get(name)
        if layer is None:
            raise ValueError(f"the checkpoint's runtime state names MoE layer {name!r}, which this model does "
                             f"not have (its MoE layers: {list(runtime.layers)})")
        if not isinstance(layer, FSSDPExperts):
            continue     # ep: static contiguous owners, no predictor
        # The predictor's window, replayed oldest first: its predictions depend only on the window.
        layer.predictor.reset()
        for load_E in saved["load_history"]:
            layer.predictor.update(0, np.asarray(load_E, dtype=np.float64))
        layer.iteration = int(saved["iteration"])
        if same_world:
            shard = _saved_shard(saved, layer.shard_placement.shape)
            if shard.shape != layer.shard_placement.shape or not shard.is_shard_placement():
                raise ValueError(f"MoE layer {name!r}: the checkpoint's shard placement {shard.shape} does not "
                                 f"fit this layer ({layer.shard_placement.shape})")
            if shard != layer.shard_placement:
                targets[name] = shard
    moved = 0
    if targets:
        # Every rank holds the same saved state and the same current placements: the same targets.
        moved = move_experts(runtime, _expert_optimizer(runtime, _as_tuple(optimizers)), targets)
        logger.info("themis_compile: adopted the checkpoint's shard placement of %d MoE layers (%d experts "
                    "moved)", len(targets), moved)
    scheduler = runtime.reshard_scheduler
    if scheduler is not None and state.get("reshard_schedule") is not None:
        scheduler.load_state_dict(state["reshard_schedule"])
    return moved


# ---------------------------------------------------------------------------------- stacked experts
class _StackedLayer:
    """One stacked-form sharded experts module and the canonical names of its weights."""

    def __init__(self, prefix: str, module: ShardedExperts) -> None:
        self.module = module
        self.prefix = prefix                      # canonical FQN of the experts module

    def stacked_fqn(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def internal_fqn(self, e: int, name: str) -> str:
        # The owned expert's parameter as torch's functions name it (ExpertShard under child "e").
        return f"{self.prefix}.{e}.{name.replace('.', '__')}"

    def zero_rows_fqn(self, name: str) -> str:
        # This rank's zero-expert rows of weight ``name`` (runtime.experts.ZeroExpertRows).
        return f"{self.prefix}.{ZERO_ROWS_CHILD}.{name.replace('.', '__')}"


def _saved_shard(saved: dict[str, Any], shape: tuple[int, int]) -> Placement:
    """The shard placement a runtime state dict saved: its owners, or the [E][D] matrix of older ones."""
    if "shard_owners" in saved:
        owners_E = np.asarray(saved["shard_owners"], dtype=np.int64)
        if owners_E.ndim != 1 or owners_E.size != shape[0] or (
                owners_E.size and (owners_E.min() < 0 or owners_E.max() >= shape[1])):
            raise ValueError(f"the checkpoint's shard owners {owners_E.shape} do not fit a layer of {shape[0]} "
                             f"experts on {shape[1]} ranks")
        return Placement.from_owners(owners_E, shape[1])
    return Placement(np.asarray(saved["shard_placement"], dtype=bool))


def _stacked_layers(model: nn.Module, runtime: ThemisRuntime) -> list[_StackedLayer]:
    ours = {id(m) for m in runtime.layers.values()}
    out = []
    for path, module in model.named_modules():
        if id(module) in ours and module.bank.form == "stacked":
            fqns = _dsd._get_fqns(model, path)     # without wrapper prefixes (torch.compile's _orig_mod)
            out.append(_StackedLayer(next(iter(fqns)), module))
    return out


def _is_flat(optim_sd: dict) -> bool:
    return not (_STATE in optim_sd and _PG in optim_sd)


def _pop_prefixed(d: dict, prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: d.pop(k) for k in [k for k in d if k.startswith(prefix)]}


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def _stack_optimizer_state(optim_sd: dict, layers: list[_StackedLayer], timeout_s: float) -> None:
    """Per-expert optimizer entries of stacked weights -> one entry per unmodified weight (in place).

    A frozen expert (its tensor of the weight does not require grad) has no optimizer state; its chunk
    of each stacked state tensor is written as zeros (the state of a slice that never had a gradient),
    shared values (Adam's ``step``) as the weight's trained experts have them. What the state holds is
    known from the experts that have some: on this rank, or, where every expert this rank owns of the
    weight is frozen, on another (collective: one gather of those descriptions when the model has stacked
    weights and runs on several ranks).
    """
    flat = _is_flat(optim_sd)
    per_weight = {}
    for layer in layers:
        m = layer.module
        owned = m.owned_experts()
        if not owned and zero_rows_of(m) is not None:
            raise NotImplementedError(f"checkpoint: MoE layer {m.layer!r}: this rank holds zero-expert rows of "
                                      f"{', '.join(m.bank.zero_rows)} but no expert of the layer; its optimizer "
                                      "state cannot be merged into the stacked entry")
        if not owned:
            continue       # the owners write this layer's entries
        for i, name in enumerate(m.bank.names):
            internal = {e: layer.internal_fqn(e, name) for e in owned}
            if flat:
                per_weight[layer.stacked_fqn(name)] = {e: _pop_prefixed(optim_sd, f"{_STATE}.{internal[e]}.")
                                                       for e in owned}
            else:
                per_weight[layer.stacked_fqn(name)] = {e: optim_sd[_STATE].pop(internal[e], None) or {}
                                                       for e in owned}
    templates = _state_templates(layers, per_weight, timeout_s)
    for layer in layers:
        m = layer.module
        owned = m.owned_experts()
        if not owned:
            continue
        for i, name in enumerate(m.bank.names):
            stacked = layer.stacked_fqn(name)
            internal = {e: layer.internal_fqn(e, name) for e in owned}
            # Step 1: the state entries, merged.
            frozen = {e for e in owned if not _expert_param(m, e, name).requires_grad}
            merged = _merge_expert_state(m, stacked, per_weight[stacked], tuple(m.bank.spec[i][0]), frozen,
                                         templates.get(stacked), _expert_param(m, owned[0], name).device)
            if name in m.bank.zero_rows:
                merged = _with_zero_rows_state(optim_sd, layer, name, merged, flat)
            if merged:
                if flat:
                    optim_sd.update({f"{_STATE}.{stacked}.{k}": v for k, v in merged.items()})
                else:
                    optim_sd[_STATE][stacked] = merged
            # Step 2: the param groups name the stacked weight once.
            if flat:
                hyper = {e: _pop_prefixed(optim_sd, f"{_PG}.{internal[e]}.") for e in owned}
                first = hyper[owned[0]]
                for e in owned:
                    if hyper[e].keys() != first.keys() or not all(_same(hyper[e][k], v) for k, v in first.items()):
                        raise RuntimeError(f"{stacked}: experts {owned[0]} and {e} are in param groups with "
                                           "different settings; a stacked weight has one param group")
                optim_sd.update({f"{_PG}.{stacked}.{k}": v for k, v in first.items()})
            else:
                names = set(internal.values())
                groups = [g for g in optim_sd[_PG] if names & set(g[_PARAMS])]
                if len(groups) > 1:
                    raise RuntimeError(f"{stacked}: owned experts are in {len(groups)} param groups; a stacked "
                                       "weight has one param group")
                for g in groups:
                    params = [p for p in g[_PARAMS] if p not in names]
                    params.insert([j for j, p in enumerate(g[_PARAMS]) if p in names][0], stacked)
                    g[_PARAMS] = params


def _with_zero_rows_state(optim_sd: dict, layer: _StackedLayer, name: str, merged: dict, flat: bool) -> dict:
    """The merged ``[E, ...]`` state of a weight that holds zero-expert rows, extended by the state of the
    rows this rank holds (popped from ``optim_sd``, param groups included) to the user's ``[E + Z, ...]``:
    its tensors join as the rows' chunks, its scalars (Adam's ``step``) must equal the experts'."""
    m = layer.module
    fqn = layer.zero_rows_fqn(name)
    stacked = layer.stacked_fqn(name)
    if flat:
        rows_state = _pop_prefixed(optim_sd, f"{_STATE}.{fqn}.")
        _pop_prefixed(optim_sd, f"{_PG}.{fqn}.")
    else:
        rows_state = optim_sd[_STATE].pop(fqn, None) or {}
        for g in optim_sd[_PG]:
            g[_PARAMS] = [p for p in g[_PARAMS] if p != fqn]
    held = zero_rows_of(m) is not None
    if held and merged.keys() != rows_state.keys():
        raise RuntimeError(f"{stacked}: the zero-expert rows' optimizer state {sorted(rows_state)} is not the "
                           f"experts' {sorted(merged)}")
    out = {}
    for k, v in merged.items():
        if isinstance(v, ShardedTensor) or (torch.is_tensor(v) and v.dim() > 0):
            out[k] = zero_rows_sharded_tensor(v, rows_state.get(k), m.num_experts, m.bank.zero_rows[name], m.group,
                                              name=f"{stacked}.{k}")
        else:
            if held and not _same(v, rows_state[k]):
                raise RuntimeError(f"{stacked}: optimizer state {k!r} of the zero-expert rows ({rows_state[k]}) "
                                   f"differs from the experts' ({v}); a stacked weight holds one value")
            out[k] = v
    return out


def _unstack_zero_rows_state(optim_sd: dict, layer: _StackedLayer, name: str, state: dict | None,
                             hyper: dict | None, flat: bool) -> None:
    """The inverse of :func:`_with_zero_rows_state` for the rows this rank holds (in place)."""
    m = layer.module
    rows = zero_rows_of(m)
    if rows is None:
        return
    fqn, stacked = layer.zero_rows_fqn(name), layer.stacked_fqn(name)
    lo, hi = rows.span
    E = m.num_experts

    def value(k, v):
        if isinstance(v, ShardedTensor) or (torch.is_tensor(v) and v.dim() > 0):
            return leading_rows(v, E + lo, E + hi, f"{stacked}.{k}").clone()
        return v.clone() if torch.is_tensor(v) else v

    if flat:
        if rows.rows(name).requires_grad:
            optim_sd.update({f"{_STATE}.{fqn}.{k}": value(k, v) for k, v in (state or {}).items()})
        optim_sd.update({f"{_PG}.{fqn}.{k}": v for k, v in (hyper or {}).items()})
        return
    if state is not None and rows.rows(name).requires_grad:
        optim_sd[_STATE][fqn] = {k: value(k, v) for k, v in state.items()}
    for g in optim_sd[_PG]:
        if stacked in g[_PARAMS]:
            g[_PARAMS] = g[_PARAMS] + [fqn]


def _expert_param(m: ShardedExperts, e: int, name: str) -> torch.Tensor:
    """Owned expert e's tensor of stacked weight ``name``."""
    return dict(m.expert(e).named_parameters())[name.replace(".", "__")]


def _state_templates(layers: list[_StackedLayer], per_weight: dict[str, dict[int, dict]],
                     timeout_s: float) -> dict[str, dict]:
    """Stacked weight -> what its optimizer state holds: ``{key: ("tensor", dtype) | ("value", v)}``, from
    an expert with state here or on another rank (one ``all_gather_object`` over the experts' group when
    there are several ranks: every rank calls it, whatever it owns)."""
    local = {}
    for stacked, states in per_weight.items():
        state = next((s for s in states.values() if s), None)
        if state is not None:
            local[stacked] = {k: ("tensor", v.dtype) if torch.is_tensor(v) and v.dim() > 0 else ("value", v)
                              for k, v in state.items()}
    group = layers[0].module.group if layers else None
    if group is None:
        return local
    gathered = deadline.all_gather_object(local, group=group, timeout_s=timeout_s,
                                          purpose="checkpoint: stacked optimizer-state entries")
    templates = {}
    for other in gathered:
        for stacked, template in other.items():
            templates.setdefault(stacked, template)
    return templates


def _merge_expert_state(m: ShardedExperts, stacked: str, per_expert: dict[int, dict], shape: tuple,
                        frozen: set[int], template: dict | None, device: torch.device) -> dict:
    owned = sorted(per_expert)
    with_state = [e for e in owned if per_expert[e]]
    if template is None:
        return {}      # a stateless optimizer (SGD without momentum), or every expert frozen
    unstepped = sorted(set(owned) - set(with_state))
    if set(unstepped) - frozen:
        raise RuntimeError(f"{stacked}: experts {sorted(set(unstepped) - frozen)} have no optimizer state while "
                           "other experts of the weight have; a stacked weight's trainable experts step together")
    reference = per_expert[with_state[0]] if with_state else None
    for e in unstepped:       # frozen: zeros, and the trained experts' shared values
        per_expert[e] = {k: torch.zeros(shape, dtype=spec[1], device=device) if spec[0] == "tensor"
                         else (reference[k] if reference is not None else spec[1])
                         for k, spec in template.items()}
    keys = per_expert[owned[0]].keys()
    merged = {}
    for k in keys:
        values = {}
        for e in owned:
            if per_expert[e].keys() != keys:
                raise RuntimeError(f"{stacked}: experts {owned[0]} and {e} have different optimizer state entries")
            values[e] = per_expert[e][k]
        v0 = values[owned[0]]
        if torch.is_tensor(v0) and tuple(v0.shape) == shape and v0.dim() > 0:
            merged[k] = expert_sharded_tensor(values, m.shard_placement, (shape, v0.dtype), m.group,
                                              name=f"{stacked}.{k}", flat=m.bank.flat)
        else:
            # Shared by the stacked weight (Adam's step): one value, equal for every trained expert.
            for e in with_state:
                if not _same(values[e], values[with_state[0]]):
                    raise RuntimeError(f"{stacked}: optimizer state {k!r} differs between experts {with_state[0]} "
                                       f"and {e} ({values[with_state[0]]} vs {values[e]}); a stacked weight holds "
                                       "one value")
            merged[k] = values[with_state[0]] if with_state else v0
    return merged


def _expert_value(value, e: int, m: ShardedExperts, shape: tuple, name: str, zero_rows: int = 0):
    if m.bank.flat:
        # A flat weight's state: [E * F, ...], expert e's chunk its rows (shape is one expert's [F, ...]).
        if isinstance(value, ShardedTensor) or (torch.is_tensor(value) and value.dim() == len(shape) > 0
                                                and tuple(value.shape[1:]) == shape[1:]
                                                and value.shape[0] == m.num_experts * shape[0]):
            return expert_slice(value, e, m.num_experts, name, flat_rows=shape[0])
        return value.clone() if torch.is_tensor(value) else value
    if isinstance(value, ShardedTensor) or (torch.is_tensor(value) and tuple(value.shape[1:]) == shape
                                            and value.dim() == len(shape) + 1 and value.dim() > 1):
        # (zero_rows: Z zero-expert rows follow the E experts' in this weight, [E + Z, ...].)
        return expert_slice(value, e, m.num_experts + zero_rows, name)
    # A shared scalar: each expert's parameter gets its own copy (Adam increments step in place).
    return value.clone() if torch.is_tensor(value) else value


def _unstack_optimizer_state(optim_sd: dict, layers: list[_StackedLayer]) -> None:
    """The inverse of :func:`_stack_optimizer_state` for the experts this rank owns (in place); the
    experts frozen in this model get no optimizer state."""
    flat = _is_flat(optim_sd)
    for layer in layers:
        m = layer.module
        owned = m.owned_experts()
        for i, name in enumerate(m.bank.names):
            stacked = layer.stacked_fqn(name)
            shape = tuple(m.bank.spec[i][0])
            internal = {e: layer.internal_fqn(e, name) for e in owned}
            # A frozen expert gets no optimizer state, as in a run that never saved.
            trained = [e for e in owned if _expert_param(m, e, name).requires_grad]
            Z = m.bank.zero_rows.get(name, 0)
            if flat:
                state = _pop_prefixed(optim_sd, f"{_STATE}.{stacked}.")
                hyper = _pop_prefixed(optim_sd, f"{_PG}.{stacked}.")
                for e in owned:
                    if e in trained:
                        optim_sd.update({f"{_STATE}.{internal[e]}.{k}": _expert_value(v, e, m, shape,
                                                                                    f"{stacked}.{k}", Z)
                                         for k, v in state.items()})
                    optim_sd.update({f"{_PG}.{internal[e]}.{k}": v for k, v in hyper.items()})
                if Z:
                    _unstack_zero_rows_state(optim_sd, layer, name, state, hyper, flat)
                continue
            state = optim_sd[_STATE].pop(stacked, None)
            if state is not None:
                for e in trained:
                    optim_sd[_STATE][internal[e]] = {k: _expert_value(v, e, m, shape, f"{stacked}.{k}", Z)
                                                     for k, v in state.items()}
            if Z:
                _unstack_zero_rows_state(optim_sd, layer, name, state, None, flat)
            for g in optim_sd[_PG]:
                if stacked in g[_PARAMS]:
                    j = g[_PARAMS].index(stacked)
                    g[_PARAMS] = g[_PARAMS][:j] + [internal[e] for e in owned] + g[_PARAMS][j + 1:]


# ---------------------------------------------------------------------------------- param groups
def _param_groups_of_every_rank(optim_sd: dict, runtime: ThemisRuntime) -> None:
    """Each param group of an unflattened optimizer state dict lists the parameters of every rank (in the
    unmodified model's order), not only this rank's (in place; collective: one gather of the lists).

    DCP writes a non-tensor value such as a group's ``params`` list once, from one rank, and loads that
    copy on every rank; torch's ``set_state_dict`` gives a loading rank's group the hyperparameters of the
    saved group that lists one of its parameters. A group of a rank's own experts (an optimizer with the
    experts in a group of their own, as HF Trainer builds under FSDP2: plain tensors apart from DTensors)
    lists other experts on every rank: loaded from another rank's list, it matched nothing and came back
    without ``lr`` or ``betas``."""
    if _is_flat(optim_sd) or runtime.world_size <= 1:
        return      # flattened: every parameter has its own ``param_groups.<fqn>.*`` keys
    groups = optim_sd[_PG]
    mine = [list(g[_PARAMS]) for g in groups]
    views = deadline.all_gather_object(mine, group=runtime.group, timeout_s=runtime.config.collective_timeout_s,
                                       purpose="optimizer state dict: param groups")
    if any(len(view) != len(groups) for view in views):
        raise RuntimeError(f"checkpoint: the ranks' optimizers have {[len(v) for v in views]} param groups; "
                           f"every rank's optimizer needs the same groups")
    for i, g in enumerate(groups):
        lists = [view[i] for view in views]
        if all(isinstance(fqn, str) for params in lists for fqn in params):
            g[_PARAMS] = _key_order(lists)


# ---------------------------------------------------------------------------------- helpers
def _parallel_lists_keys(model: nn.Module, model_sd: dict, optim_sd: dict | None, *, loading: bool) -> None:
    """The user's keys for blocks whose experts were spread over parallel lists
    (``passes.parallel_lists``): torch's functions name them by module path; in place, both state dicts
    (``loading``: the user's keys back to the module paths, before torch's functions load them)."""
    to_user_keys(model, model_sd, loading=loading)
    if not optim_sd:
        return
    if _is_flat(optim_sd):
        to_user_keys(model, optim_sd, heads=("state.", "param_groups."), loading=loading)
        return
    to_user_keys(model, optim_sd[_STATE], loading=loading)
    for group in optim_sd[_PG]:
        group[_PARAMS] = [user_key(model, fqn, loading=loading) if isinstance(fqn, str) else fqn
                          for fqn in group[_PARAMS]]


def _runtime(model: nn.Module) -> ThemisRuntime:
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None:
        raise ValueError("this model was not optimized by themis_compile.optimize")
    return runtime


def _as_tuple(optimizers) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def _check_options(runtime: ThemisRuntime, options: _dsd.StateDictOptions | None) -> None:
    if options is not None and (options.full_state_dict or options.broadcast_from_rank0) and runtime.world_size > 1:
        raise NotImplementedError(
            "themis_compile.checkpoint.set_state_dict: full_state_dict / broadcast_from_rank0 are not supported "
            "for optimized models (each rank holds only the experts it owns): load the full state dict into the "
            "model before optimize, or save with dcp.save and load that checkpoint")


def _schedule_paused(runtime: ThemisRuntime):
    scheduler = runtime.reshard_scheduler
    return scheduler.paused() if scheduler is not None else contextlib.nullcontext()


def _shallow_copy(optim_sd: dict) -> dict:
    # set_state_dict rewrites entries; the caller's dict stays as it was.
    out = dict(optim_sd)
    if not _is_flat(out):
        out[_STATE] = dict(out[_STATE])
        out[_PG] = [dict(g, **{_PARAMS: list(g[_PARAMS])}) for g in out[_PG]]
    return out


def _expert_optimizer(runtime: ThemisRuntime, optimizers: tuple[torch.optim.Optimizer, ...]) -> torch.optim.Optimizer:
    """The optimizer holding the owned experts (the one re-sharding moves state in)."""
    owned = {id(p) for layer in runtime.layers.values() for c in layer.local_chunks().values() for p in c}
    if runtime.reshard_scheduler is not None:
        found = [o for o in optimizers if runtime.reshard_scheduler.owns(o)]
    else:
        found = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g[_PARAMS])]
        if not found and not owned and len(optimizers) == 1:
            found = list(optimizers)
    if len(found) != 1:
        raise RuntimeError(f"themis_compile.checkpoint: {len(found)} of the {len(optimizers)} optimizers given hold "
                           "this rank's experts; adopting the saved shard placement needs exactly one")
    return found[0]
