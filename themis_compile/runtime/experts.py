"""The experts of one MoE layer as equal chunks (paper §3.1): one list of tensors per expert, and the
function that runs one expert on rows of tokens given those tensors.

Three layouts are understood:

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
  Without ``expert_forward`` the module is called as ``experts(x_TH, ids_TK, weights_TK)`` (HF
  transformers >= 5) and one expert runs as a parameter-free copy of it with E = 1: the slices ``w[e]``
  given as ``[1, ...]`` tensors, every row routed to expert 0 with weight 1. Called so, the module may
  also hold parameters that every expert uses (MuseSpark's ``post_expert_norm``, one RMSNorm weight
  ``[H]``): they are *shared*, not cut into chunks (:func:`stacked_layout`). They stay ordinary dense parameters of the
  model, data parallel with the rest, and every copy of every expert runs with the live shared tensors
  (``ExpertBank.run(params, x, shared)``), so their gradient sums over every row any rank computed and the
  dense wrapper reduces it like any dense parameter's.
- a flat module (HF DBRX: ``w1 [E * F, H]``, viewed ``[E, F, H]`` by its own forward): every parameter's
  leading dimension is a multiple ``E * F_p`` of the number of experts E, which the caller knows from
  the router (``num_experts=``) or the module declares (``num_experts`` / ``moe_num_experts``); expert
  e's chunk is the rows ``w[e * F_p:(e + 1) * F_p]`` of each parameter. One expert runs as the user's
  module with E = 1: a parameter-free copy whose ``num_experts``-like attributes are set to 1 (in every
  submodule, where they equal E), given the ``[F_p, ...]`` rows themselves. :func:`flat_layout` decides
  the layout from the shapes; the probe check of ``passes.candidates.combine_mismatch`` proves it (expert e
  run alone on its rows computes what the module computes for the tokens routed to e). Names, shapes
  and state-dict keys stay the user's: a checkpoint holds ``w1 [E * F, H]``, each expert's ``[F, H]``
  rows at offset ``e * F`` (``runtime.ep.expert_sharded_tensor(..., flat=True)``).

- a stacked module with zero (identity) experts stacked after the real ones (HF LongCat-Flash:
  ``gate_up_proj [E + Z, 2F, H]``, ``down_proj [E, H, F]``; router ids in ``[E, E + Z)`` add ``weight * x``):
  :func:`zero_expert_rows` reads the layout. The E real experts are chunks as in the stacked layout; the
  rows ``[E, E + Z)`` that some weights hold (``ExpertBank.zero_rows``) belong to no expert and are never
  read, so in one process they get a zero gradient every step (AdamW's weight decay still moves them).
  The sharded experts hold them split over the ranks (:func:`zero_rows_span`, a :class:`ZeroExpertRows`
  child), each rank's rows with a zero gradient every step and their optimizer state on that rank only;
  the state dict shows them in the user's key and full shape ``[E + Z, ...]``. The rewrite serves the
  ids ``>= E`` itself (``passes.shard.ZeroExpertsCall``): they never reach the runtime.

``ExpertBank.form`` is ``"modulelist"`` or ``"stacked"`` (one tensor per weight for all experts, under
the user's key); ``ExpertBank.flat`` tells the flat layout among the stacked.

Shape suffixes: N rows, H d_model, E experts, F rows of one expert in a flat weight.
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

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


# Attributes through which a module's forward may size itself by its number of experts (set to 1 on the
# parameter-free copy that runs one expert of a flat module).
NUM_EXPERTS_ATTRS = ("num_experts", "moe_num_experts", "num_local_experts", "n_routed_experts")


def declared_num_experts(experts: nn.Module) -> int | None:
    """The number of experts ``experts`` declares in an integer attribute (``num_experts``,
    ``moe_num_experts``, ``num_local_experts``, ``n_routed_experts``), or None."""
    return next((v for k in NUM_EXPERTS_ATTRS if isinstance(v := getattr(experts, k, None), int)
                 and not isinstance(v, bool)), None)


def flat_layout(experts: nn.Module, num_experts: int | None = None) -> tuple[int, ...] | None:
    """Rows per expert ``F_p`` of each parameter when ``experts`` holds its E experts flat along the
    leading dimension (``w [E * F_p, ...]``, HF DBRX), else None.

    E is ``num_experts`` (from the router) or, when not given, what the module declares
    (:func:`declared_num_experts`; then only 1-D / 2-D parameters count as flat, a stacked ``[E, F, H]``
    module keeps its stacked layout whatever its attributes say). Flat means: E >= 2, every parameter's
    leading dimension a multiple of E, and not all of them E itself (that is the stacked layout).
    """
    params = list(experts.parameters())
    if not params or isinstance(experts, (nn.ModuleList, nn.ModuleDict)) or any(p.dim() < 1 for p in params):
        return None
    E = num_experts
    if E is None:
        E = declared_num_experts(experts)
        if E is None or any(p.dim() > 2 for p in params):
            return None
    if E < 2 or any(p.shape[0] % E for p in params) or all(p.shape[0] == E for p in params):
        return None
    if any(p.dim() >= 3 and p.shape[0] == E for p in params):
        return None     # stacked [E, ...] weights beside others every expert uses (stacked_layout)
    return tuple(p.shape[0] // E for p in params)


def _one_expert_template(experts: nn.Module, num_experts: int) -> nn.Module:
    """A parameter-free copy of a flat experts module sized for one expert: every ``num_experts``-like
    attribute equal to E, in any submodule, set to 1 (its forward views ``w [F, H]`` as ``[1, F, H]``)."""
    template = copy.deepcopy(experts).to("meta")
    for sub in template.modules():
        for attr in NUM_EXPERTS_ATTRS:
            if getattr(sub, attr, None) == num_experts and not isinstance(getattr(sub, attr), bool):
                setattr(sub, attr, 1)
    return template


def _with_gradient_path(out: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out`` made to depend (by zero) on every parameter that needs a gradient. A module's own loop may
    skip an expert without rows (``for e in hit_experts``), which would leave its rows of a stacked or flat
    weight (and the parameters every expert uses) without gradient; in one process that weight always has
    one (zeros there), and AdamW steps it."""
    needed = [p for p in params if p.requires_grad]
    if not needed or not torch.is_grad_enabled():
        return out
    return out + sum(p.sum() for p in needed).to(out.dtype) * 0


