"""Heterogeneous re-sharding (paper §4.3): move experts, with their optimizer state, to Alg. 2's owners.

Every ``reshard_interval`` optimizer steps all FSSDP layers are re-sharded at once. The optimizer is
found without any call in the user's loop: a global optimizer step post-hook recognises the optimizer
that holds this model's owned expert parameters (once per optimizer); the hook lives as long as the
model's runtime. An expert that changes owner travels as one chunk of
its parameters and its optimizer state tensors (e.g. AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``)
through the same SparseAllGather that materializes replicas: SpAG(P_old, P_old ∪ P_new) delivers exactly
the experts each new owner lacks. The new owner then registers fresh parameters in the optimizer's
param group with the received state, and the old owner drops its parameters and their state. Training
continues exactly as without re-sharding (the test holds it to the single-process reference).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import record_function

from themis_compile.planner import Placement, heterogeneous_sharding
from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import sparse_all_gather

logger = logging.getLogger(__name__)


def _state_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict:
    """How one expert's optimizer state looks, for the rank that receives it: per parameter its tensor
    state entries (key, shape, dtype, whether the tensor lives on the parameter's device — e.g. Adam keeps
    ``step`` on the CPU for CUDA parameters; none for a parameter without state: a stateless optimizer, or
    a frozen parameter never stepped), the index of its param group (``None``: not in this optimizer) and
    whether it requires grad (a frozen expert stays frozen at its new owner)."""
    group_of = {id(q): i for i, g in enumerate(optimizer.param_groups) for q in g["params"]}
    return {"state": [[(k, tuple(v.shape), v.dtype, v.device == p.device)
                       for k, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]
                      for p in params],
            "groups": [group_of.get(id(p)) for p in params],
            "requires_grad": [p.requires_grad for p in params]}


def reshard(runtime: Any, optimizer: torch.optim.Optimizer) -> int:
    """Re-shard every FSSDP layer of ``runtime`` with Alg. 2; returns how many experts changed owner.

    Collective: every rank of the model's group must call it at the same step.
    """
    state = runtime.fssdp
    layers = list(runtime.layers.values())
    if state is None or not layers:
        return 0
    num_experts = {layer.num_experts for layer in layers}
    if len(num_experts) != 1:
        logger.warning("themis_compile: re-sharding skipped: MoE layers have different expert counts %s",
                       sorted(num_experts))
        return 0
    load_LE = np.stack([layer.predictor.predict(0) for layer in layers])
    overlap_degree = max(layer.overlap_degree for layer in layers)
    new_shards = heterogeneous_sharding(load_LE, overlap_degree, state.topology)
    moved = move_experts(runtime, optimizer, dict(zip(runtime.layers, new_shards)))
    logger.info("themis_compile: re-sharded %d MoE layers, %d experts changed owner", len(layers), moved)
    return moved


def move_experts(runtime: Any, optimizer: torch.optim.Optimizer, new_shards: dict[str, Placement]) -> int:
    """Move the experts of the named FSSDP layers, with their optimizer state, to the owners of
    ``new_shards`` (layer name -> shard placement); returns how many experts changed owner.

    Collective: every rank of the model's group must call it with the same placements.
    """
    state = runtime.fssdp
    layers = [runtime.layers[name] for name in new_shards]
    # Step 1: agree on the optimizer-state layout, param groups and frozen flags of every moving expert
    # (its old owner tells; experts differ: a frozen parameter has no state).
    local = {}
    for li, (layer, new_shard) in enumerate(zip(layers, new_shards.values())):
        moving = np.flatnonzero(layer.shard_placement.owners() != new_shard.owners())
        chunks = layer.local_chunks()
        local[li] = {int(e): _state_layout(optimizer, chunks[int(e)]) for e in moving if int(e) in chunks}
    gathered = deadline.all_gather_object(local, group=state.group, timeout_s=state.timeout_s,
                                          purpose="re-sharding: optimizer-state layouts")
    moved = 0
    for li, (layer, new_shard) in enumerate(zip(layers, new_shards.values())):
        layouts = {e: layout for g in gathered for e, layout in g[li].items()}
        moved += _move_layer(layer, new_shard, optimizer, layouts)
    return moved


def _move_layer(layer: Any, new_shard: Placement, optimizer: torch.optim.Optimizer,
                layouts: dict[int, dict]) -> int:
    old_shard: Placement = layer.shard_placement
    if new_shard == old_shard:
        return 0
    state = layer.state
    rank = state.rank
    old_owner_E, new_owner_E = old_shard.owners(), new_shard.owners()
    moving = [int(e) for e in np.flatnonzero(old_owner_E != new_owner_E)]
    param_spec = list(layer.bank.spec)
    spec = {e: param_spec + [(shape, dt) for per_param in layouts[e]["state"] for (_, shape, dt, _) in per_param]
            if e in layouts else param_spec for e in range(layer.num_experts)}

    # Step 2: one chunk per expert = parameters + optimizer state tensors; SpAG delivers the movers.
    chunks = {}
    for e, params in layer.local_chunks().items():
        if e not in layouts:
            continue      # stays here
        # Everything travels on the parameters' device (NCCL moves no CPU tensors).
        extra = [optimizer.state[p][k].detach().to(p.device)
                 for p, per_param in zip(params, layouts[e]["state"]) for (k, _, _, _) in per_param]
        chunks[e] = [p.detach() for p in params] + extra
    target = old_shard.union(new_shard)
    received = sparse_all_gather(chunks, old_shard, target, state.topology, state.comm_group,
                                 spec=spec, layer=layer.layer, timeout_s=state.timeout_s).wait()

    # Step 3: the new owner registers the arrivals (each parameter in the param group its counterpart is
    # in on the sending rank, frozen if it was); the old owner forgets the departures.
    for e in moving:
        if old_owner_E[e] == rank:
            module = layer.remove_expert(e)
            leaving = {id(p) for p in module.parameters()}
            for p in module.parameters():
                optimizer.state.pop(p, None)
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in leaving]
        if new_owner_E[e] == rank:
            tensors, layout = received[e], layouts[e]
            n = len(param_spec)
            module = layer.bank.new_shard(tensors[:n])
            layer.add_expert(e, module)
            it = iter(tensors[n:])
            for p, per_param, group, requires_grad in zip(module.parameters(), layout["state"], layout["groups"],
                                                          layout["requires_grad"]):
                p.requires_grad_(requires_grad)
                if group is not None:
                    optimizer.param_groups[min(group, len(optimizer.param_groups) - 1)]["params"].append(p)
                if per_param:
                    optimizer.state[p] = {k: next(it).to(p.device if on_param_device else "cpu").clone()
                                          for (k, _, _, on_param_device) in per_param}
    layer.set_shard_placement(new_shard)
    return len(moving)


class ReshardScheduler:
    """Calls :func:`reshard` every ``interval`` steps of the optimizer that holds the owned experts."""

    def __init__(self, runtime: Any, interval: int, dense_params: list[nn.Parameter]) -> None:
        # A weak reference: the global hook must not keep a deleted model alive.
        self._runtime = weakref.ref(runtime)
        self._dense_ids = frozenset(id(p) for p in dense_params)
        self.interval = interval
        self.steps = 0
        self.reshards = 0
        self.moved = 0
        self._paused = 0
        # Per optimizer: whether it holds this model's experts, and the shape of its param groups when
        # that was decided (a param group added later asks again). Experts moving between ranks do not
        # change the answer: a new owner registers them in the optimizer that already held its experts.
        self._owner_verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handle = register_optimizer_step_post_hook(self._on_step)
        # The hook is process-wide, its owner is the runtime: it goes when the runtime goes (the model
        # deleted), so that optimizers of other models never call it again.
        self._finalizer = weakref.finalize(runtime, self._handle.remove)

    @property
    def runtime(self) -> Any:
        return self._runtime()

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is the one holding this model's owned experts (on a rank without
        experts: its dense parameters). Decided once per optimizer and param-group layout."""
        layout = tuple(len(g["params"]) for g in optimizer.param_groups)
        known = self._owner_verdicts.get(optimizer)
        if known is not None and known[0] == layout:
            return known[1]
        verdict = self._scan(optimizer)
        self._owner_verdicts[optimizer] = (layout, verdict)
        return verdict

    def _scan(self, optimizer: torch.optim.Optimizer) -> bool:
        ours = {id(p) for layer in self.runtime.layers.values() for c in layer.local_chunks().values() for p in c
                if p.requires_grad}
        if not ours:
            # A rank without trainable experts (an optimizer may leave frozen ones out): recognise the
            # optimizer by the dense parameters instead.
            ours = self._dense_ids
        return any(id(p) in ours for g in optimizer.param_groups for p in g["params"])

    @contextlib.contextmanager
    def paused(self):
        """Optimizer steps inside do not count (torch's state-dict functions take a zero-lr step to
        create missing optimizer state)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def state_dict(self) -> dict[str, int]:
        """Where the schedule stands: optimizer steps counted, re-shardings done, experts moved."""
        return {"steps": self.steps, "reshards": self.reshards, "moved": self.moved}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps, self.reshards, self.moved = int(state["steps"]), int(state["reshards"]), int(state["moved"])

    def _on_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self.runtime is None:    # the runtime is gone but its finalizer has not run yet
            return
        if self._paused or not self.owns(optimizer):
            return
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            with record_function("themis::reshard"):
                self.moved += reshard(self.runtime, optimizer)
            self.reshards += 1

    def remove(self) -> None:
        """Unregister the optimizer hook now (otherwise it goes with the runtime)."""
        self._finalizer()
