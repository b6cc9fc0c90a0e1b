"""Under ``dense_parallel="fsdp2"``: a parameter of an MoE-like module left data-parallel that no rank used
in a step ends it without a gradient, as in one process.

The modules ``optimize`` does not shard (rejected, or found but left as they are) route tokens: on a step,
a rank may send no token to one of their experts, and that expert's parameters get no gradient there.
FSDP2 is told to reduce-scatter a zero gradient for them (``set_reduce_scatter_unused_params(True)``, or
the ranks would enter reduce-scatters of different parameter sets). Where some rank used the parameter,
the reduced gradient is that rank's: what one process computes. Where *no* rank used it, one process
leaves its ``.grad`` None and AdamW skips it (no momentum step, no weight decay), while the zero gradient
FSDP2 produced would move it. So those modules keep, per parameter, whether this rank accumulated a
gradient into it (a post-accumulate-grad hook on the unsharded parameter FSDP2 hands the module in its
forward, registered at the forward that first sees it), and before an optimizer step over them the
ranks combine the flags in one all-reduce (MAX, with the library's deadline); a parameter no rank used
gets ``.grad = None`` on every rank. The flags then start again (several backwards before a step, as in
gradient accumulation, count together).

DDP needs none of this: with ``find_unused_parameters=True`` it leaves a parameter no rank used without
a gradient itself.

Cost: one flag per parameter of those modules, one small all-reduce per optimizer step over them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import collective_device

__all__ = ["UnusedGradients"]


class UnusedGradients:
    """The gradients of ``modules``' parameters that no rank used in a step, set back to None before each
    optimizer step over them (see the module docstring). Lives as long as ``model``."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], group: Any, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        # (owner module, attribute name) of each parameter: FSDP2 swaps the objects (sharded DTensors
        # between steps, unsharded tensors in the forward), the place stays.
        self.slots: list[tuple[nn.Module, str]] = []
        seen: set[tuple[int, str]] = set()
        for module in modules:
            start = len(self.slots)
            for owner in module.modules():
                for name, p in owner._parameters.items():
                    if p is not None and p.requires_grad and (id(owner), name) not in seen:
                        seen.add((id(owner), name))
                        self.slots.append((owner, name))
            module.register_forward_pre_hook(self._hook_range(start, len(self.slots)))
        self.used = torch.zeros(len(self.slots), dtype=torch.int32)
        # Whether every forward since the last step saw the unsharded parameter (hooked): where it did not
        # (FSDP2's first forward may run on the sharded ones), its use is unknown and its gradient is kept.
        self.untracked = torch.zeros(len(self.slots), dtype=torch.int32)
        self._handle = register_optimizer_step_pre_hook(self._before_step)
        weakref.finalize(model, self._handle.remove)

    def _hook_range(self, start: int, stop: int):
        def pre_forward(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled() or torch.fx._symbolic_trace.is_fx_tracing():
                return       # no backward follows (or a trace, on proxies): no gradient to account for
            if torch.compiler.is_compiling():
                self.untracked[start:stop] = 1      # no hooks inside a compiled graph: use unknown, kept
                return
            for i in range(start, stop):
                owner, name = self.slots[i]
                p = owner._parameters.get(name)
                if p is None or not p.requires_grad:
                    continue
                if isinstance(p, DTensor):      # a sharded parameter: its gradient is FSDP2's, not this rank's
                    self.untracked[i] = 1
                elif getattr(p, "_themis_use_flag", None) != (id(self), i):
                    p.register_post_accumulate_grad_hook(lambda _, i=i: self.used.__setitem__(i, 1))
                    p._themis_use_flag = (id(self), i)     # hooked once per object FSDP2 hands the module

        return pre_forward

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        mine = [i for i, (owner, name) in enumerate(self.slots) if id(owner._parameters.get(name)) in stepped]
        if not mine:
            return
        flags = (self.used[mine] | self.untracked[mine]).to(collective_device(self.group))
        deadline.all_reduce(flags, group=self.group, timeout_s=self.timeout_s, op=torch.distributed.ReduceOp.MAX,
                            purpose="which parameters of the modules not sharded got a gradient on some rank")
        for i, used in zip(mine, flags.tolist()):
            owner, name = self.slots[i]
            if not used:
                owner._parameters[name].grad = None
            self.used[i] = self.untracked[i] = 0
