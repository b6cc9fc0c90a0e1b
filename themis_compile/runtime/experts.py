"""The experts of one MoE layer as equal chunks (paper §3.1): one list of tensors per expert, and the
function that runs one expert on rows of tokens given those tensors.

Two layouts are understood:

- ``nn.ModuleList`` (or ``nn.ModuleDict``, Switch/NLLB style: its modules with parameters, in order) of
  identical expert modules (HF-Mixtral style): expert e's chunk is the list of its module's parameters; it runs through ``torch.func.functional_call`` on a parameter-free template, so
  the user's own expert code computes every copy, owned or materialized.
- a wrapper around such a list (Megatron-Core ``SequentialMLP.local_experts``, DeepSpeed
  ``Experts.deepspeed_experts``): a module without parameters or buffers of its own whose parameters all
  live in one ``nn.ModuleList`` child (:func:`wrapped_expert_list`); read as that list, expert e being
  ``wrapper.<list>[e]``. ``ExpertBank.list_name`` names the list, so that the sharded experts keep the
  user's names (``...experts.local_experts.3.fc1.weight``).
- a stacked module (torchtitan / gpt-fast style) with parameters ``[E, ...]`` and a static method
  ``expert_forward(params, x)`` naming how one expert computes; expert e's chunk is the slices ``w[e]``.

Shape suffixes: N rows, H d_model, E experts.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn


class ExpertShard(nn.Module):
    """Holds one expert's parameters on its owner rank, under the expert's original parameter names."""

    def __init__(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._names = tuple(names)
        for name, t in zip(names, tensors):
            self.register_parameter(name.replace(".", "__"), nn.Parameter(t.detach().clone()))



def wrapped_expert_list(experts: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, list) when ``experts`` wraps its experts: it is no ModuleList / ModuleDict itself, has no
    parameters or buffers of its own, and all its parameters live in ONE non-empty ``nn.ModuleList``
    child (Megatron-Core ``SequentialMLP.local_experts``, DeepSpeed ``Experts.deepspeed_experts``); its
    other children, if any, hold no tensors (an activation). None for any other module."""
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return None
    if any(True for _ in experts.parameters(recurse=False)) or any(True for _ in experts.buffers(recurse=False)):
        return None
    holding = [(name, child) for name, child in experts.named_children()
               if any(True for _ in child.parameters()) or any(True for _ in child.buffers())]
    if len(holding) != 1 or not isinstance(holding[0][1], nn.ModuleList) or len(holding[0][1]) == 0:
        return None
    return holding[0]


def expert_modules(experts: nn.Module) -> list[nn.Module] | None:
    """The per-expert modules of ``experts``, in expert order: a ModuleList's items, the items with
    parameters of a ModuleDict (parameter-free entries such as a token dropout are not experts), or the
    items of the list a wrapper holds (:func:`wrapped_expert_list`); None for any other module."""
    if isinstance(experts, nn.ModuleList):
        return list(experts)
    if (wrapped := wrapped_expert_list(experts)) is not None:
        return list(wrapped[1])
    if isinstance(experts, nn.ModuleDict):
        return [m for m in experts.values() if any(True for _ in m.parameters())]
    return None


def _is_stacked(experts: nn.Module) -> bool:
    """Every parameter has a common leading E dimension (and there is at least one)."""
    params = list(experts.parameters())
    return bool(params) and all(p.dim() >= 2 for p in params) and len({p.shape[0] for p in params}) == 1


