"""The record of one MoE layer found in a model (:class:`MoELayerInfo`), and the recorded call it may be
probed with (:class:`RecordedCall`).

Detection (`themis_compile.passes.detect`) makes these records, the rewrite of their style
(`themis_compile.passes.styles`) fills in their plan, and the runtime keeps them (`themis_compile.runtime.registry.ThemisRuntime.layer_infos`).
They sit at the bottom of the package so that every layer can read them: this module imports only torch
and the standard library. What needs more than the record itself (the experts cut into chunks, a probe)
lives with its user: ``passes.candidates.shared_parameter_names``, ``passes.probe``.

Contract:
    A record holds where the layer's parts are (``module``, ``experts_attr``, ``router_path``), what
    detection read off them (experts, top-k, router, activation, shared experts) and how its experts are
    called (``rewrite``, the name of its style: a row of ``passes.styles.STYLES``). The rewrite sets ``plan`` (its own plan
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
    rewrite: str = "none"                      # its style: the name of a row of passes.styles.STYLES
    router_path: str = ""                      # qualified name (in ``module``) of the router's weight or Linear
    score_fn: str = ""                         # "softmax" | "sigmoid" | "none"
    hidden_size: int = 0
    shared_expert_names: tuple[str, ...] = ()
    aux_losses: tuple[str, ...] = ()           # what else the forward produces: stored losses, buffer updates
    rewritten: bool = False                    # set by passes.styles.rewrite_moe_layer
    probe_flat: bool = False                   # the forward takes hidden states [T, H] rather than [B, S, H]
    skips_empty_experts: bool = False          # runs only the experts that receive tokens (skips_empty_experts)
    zero_experts: int = 0                      # Z identity experts with ids [E, E + Z) (zero-experts rewrite)
    call_tail: int = 0                         # sorted-rows: Nones the experts call returns after its rows
                                               # (Megatron-Core's (output, output_bias) without bias: 1)
    tied_to: str = ""                          # the earlier layer whose experts these are (tied weights):
                                               # served by that layer's sharded experts
    plan: Any = field(default=None, repr=False, compare=False)   # its style's plan, once made (a plan
                                                # with experts_of(block) builds the experts module itself)
    probe_call: RecordedCall | None = field(default=None, repr=False, compare=False)   # the arguments it is
                                                # probed with when hidden states alone do not run it

    @property
    def experts(self) -> nn.Module:
        if hasattr(self.plan, "experts_of"):
            # Joined or moved (passes.joined, passes.parallel_lists, passes.own_weights): the experts exist
            # as one module once rewritten.
            return self.plan.experts_of(self.module)
        return getattr(self.module, self.experts_attr)


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