def _is_stacked(experts: nn.Module) -> bool:
    """Every parameter has a common leading E dimension (and there is at least one)."""
    params = list(experts.parameters())
    return bool(params) and all(p.dim() >= 2 for p in params) and len({p.shape[0] for p in params}) == 1


def stacked_layout(experts: nn.Module) -> tuple[int, tuple[str, ...], tuple[str, ...]] | None:
    """(E, stacked names, shared names) of a stacked experts module whose parameters are ``[E, ...]``
    except some that every expert uses, or None.

    Contract: E is the common leading dimension of the parameters of 3 or more dimensions (at least one,
    E >= 2); a parameter is stacked when it has 2 or more dimensions and leading dimension E, shared
    otherwise (a norm weight ``[H]``, a projection ``[H, F]`` with H != E). A shared parameter whose
    leading dimension happens to be E is taken for a stacked one: the probe that verifies the layer
    (``combine_mismatch``) then fails and the layer is rejected, never trained differently. A module
    that is not stacked-with-shared (a ModuleList, no 3-D parameter, 3-D parameters of several E) gives
    None.
    """
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return None
    params = list(experts.named_parameters())
    widths = {p.shape[0] for _, p in params if p.dim() >= 3}
    if len(widths) != 1 or (E := widths.pop()) < 2:
        return None
    stacked = tuple(n for n, p in params if p.dim() >= 2 and p.shape[0] == E)
    shared = tuple(n for n, p in params if not (p.dim() >= 2 and p.shape[0] == E))
    return E, stacked, shared


def zero_expert_rows(experts: nn.Module) -> tuple[int, dict[str, int]] | None:
    """(E, {name: Z}) when ``experts`` stacks Z zero (identity) experts after its E real ones in some of its
    weights (HF LongCat-Flash: ``gate_up_proj [E + Z, 2F, H]``, ``down_proj [E, H, F]``), else None.

    Contract: every parameter has 3 or more dimensions; E is the smallest leading dimension (E >= 2), at
    least one parameter has leading dimension E and every other one E + Z for one Z > 0 (rows
    ``[E, E + Z)`` of those belong to no expert). Whether the module really never reads those rows and
    serves ids ``>= E`` as ``weight * x`` is not assumed: detection proves it on a probe
    (``passes.candidates.combine_mismatch``, values and gradients).
    """
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return None
    params = list(experts.named_parameters())
    if not params or any(p.dim() < 3 for _, p in params):
        return None
    E = min(p.shape[0] for _, p in params)
    extra = {p.shape[0] - E for _, p in params} - {0}
    if E < 2 or len(extra) != 1:
        return None
    Z = extra.pop()
    return E, {n: Z for n, p in params if p.shape[0] == E + Z}


