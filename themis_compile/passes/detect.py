"""Find the MoE layers of a model.

A module is an MoE layer when it has a router scoring E experts (a ``route`` method or a linear ``gate``
with E outputs), a top-k, and E experts as an ``nn.ModuleList`` of identical MLPs or as stacked
``[E, ...]`` weights in one module. Detection looks at module structure, not class names.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class MoELayerInfo:
    name: str
    module: nn.Module
    num_experts: int
    top_k: int
    experts_form: str          # "modulelist" | "stacked"
    router: str                # how the router scores experts
    activation: str
    shared_experts: bool

    def describe(self) -> str:
        return (f"{self.num_experts} experts ({self.experts_form}), top-{self.top_k}, router {self.router}, "
                f"activation {self.activation}, shared experts: {'yes' if self.shared_experts else 'no'}")


def _num_experts(experts: nn.Module) -> tuple[int, str] | None:
    if isinstance(experts, nn.ModuleList):
        return len(experts), "modulelist"
    if callable(getattr(type(experts), "expert_forward", None)):
        first = next(iter(experts.parameters()), None)
        if first is not None and first.dim() >= 2:
            return first.shape[0], "stacked"
    return None


def find_moe_layers(model: nn.Module) -> tuple[list[MoELayerInfo], list[tuple[str, str]]]:
    """Return (MoE layers found, [(name, reason)] for MoE-like modules that were rejected)."""
    found: list[MoELayerInfo] = []
    rejected: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or not callable(getattr(module, "route", None)):
            continue
        ne = _num_experts(experts)
        if ne is None:
            if hasattr(experts, "owner_E"):  # already sharded by themis_compile
                continue
            rejected.append((name, f"experts of type {type(experts).__name__} are neither a ModuleList nor stacked"))
            continue
        num_experts, form = ne
        top_k = getattr(module, "top_k", None)
        if top_k is None:
            rejected.append((name, "no top_k attribute"))
            continue
        gate = getattr(module, "gate", None)
        if isinstance(gate, nn.Linear) and gate.out_features != num_experts:
            rejected.append((name, f"router scores {gate.out_features} experts but there are {num_experts}"))
            continue
        act = getattr(experts, "activation", None) or getattr(experts[0], "activation", "unknown") \
            if form == "modulelist" else getattr(experts, "activation", "unknown")
        found.append(MoELayerInfo(
            name=name or "<root>", module=module, num_experts=num_experts, top_k=int(top_k), experts_form=form,
            router=str(getattr(module, "routing", "custom")), activation=str(act),
            shared_experts=getattr(module, "shared_expert", None) is not None,
        ))
    return found, rejected
