"""Under ``dense_parallel="ddp"``: the replicated dense parameters must stay bitwise equal on every rank.

DDP keeps replicas equal by giving every rank the same (all-reduced) gradient; each rank then applies
the same update. Something that changes the gradients per rank after the all-reduce breaks that without
any error, and the most likely such thing after ``optimize`` is clipping by a norm computed from this
rank's gradients alone: ``torch.nn.utils.clip_grad_norm_`` (or ``fabric.clip_gradients``, or any
gradient scaling computed from local gradients) sees this rank's experts only, each rank computes a
different norm, clips by a different factor, and the replicas drift apart (`runtime/clip.py`). (So do
several forwards before their backwards outside ``no_sync``: DDP then leaves some gradients
unreduced, plain DDP too.) The training is then no longer that of one process, silently.

So an optimized model under DDP checks itself (`install_replica_check`, a forward pre-hook of the
model, ``ThemisConfig.check_replicas``): at every N-th forward that trains (the module in train mode,
gradients enabled, not a recomputation inside backward) every rank computes one integer checksum per
dense tensor, the sum modulo 2^32 of its bytes read as int32 words (`param_checksum`: exact and
independent of the reduction's order, so equal replicas give equal sums on any device or thread count;
any change of one element changes it), and the ranks exchange them in one all-reduce (MAX of
``[c, -c]``: the largest and the smallest value of each checksum over the ranks) with the library's
deadline. Every rank gets the same
answer, so where the replicas differ every rank raises `ReplicaMismatchError`, in the same forward,
before any other collective of it: no rank is left waiting.

Which forwards count is decided by what every rank does alike (train mode, grad mode, the number of
such forwards), never by the values, so ranks post the check's collective together. Forwards that are
skipped: eval mode, ``no_grad`` / ``inference_mode``, and forwards run while autograd executes a
backward (activation checkpointing that recomputes the whole model inside backward runs its pre-hooks
again; a collective there could interleave with DDP's gradient all-reduces).

Cost per checked forward: one read of every dense parameter (an int32 sum per tensor, as fast as a
float sum, no copy), one all-reduce of 2 int64 per dense tensor, and one host synchronisation to read
the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import collective_device

__all__ = ["ReplicaMismatchError", "install_replica_check", "param_checksum"]

PURPOSE = "replica check of the dense parameters"
_SHOWN = 3                   # differing tensors named in the message

# The integer type of each element size, for elements that do not pair into int32 words.
_BITS = {1: torch.int8, 2: torch.int16}


class ReplicaMismatchError(RuntimeError):
    """The replicated dense parameters of a model optimized with ``dense_parallel="ddp"`` differ across
    ranks (raised on every rank, in the same forward).

    Attributes:
        forward: the training forward (counted from ``optimize``, 1-based) whose check found it.
        last_equal: the training forward whose check last found them equal, or ``None``.
        names: the dense parameters that differ.
    """

    def __init__(self, message: str, forward: int, last_equal: int | None, names: Sequence[str]) -> None:
        super().__init__(message)
        self.forward = forward
        self.last_equal = last_equal
        self.names = list(names)


def param_checksum(t: torch.Tensor) -> torch.Tensor:
    """The sum modulo 2^32 of ``t``'s bytes read as int32 words, a 0-dim int32 tensor on ``t``'s device.

    Integer addition modulo 2^32 is exact and associative, so bitwise-equal tensors give the same sum on
    any device, kernel, thread count or reduction order; a change of one element changes one word by
    less than 2^32, hence the sum. It reads the tensor once, as fast as a float sum, with no copy (a
    contiguous tensor whose bytes pair into words; otherwise its elements are widened to int32 first)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)       # a view for the contiguous tensors parameters are; a copy otherwise
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    try:
        words = flat.view(torch.int32)
    except RuntimeError:       # 1- or 2-byte elements whose number or offset does not pair them into words
        words = flat.view(_BITS[flat.element_size()]).to(torch.int32)
    return words.sum(dtype=torch.int32)