def zero_rows_span(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the ``num_rows`` zero-expert rows rank ``rank`` holds: ``torch.chunk``'s split over the
    ranks (``ceil(Z / world_size)`` rows each, the last ones fewer or none)."""
    per = -(-num_rows // world_size)
    return min(num_rows, rank * per), min(num_rows, (rank + 1) * per)


# The child of the sharded experts holding this rank's zero-expert rows (ZeroExpertRows).
ZERO_ROWS_CHILD = "zero_expert_rows"


class ZeroExpertRows(nn.Module):
    """This rank's rows ``[E + lo, E + hi)`` of the stacked weights that hold zero-expert rows
    (``ExpertBank.zero_rows``), one parameter each under the weight's name (dots as ``__``). They are never
    read; :func:`with_zero_rows_gradient` gives them their zero gradient, as one process does."""

    def __init__(self, experts: nn.Module, bank: "ExpertBank", span: tuple[int, int]) -> None:
        super().__init__()
        self.span = span
        lo, hi = span
        for name in bank.zero_rows:
            weight = experts.get_parameter(name)
            rows = nn.Parameter(weight.detach()[bank.num_experts + lo:bank.num_experts + hi].clone(),
                                requires_grad=weight.requires_grad)
            self.register_parameter(name.replace(".", "__"), rows)

    def rows(self, name: str) -> nn.Parameter:
        return self._parameters[name.replace(".", "__")]


def zero_rows_of(module: nn.Module) -> ZeroExpertRows | None:
    """The zero-expert rows a sharded experts module holds on this rank (None for any other module)."""
    rows = module._modules.get(ZERO_ROWS_CHILD)
    return rows if isinstance(rows, ZeroExpertRows) else None


def with_zero_rows_gradient(out: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """``out`` made to depend (by zero) on the zero-expert rows ``experts`` holds on this rank: in one
    process rows ``[E, E + Z)`` of ``gate_up_proj`` are never read but have a gradient (zeros) every step,
    so that AdamW steps them (weight decay, step count); every rank gives its rows the same."""
    rows = zero_rows_of(experts)
    if rows is None or not torch.is_grad_enabled():
        return out
    return _with_gradient_path(out, list(rows.parameters()))


class ExpertBank:
    """Describes the experts of one layer: chunk layout (names, shapes, dtypes) and how one expert runs."""

    def __init__(self, experts: nn.Module, *, layer: str = "", num_experts: int | None = None) -> None:
        """``num_experts``: E as the router scores it, where the caller knows it; it tells a flat layout
        (``w [E * F, H]``) from a stacked one (:func:`flat_layout`)."""
        self.layer = layer
        # Parameters of the experts module that every expert uses (stacked form only): not in any chunk.
        self.shared_names: tuple[str, ...] = ()
        self.flat = False
        self.flat_rows: tuple[int, ...] = ()    # F_p of each parameter in the flat layout
        # Stacked weights that hold Z zero-expert rows after the E experts' (name -> Z; zero_expert_rows).
        self.zero_rows: dict[str, int] = {}
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
        elif isinstance(experts, nn.Module) and (rows := flat_layout(experts, num_experts)) is not None:
            self._init_flat(experts, rows, num_experts or declared_num_experts(experts))
        elif isinstance(experts, nn.Module) and (_is_stacked(experts) or stacked_layout(experts) is not None):
            # Either the module names how one expert computes (expert_forward), or it is called as
            # experts(x_TH, ids_TK, weights_TK) (HF transformers >= 5, torchtitan): then one expert runs as
            # the user's own module with E = 1 slices, every row routed to it with weight 1, and the
            # parameters every expert uses (shared_names) as they are.
            layout = stacked_layout(experts)
            self.shared_names = () if _is_stacked(experts) else layout[2]
            self._stacked = type(experts) if callable(getattr(type(experts), "expert_forward", None)) else None
            if self._stacked is not None and self.shared_names:
                raise ValueError(f"MoE layer {layer!r}: {type(experts).__name__}.expert_forward(params, x) cannot "
                                 f"receive the parameters every expert uses ({', '.join(self.shared_names)})")
            self._template = None if self._stacked else copy.deepcopy(experts).to("meta")
            if self._template is not None and isinstance(getattr(self._template, "num_experts", None), int):
                # The copy runs one expert at a time (E = 1 slices): code sized by num_experts must agree.
                self._template.num_experts = 1
            for top in dict.fromkeys(n.split(".", 1)[0] for n in self.shared_names):
                mixed = [f"{top}.{n}" for n, _ in getattr(experts, top).named_parameters()
                         if f"{top}.{n}" not in self.shared_names] if top not in experts._parameters else []
                if mixed or top.isdigit():
                    raise ValueError(f"MoE layer {layer!r}: submodule {top!r} of the experts holds stacked "
                                     f"parameters ({', '.join(mixed) or top}) next to parameters every expert "
                                     "uses; shared parameters must be direct parameters or whole submodules")
            params = [(n, p) for n, p in experts.named_parameters() if n not in self.shared_names]
            self.names = tuple(n for n, _ in params)
            self.num_experts = params[0][1].shape[0]
            if any(p.shape[0] != self.num_experts for _, p in params):
                raise ValueError(f"MoE layer {layer!r}: stacked expert weights disagree on E")
            self.spec = [(tuple(p.shape[1:]), p.dtype) for _, p in params]
            self.form = "stacked"
        elif isinstance(experts, nn.Module) and (zero := zero_expert_rows(experts)) is not None:
            self._init_zero_rows(experts, *zero)
        else:
            shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in experts.named_parameters())
            if len({p.shape[0] for p in experts.parameters() if p.dim() >= 3}) > 1:
                # LongCat-Flash: gate_up_proj [E + Z, ...] (Z zero / identity experts) but down_proj [E, ...].
                raise ValueError(
                    f"MoE layer {layer!r}: the stacked weights of {type(experts).__name__} disagree on the number "
                    f"of experts ({shapes}): rows that some stacked weights hold and others do not (zero / "
                    "identity experts stacked after the real ones) belong to no expert's chunk, yet are one "
                    "tensor (one gradient, one optimizer state, one state-dict key) with the real experts' rows; "
                    "stack only the E real experts and run the zero experts outside the experts module (the "
                    "block adding weight * x for the ids >= E)")
            raise ValueError(
                f"MoE layer {layer!r}: experts of type {type(experts).__name__} are neither an nn.ModuleList / "
                "nn.ModuleDict of expert modules (or a parameter-free wrapper of one such list) nor a module "
                "whose parameters are stacked [E, ...] (but for some every expert uses, not of 3 or more "
                "dimensions) or all flat [E * F, ...] (every leading dimension a multiple of E) (its parameters: "
                f"{shapes})")

    def _init_flat(self, experts: nn.Module, rows: tuple[int, ...], num_experts: int) -> None:
        # One expert runs as the user's module with E = 1 on its rows (the module is called as
        # experts(x_TH, ids_TK, weights_TK), as for stacked modules without expert_forward).
        params = list(experts.named_parameters())
        self._stacked = None
        self._template = _one_expert_template(experts, num_experts)
        self.names = tuple(n for n, _ in params)
        self.num_experts = num_experts
        self.flat, self.flat_rows = True, rows
        self.spec = [((f, *p.shape[1:]), p.dtype) for f, (_, p) in zip(rows, params)]
        self.form = "stacked"

    def _init_zero_rows(self, experts: nn.Module, num_experts: int, zero_rows: dict[str, int]) -> None:
        # The E real experts as in the stacked layout (expert e: w[e] of every weight, run as the user's
        # module with E = 1 slices); rows [E, E + Z) are no expert's (ZeroExpertRows holds them).
        params = list(experts.named_parameters())
        self._stacked = None
        self._template = copy.deepcopy(experts).to("meta")
        self.names = tuple(n for n, _ in params)
        self.num_experts = num_experts
        self.zero_rows = dict(zero_rows)
        self.spec = [(tuple(p.shape[1:]), p.dtype) for _, p in params]
        self.form = "stacked"

    @property
    def num_zero_experts(self) -> int:
        """Z, the zero (identity) experts whose ids follow the E experts' (0 without any)."""
        return next(iter(self.zero_rows.values()), 0)

    def rows_of(self, i: int) -> int:
        """F_p, the rows of one expert in parameter ``i`` of the flat layout (0 in the other layouts)."""
        return self.flat_rows[i] if self.flat else 0

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
        if self.flat:
            return [p[e * f:(e + 1) * f] for f, p in zip(self.flat_rows, experts.parameters())]
        return [experts.get_parameter(n)[e] for n in self.names]

    def shard_of(self, experts: nn.Module, e: int) -> nn.Module:
        """A module owning expert e's parameters: the user's own expert module where there is one
        (its parameter names are kept), else an :class:`ExpertShard` with copies of the slices.
        ``list(shard.parameters())`` is the chunk, in the order :meth:`run` takes."""
        if self.per_expert_modules:
            return expert_modules(experts)[e]
        shard = ExpertShard(self.names, self.chunk(experts, e))
        for q, p in zip(shard.parameters(), (experts.get_parameter(n) for n in self.names)):
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

    def shared_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The parameters every expert uses, by name, as ``module`` holds them now: the original experts
        module, or the sharded experts (which hold the same parameter objects under the same names).
        Read at every forward, never kept: a dense wrapper may swap them (FSDP2's unsharded parameters)."""
        return {n: module.get_parameter(n) for n in self.shared_names}

    def run(self, params: Sequence[torch.Tensor], x_NH: torch.Tensor,
            shared: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Run one expert with parameters ``params`` on rows ``x_NH``; ``shared``: the parameters every
        expert uses (:meth:`shared_tensors`), needed when the layer has some.

        No rows: the user's code still runs (its result then has the dtype it has on other rows, under
        autocast too, which every rank's exchange of the results relies on); a stacked or flat module's own
        loop may skip an expert without rows, so its empty result is made to depend, by zero, on every
        parameter that needs a gradient, shared ones included."""
        if self.shared_names and (shared is None or set(shared) != set(self.shared_names)):
            raise ValueError(f"MoE layer {self.layer!r}: its experts use the shared parameters "
                             f"{', '.join(self.shared_names)}; run() needs them (ExpertBank.shared_tensors)")
        if self._stacked is not None:
            return self._stacked.expert_forward(params, x_NH)
        if self.per_expert_modules:
            return torch.func.functional_call(self._template, dict(zip(self.names, params)), (x_NH,), strict=True)
        n = x_NH.shape[0]
        ids_N1 = torch.zeros((n, 1), dtype=torch.int64, device=x_NH.device)
        weights_N1 = torch.ones((n, 1), dtype=x_NH.dtype, device=x_NH.device)
        if self.flat:
            # Expert e's rows are the whole weight of a one-expert module: w [F, H] is [1 * F, H].
            out = torch.func.functional_call(self._template, dict(zip(self.names, params)),
                                             (x_NH, ids_N1, weights_N1), strict=True)
            return _with_gradient_path(out, params) if n == 0 else out
        stacked = {name: p.unsqueeze(0) for name, p in zip(self.names, params)}
        if self.shared_names:
            stacked.update(shared)
        if self.zero_rows:
            # Two slots: the expert with weight 1, the first zero expert (id E, identity) with weight 0,
            # which adds 0 * x. (HF LongCat-Flash's loop squeezes the slot dimension: one slot fails.)
            ids_N1 = torch.cat([ids_N1, torch.full_like(ids_N1, self.num_experts)], 1)
            weights_N1 = torch.cat([weights_N1, torch.zeros_like(weights_N1)], 1)
        out = torch.func.functional_call(self._template, stacked, (x_NH, ids_N1, weights_N1), strict=True)
        return _with_gradient_path(out, [*params, *(shared or {}).values()]) if n == 0 else out


# ``ThemisConfig.expert_row_block="auto"`` on CPU: an expert's rows are computed in blocks whose intermediate
# activations (about one expert's parameter count / H values per row: 3F for a SwiGLU expert of width F)
# take at most this many bytes, so that they stay in a CPU's last-level cache. A hot expert's thousands of
# rows in one GEMM spill it: measured on 2 EPYC cores (32 MiB L3), H=128, F=2048, 4,096 rows forward and
# backward took 579 ms in one call and 306 ms in blocks of 1,024. GPUs want large GEMMs: no blocks there.
CPU_ROW_BLOCK_BYTES = 24 << 20
MIN_ROW_BLOCK = 256


def row_block(setting: int | str | None, chunk_bytes: int, rows_NH: torch.Tensor) -> int | None:
    """The most rows of one expert computed in one call (None: all of them), for the setting of
    ``ThemisConfig.expert_row_block``: an int, None, or ``"auto"`` (on CPU, blocks whose intermediates take
    about `CPU_ROW_BLOCK_BYTES`, at least `MIN_ROW_BLOCK` rows; elsewhere no blocks)."""
    if setting != "auto":
        return setting
    if rows_NH.device.type != "cpu" or chunk_bytes <= 0:
        return None
    return max(MIN_ROW_BLOCK, CPU_ROW_BLOCK_BYTES * int(rows_NH.shape[-1]) // chunk_bytes)


def loop_combine(experts: nn.ModuleList, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weights_TK[t, k] * experts[ids_TK[t, k]](x_TH[t]): one expert at a time, HF-Mixtral style."""
    out_TH = torch.zeros_like(x_TH)
    for e, expert in enumerate(experts):
        token_N, k_N = torch.where(ids_TK == e)
        y_NH = expert(x_TH[token_N]) * weights_TK[token_N, k_N, None]
        out_TH.index_add_(0, token_N, y_NH.to(out_TH.dtype))
    return out_TH
