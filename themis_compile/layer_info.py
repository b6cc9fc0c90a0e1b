"""The record of one MoE layer found in a model (:class:`MoELayerInfo`), and the recorded call it may be
probed with (:class:`RecordedCall`).

Detection (`themis_compile.passes.detect`) makes these records, the rewrite (`themis_compile.passes.shard`)
fills in their plan, and the runtime keeps them (`themis_compile.runtime.registry.ThemisRuntime.layer_infos`).
They sit at the bottom of the package so that every layer can read them: this module imports only torch
and the standard library. What needs more than the record itself (the experts cut into chunks, a probe)
lives with its user: ``passes.detect.shared_parameter_names``, ``passes.probe``.

Contract:
    A record holds where the layer's parts are (``module``, ``experts_attr``, ``router_path``), what
    detection read off them (experts, top-k, router, activation, shared experts) and how its experts are
    called (``rewrite``, one of the names listed at the field). The rewrite sets ``plan`` (its own plan
    type, per ``rewrite``) and ``rewritten``; nothing else changes once `find_moe_layers` returns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["MoELayerInfo", "RecordedCall"]


@dataclass
class MoELayerInfo:
    """One MoE layer found in a model: where its parts are and how its experts are called."""

    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    experts_form: str          # "modulelist" | "stacked" | "flat" (stacked as [E * F, ...] rows) |
                               # "moduledict" (run one by one by the block itself) |
                               # "wrapped" (a ModuleList inside a wrapper module) |
                               # "joined" (two stacked halves of every expert, passes.joined)
    router: str                # how the router scores experts, e.g. "linear gate [E=8, H=64] -> softmax -> top-k"
    activation: str
    shared_experts: bool
    experts_attr: str = "experts"              # attribute of ``module`` holding the experts
    rewrite: str = "none"                      # "none" | "inline-loop" | "per-slot" | "sorted-rows" |
                                               # "dense-dispatch" | "dispatch-mask" | "flatten" | "replay" |
                                               # "all-rows" | "scores-call" | "joined" | "zero-experts" |
                                               # "parallel-lists" | "param-lists" | "own-weights" |
                                               # "indexed-weights"
    router_path: str = ""                      # qualified name (in ``module``) of the router's weight or Linear
    score_fn: str = ""                         # "softmax" | "sigmoid" | "none"
    hidden_size: int = 0
    shared_expert_names: tuple[str, ...] = ()
    aux_losses: tuple[str, ...] = ()           # what else the forward produces: stored losses, buffer updates
    rewritten: bool = False                    # set by passes.shard.rewrite_moe_layer
    probe_flat: bool = False                   # the forward takes hidden states [T, H] rather than [B, S, H]
    skips_empty_experts: bool = False          # runs only the experts that receive tokens (skips_empty_experts)
    zero_experts: int = 0                      # Z identity experts with ids [E, E + Z) (zero-experts rewrite)
    call_tail: int = 0                         # sorted-rows: Nones the experts call returns after its rows
                                               # (Megatron-Core's (output, output_bias) without bias: 1)
    tied_to: str = ""                          # the earlier layer whose experts these are (tied weights):
                                               # served by that layer's sharded experts
    plan: Any = field(default=None, repr=False, compare=False)   # passes.shard.RewritePlan, once made
                                                                 # (passes.replay.ReplayPlan for "replay",
                                                                 # AllRowsPlan for "all-rows",
                                                                 # passes.joined.JoinedPlan for "joined")
    probe_call: RecordedCall | None = field(default=None, repr=False, compare=False)   # the arguments it is
                                                # probed with when hidden states alone do not run it

    @property
    def experts(self) -> nn.Module:
        if self.rewrite in ("joined", "parallel-lists", "param-lists", "own-weights", "indexed-weights"):
            # Joined or moved (passes.joined, passes.parallel_lists, passes.own_weights): the experts exist
            # as one module once rewritten.
            return self.plan.experts_of(self.module)
        return getattr(self.module, self.experts_attr)

    def describe(self) -> str:
        shared = ", ".join(self.shared_expert_names) if self.shared_expert_names else "no"
        call = {"none": f"calls {self.experts_attr}(x, ids, weights)",
                "inline-loop": "loops over its experts inline (rewritten to one experts call)",
                "per-slot": f"calls {self.experts_attr}(x, ids) -> [T, K, H] (rewritten to one experts call)",
                "sorted-rows": f"calls {self.experts_attr}(rows sorted by expert, counts) (rewritten to one "
                               "experts call)",
                "replay": "calls its experts one by one in an untraceable forward (capture and replay: one "
                          "experts call between two passes of the forward)",
                "dense-dispatch": "dispatches and combines through [T, E, C] tensors (rewritten to one experts "
                                  "call)",
                "dispatch-mask": f"calls {self.experts_attr}(x, one-hot mask [T, K, E], weights) (rewritten to one "
                                 "experts call)",
                "flatten": f"calls {self.experts_attr}(x [B, S, H], ids, weights) (rewritten to one call on flat "
                           "x [T, H])",
                "all-rows": f"calls {self.experts_attr}(x [E*T, H]) on every row (rewritten to one experts "
                            "call)",
                "scores-call": f"calls {self.experts_attr}(x, scores [T, E], weights, ids) in some order (rewritten "
                               "to one experts(x, ids, weights) call)",
                "joined": f"calls two halves of its experts on rows sorted by expert, row-wise code between them "
                          f"(joined into '{self.experts_attr}', rewritten to one experts call)",
                "own-weights": f"applies stacked [E, ...] parameters of its own inline (moved into "
                               f"'{self.experts_attr}', rewritten to one experts call)",
                "param-lists": f"applies entry e of each of its ParameterLists per expert (moved into "
                               f"'{self.experts_attr}', capture and replay: one experts call)",
                "indexed-weights": f"applies stacked [E, ...] parameters of its own indexed by expert id, w[e], per "
                                   f"expert (moved into '{self.experts_attr}', capture and replay: one experts call)",
                "parallel-lists": f"calls entry e of each of two parallel ModuleLists per expert (joined into "
                                  f"'{self.experts_attr}', capture and replay: one experts call)",
                "zero-experts": f"calls {self.experts_attr}(x, ids, weights) with ids in [0, E + Z) (the "
                                f"{self.zero_experts} ids >= E add weight * x, served by the rewrite; the others "
                                "by the runtime)"}.get(self.rewrite,
                                                                                                 self.rewrite)
        zero = f" + {self.zero_experts} zero (identity) experts" if self.zero_experts else ""
        text = (f"{self.num_experts} experts{zero} ({self.experts_form}, '{self.experts_attr}'), top-{self.top_k}, "
                f"router {self.router}, activation {self.activation}, shared experts: {shared}; {call}")
        if self.aux_losses:
            text += f"; auxiliary: {'; '.join(self.aux_losses)}"
        if self.tied_to:
            text += f"; experts tied to {self.tied_to!r}'s (served by its sharded experts)"
        return text


@dataclass(frozen=True, eq=False)
class RecordedCall:
    """The arguments one module got in a forward of the whole model. ``hidden`` says where its hidden
    states are (the first floating tensor: a position in ``args`` or a key of ``kwargs``); a probe puts
    its own there and passes the rest as recorded. Shared, never copied, by a deep copy of the module."""

    args: tuple
    kwargs: dict
    hidden: int | str

    @staticmethod
    def of(args: tuple, kwargs: dict) -> RecordedCall | None:
        """The call, or None when no argument is a floating tensor (nothing to put a probe in)."""
        floating = lambda v: isinstance(v, torch.Tensor) and v.is_floating_point()  # noqa: E731
        hidden = next((i for i, a in enumerate(args) if floating(a)), None)
        if hidden is None:
            keys = [k for k, v in kwargs.items() if floating(v)]
            hidden = "hidden_states" if "hidden_states" in keys else keys[0] if keys else None
        return None if hidden is None else RecordedCall(tuple(args), dict(kwargs), hidden)

    @property
    def hidden_states(self) -> torch.Tensor:
        return self.args[self.hidden] if isinstance(self.hidden, int) else self.kwargs[self.hidden]

    def bind(self, x: torch.Tensor) -> tuple[tuple, dict]:
        """(args, kwargs) of the recorded call with ``x`` in place of the recorded hidden states."""
        if isinstance(self.hidden, int):
            return self.args[:self.hidden] + (x,) + self.args[self.hidden + 1:], dict(self.kwargs)
        return self.args, {**self.kwargs, self.hidden: x}

    def __deepcopy__(self, memo: dict) -> RecordedCall:
        return self