class _ReplicaCheck:
    """The forward pre-hook `install_replica_check` registers."""

    def __init__(self, model: nn.Module, sharded: Sequence[nn.Module], group: Any, every: int,
                 timeout_s: float) -> None:
        self.model = model
        self.sharded = list(sharded)
        self.group = group
        self.every = every
        self.timeout_s = timeout_s
        self.forwards = 0                 # forwards that train, since optimize
        self.last_equal: int | None = None

    def dense(self) -> list[tuple[str, nn.Parameter]]:
        """The DDP-replicated parameters: all but the experts this rank holds (and its zero-expert rows),
        read anew at each check (re-sharding changes which experts a rank holds)."""
        experts = {id(p) for m in self.sharded for p in m.expert_parameters()}
        return [(n, p) for n, p in self.model.named_parameters() if id(p) not in experts]

    def __call__(self, module: nn.Module, args) -> None:
        if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
            return
        self.forwards += 1
        if (self.forwards - 1) % self.every:
            return
        self.check()

    @torch.no_grad()
    def check(self) -> None:
        named = self.dense()
        device = collective_device(self.group)
        sums = torch.stack([param_checksum(p).to(device) for _, p in named]).long() if named else \
            torch.zeros(0, dtype=torch.int64, device=device)
        both = torch.cat([sums, -sums])
        deadline.all_reduce(both, group=self.group, timeout_s=self.timeout_s, purpose=PURPOSE,
                            op=dist.ReduceOp.MAX)
        hi, neg_lo = both[:len(named)], both[len(named):]
        differ = (hi + neg_lo).ne(0).nonzero().flatten().tolist()     # max - min
        if not differ:
            self.last_equal = self.forwards
            return
        names = [named[i][0] for i in differ]
        raise ReplicaMismatchError(self.message(names, len(named)), self.forwards, self.last_equal, names)

    def message(self, names: list[str], total: int) -> str:
        shown = ", ".join(repr(n) for n in names[:_SHOWN])
        more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        since = (f"the check at training forward {self.last_equal} found them equal, so they diverged in an "
                 f"optimizer step after it" if self.last_equal is not None else
                 "this is the first check since optimize")
        return (f"themis_compile: at training forward {self.forwards} (counted from optimize) the replicated dense "
                f"parameters differ across ranks (dense_parallel='ddp'): {len(names)} of {total} dense tensors are no "
                f"longer bitwise equal on every rank ({shown}{more}); {since}. DDP gives every rank the same "
                f"gradient, so replicas stay equal unless each rank scales its gradients by a factor of its own. Most "
                f"likely cause: gradient clipping by a norm computed from this rank's gradients only — "
                f"torch.nn.utils.clip_grad_norm_, fabric.clip_gradients, or any per-rank gradient scaling computed "
                f"from local gradients: each rank holds other experts' gradients, computes another norm and clips "
                f"by another factor. Fix: clip with themis_compile.clip_grad_norm_(model, max_norm) (the norm of "
                f"the whole model's gradient, the same factor on every rank). Other causes: several forwards before "
                f"their backwards (DDP then leaves gradients unreduced; accumulate with a backward after each forward, "
                f"or one backward of the summed losses), or dense parameters written on some ranks only after "
                f"optimize (a load or an in-place edit on one rank). Training since then is not that of one process; "
                f"resume from a checkpoint taken before it. "
                f"(ThemisConfig.check_replicas sets how often this is checked; 0 disables it.)")


def install_replica_check(model: nn.Module, sharded: Sequence[nn.Module], group: Any, every: int,
                          timeout_s: float) -> None:
    """Check at every ``every``-th training forward of ``model`` (the first one included) that its
    DDP-replicated parameters (all but the experts ``sharded`` hold on this rank) are bitwise equal on
    every rank of ``group``; raise `ReplicaMismatchError` on every rank where not. A forward pre-hook
    put before those already registered (DDP's); ``every`` = 0 installs nothing."""
    if every <= 0:
        return
    check = _ReplicaCheck(model, sharded, group, every, timeout_s)
    model._themis_replica_check = check
    # Outside any compiled graph: the check reads its result on the host.
    model.register_forward_pre_hook(torch.compiler.disable(check.__call__), prepend=True)
