"""Under ``dense_parallel="ddp"``: the replicated dense parameters must stay bitwise equal on every rank.

DDP keeps replicas equal by giving every rank the same (all-reduced) gradient; each rank then applies
the same update. Something that changes the gradients per rank after the all-reduce breaks that without
any error, and the most likely such thing after ``optimize`` is clipping by a norm computed from this
rank's gradients alone: ``torch.nn.utils.clip_grad_norm_`` (or ``fabric.clip_gradients``, or any
gradient scaling computed from local gradients) sees this rank's experts only, each rank computes a
different norm, clips by a different factor, and the replicas drift apart (`runtime/clip.py`). The
training is then no longer that of one process, silently.

So an optimized model under DDP checks itself (`install_replica_check`, a forward pre-hook of the
model, ``ThemisConfig.check_replicas``): at every N-th forward that trains (the module in train mode,
gradients enabled, not a recomputation inside backward) every rank computes one integer checksum per
dense tensor, the sum of its elements' bit patterns as int64 (exact and independent of the reduction's
order, so equal replicas give equal sums on any device or thread count; any change of one element
changes it), and the ranks exchange them in ONE all-reduce (MAX of ``[c, -c]``: the largest and the
smallest value of each checksum over the ranks) with the library's deadline. Every rank gets the same
answer, so where the replicas differ every rank raises `ReplicaMismatchError`, in the same forward,
before any other collective of it: no rank is left waiting.

Which forwards count is decided by what every rank does alike (train mode, grad mode, the number of
such forwards), never by the values, so ranks post the check's collective together. Forwards that are
skipped: eval mode, ``no_grad`` / ``inference_mode``, and forwards run while autograd executes a
backward (activation checkpointing that recomputes the whole model inside backward runs its pre-hooks
again; a collective there could interleave with DDP's gradient all-reduces).

Cost per checked forward: one read of every dense parameter (a sum per tensor), one all-reduce of
2 int64 per dense tensor, and one host synchronisation to read the result.
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

# The integer type of each element size whose bit patterns are summed.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


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
    """The sum of the bit patterns of ``t``'s elements, a 0-dim int64 tensor on ``t``'s device: exact
    (integer addition), so the same on any device, kernel or reduction order for bitwise-equal tensors,
    and changed by any change of one element. Elements of 8 bytes count as two 4-byte halves, complex
    ones as their real and imaginary parts. (The sum wraps modulo 2^64 past 2^32 elements of 4 bytes,
    alike on every rank.)"""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.reshape(-1)          # a view for the contiguous tensors parameters are; a copy otherwise
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(_BITS[t.element_size()]).sum(dtype=torch.int64)


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
        sums = torch.stack([param_checksum(p).to(device) for _, p in named]) if named else \
            torch.zeros(0, dtype=torch.int64, device=device)
        both = torch.cat([sums, -sums])
        deadline.all_reduce(both, group=self.group, timeout_s=self.timeout_s, purpose=PURPOSE,
                            op=dist.ReduceOp.MAX)
        hi, neg_lo = both[:len(named)], both[len(named):]
        differ = (hi + neg_lo).ne(0).nonzero().flatten().tolist()     # max - min, modulo 2^64
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