class ExpertBank:
    """Describes the experts of one layer: chunk layout (names, shapes, dtypes) and how one expert runs."""

    def __init__(self, experts: nn.Module, *, layer: str = "") -> None:
        self.layer = layer
        # The wrapper's ModuleList holding the experts ("" when the experts module is the list, or stacked):
        # the sharded experts hold expert e as ``<list_name>.<e>``, the user's own name for it.
        self.list_name = wrapped[0] if (wrapped := wrapped_expert_list(experts)) is not None else ""
        modules = expert_modules(experts)
        if modules is not None:
            if len(modules) == 0:
                raise ValueError(f"MoE layer {layer!r}: the expert {type(experts).__name__} is empty")
            template = modules[0]
            self.names = tuple(n for n, _ in template.named_parameters())
            spec0 = [(tuple(p.shape), p.dtype) for p in template.parameters()]
            for e, expert in enumerate(modules):
                if type(expert) is not type(template) or [(tuple(p.shape), p.dtype) for p in expert.parameters()] != spec0:
                    raise ValueError(
                        f"MoE layer {layer!r}: expert {e} differs in type or parameter shapes from expert 0; "
                        "FSSDP needs equal-sized expert chunks")
            if any(True for _ in template.buffers()):
                raise ValueError(f"MoE layer {layer!r}: experts with buffers are not supported")
            # A parameter-free copy that only supplies the forward code.
            self._template = copy.deepcopy(template).to("meta")
            self._stacked = None
            self.num_experts = len(modules)
            self.spec = spec0
            self.form = "modulelist"
        elif isinstance(experts, nn.Module) and _is_stacked(experts):
            # Either the module names how one expert computes (expert_forward), or it is called as
            # experts(x_TH, ids_TK, weights_TK) (HF transformers >= 5, torchtitan): then one expert runs as
            # the user's own module with E = 1 slices, every row routed to it with weight 1.
            self._stacked = type(experts) if callable(getattr(type(experts), "expert_forward", None)) else None
            self._template = None if self._stacked else copy.deepcopy(experts).to("meta")
            if self._template is not None and isinstance(getattr(self._template, "num_experts", None), int):
                # The copy runs one expert at a time (E = 1 slices): code sized by num_experts must agree.
                self._template.num_experts = 1
            params = list(experts.named_parameters())
            self.names = tuple(n for n, _ in params)
            self.num_experts = params[0][1].shape[0]
            if any(p.shape[0] != self.num_experts for _, p in params):
                raise ValueError(f"MoE layer {layer!r}: stacked expert weights disagree on E")
            self.spec = [(tuple(p.shape[1:]), p.dtype) for _, p in params]
            self.form = "stacked"
        else:
            raise ValueError(
                f"MoE layer {layer!r}: experts of type {type(experts).__name__} are neither an nn.ModuleList / "
                "nn.ModuleDict of expert modules (or a parameter-free wrapper of one such list) nor a module whose "
                "parameters are all stacked [E, ...] "
                f"(its parameters: {', '.join(f'{n} {list(p.shape)}' for n, p in experts.named_parameters())})")

    @property
    def chunk_bytes(self) -> int:
        """Psi: bytes of one expert's parameters."""
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in self.spec)

    @property
    def per_expert_modules(self) -> bool:
        return self.form == "modulelist"

    def chunk(self, experts: nn.Module, e: int) -> list[torch.Tensor]:
        """Expert e's parameter tensors, taken from the original (unsharded) experts module."""
        if self.per_expert_modules:
            return list(expert_modules(experts)[e].parameters())
        return [p[e] for p in experts.parameters()]

    def shard_of(self, experts: nn.Module, e: int) -> nn.Module:
        """A module owning expert e's parameters: the user's own expert module where there is one
        (its parameter names are kept), else an :class:`ExpertShard` with copies of the slices.
        ``list(shard.parameters())`` is the chunk, in the order :meth:`run` takes."""
        if self.per_expert_modules:
            return expert_modules(experts)[e]
        shard = ExpertShard(self.names, self.chunk(experts, e))
        for q, p in zip(shard.parameters(), experts.parameters()):
            q.requires_grad_(p.requires_grad)     # a frozen stacked weight stays frozen in every shard
        return shard

    def new_shard(self, tensors: Sequence[torch.Tensor]) -> nn.Module:
        """A module owning copies of ``tensors`` as one expert (an expert arriving at a new owner)."""
        if self.per_expert_modules:
            module = copy.deepcopy(self._template).to_empty(device=tensors[0].device if tensors else "cpu")
            with torch.no_grad():
                for p, t in zip(module.parameters(), tensors):
                    p.copy_(t)
            return module
        return ExpertShard(self.names, tensors)

    def empty_chunk(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Uninitialised tensors shaped like one chunk (receive buffers for materialized replicas)."""
        return [torch.empty(shape, dtype=dt, device=device) for shape, dt in self.spec]

    def run(self, params: Sequence[torch.Tensor], x_NH: torch.Tensor) -> torch.Tensor:
        """Run one expert with parameters ``params`` on rows ``x_NH``."""
        if self._stacked is not None:
            return self._stacked.expert_forward(params, x_NH)
        if self.per_expert_modules:
            return torch.func.functional_call(self._template, dict(zip(self.names, params)), (x_NH,), strict=True)
        n = x_NH.shape[0]
        ids_N1 = torch.zeros((n, 1), dtype=torch.int64, device=x_NH.device)
        weights_N1 = torch.ones((n, 1), dtype=x_NH.dtype, device=x_NH.device)
        stacked = {name: p.unsqueeze(0) for name, p in zip(self.names, params)}
        return torch.func.functional_call(self._template, stacked, (x_NH, ids_N1, weights_N1), strict=True)


def loop_combine(experts: nn.ModuleList, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weights_TK[t, k] * experts[ids_TK[t, k]](x_TH[t]): one expert at a time, HF-Mixtral style."""
    out_TH = torch.zeros_like(x_TH)
    for e, expert in enumerate(experts):
        token_N, k_N = torch.where(ids_TK == e)
        y_NH = expert(x_TH[token_N]) * weights_TK[token_N, k_N, None]
        out_TH.index_add_(0, token_N, y_NH.to(out_TH.dtype))
    return out_TH
