"""Expert parallelism (EP): the static baseline every speed-up is measured against (paper §2.2, §5).

Experts are owned contiguously by ranks (E need not divide by the world size; E < world size leaves some
ranks without experts). Each iteration: the router's top-k pairs go to their expert's owner through one
uneven all-to-all, the owner runs the expert on what it received, and the outputs return for the weighted
combine. Dropless, full autograd, world size 1 without communication.

Gradient scaling: dense parameters are averaged over ranks by DDP. An expert's gradient already sums the
contributions of every rank's tokens, so it is divided by the world size to equal the gradient of the
global-batch mean loss that single-process training computes. The scale sits in the forward path
(`scale_grad`), not in a hook on the parameter: a frozen expert (``requires_grad=False``) gets no gradient
at all, and one unfrozen after ``optimize`` is scaled like the others.

Experts without tokens: on a layer whose experts module runs only the experts that receive tokens
(``skips_empty_experts``), the owner does not run an expert that received no row — the owner receives
every row of its experts, so that is no token of the global batch — and its ``.grad`` stays None, as in
one process (AdamW then skips it). Otherwise it runs on empty rows and gets a zero gradient, as there.

Shape suffixes: T tokens, K top-k, H d_model, E experts, N rows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.profiler import record_function

from themis_compile.planner.placement import Placement
from themis_compile.runtime import deadline
from themis_compile.runtime.exchange import dispatch_compute_combine
from themis_compile.runtime.experts import (ZERO_ROWS_CHILD, ExpertBank, ZeroExpertRows, row_block,
                                            zero_rows_of, zero_rows_span)

logger = logging.getLogger(__name__)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` itself for the forward pass, whose gradient is multiplied by ``scale`` (no graph if ``x`` needs no
    gradient)."""
    return _ScaleGrad.apply(x, scale) if x.requires_grad and scale != 1.0 else x


# ---------------------------------------------------------------------- state dicts in the unmodified keys
def expert_sharded_tensor(tensors_E: dict[int, torch.Tensor], shard: Placement, spec: tuple, group, *,
                          name: str = "", flat: bool = False):
    """One ``[E, ...]`` tensor from per-expert ``[...]`` tensors of the experts this rank owns.

    A ``ShardedTensor`` whose chunk of expert e is ``tensors_E[e].unsqueeze(0)`` (a view: loading into the
    sharded tensor writes into ``tensors_E``) at offset ``[e, 0, ...]``, placed on e's owner in
    ``shard``. Every rank builds the same global metadata from the shard placement, so no collective
    runs. Without a process group (one process holds every expert) a plain stacked copy.

    ``flat``: the experts' rows of one ``[E * F, ...]`` tensor instead (HF DBRX's ``w1``): expert e's chunk
    is ``tensors_E[e]`` itself, ``[F, ...]`` at offset ``[e * F, 0, ...]``; without a process group the
    concatenation.
    """
    shape, dtype = spec
    E = shard.num_experts
    if group is None:
        if sorted(tensors_E) != list(range(E)):
            raise RuntimeError(f"{name}: one process must hold every expert to stack them")
        return (torch.cat if flat else torch.stack)([tensors_E[e] for e in range(E)])
    if tensors_E:
        first = next(iter(tensors_E.values()))
        shape, dtype, device = tuple(first.shape), first.dtype, first.device
    else:
        device = torch.device("cpu")
    owners_E = shard.owners()
    local_rank = dist.get_rank(group)
    if sorted(tensors_E) != [int(e) for e in np.flatnonzero(owners_E == local_rank)]:
        raise RuntimeError(f"{name}: tensors of experts {sorted(tensors_E)} given on rank {local_rank}, which owns "
                           f"{np.flatnonzero(owners_E == local_rank).tolist()}")
    global_ranks = dist.get_process_group_ranks(group)
    shards_md, local = [], []
    rows = shape[0] if flat else 1       # of expert e, at offset e * rows of the leading dimension
    chunk = list(shape) if flat else [1, *shape]
    for e in range(E):
        md = ShardMetadata(shard_offsets=[e * rows] + [0] * (len(chunk) - 1), shard_sizes=chunk,
                           placement=f"rank:{global_ranks[int(owners_E[e])]}/{device}")
        shards_md.append(md)
        if e in tensors_E:
            t = tensors_E[e]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"{name}: expert {e}'s tensor is {tuple(t.shape)} {t.dtype}, expected "
                                   f"{tuple(shape)} {dtype}")
            t = t.detach().contiguous()
            local.append(Shard(t if flat else t.unsqueeze(0), md))
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    size = [E * rows, *chunk[1:]]
    metadata = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(size),
                                     tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def expert_slice(value, e: int, num_experts: int, name: str = "", *, flat_rows: int = 0) -> torch.Tensor:
    """Expert e's ``[...]`` slice of a stacked ``[E, ...]`` value: a plain tensor (the unmodified model's),
    or a ``ShardedTensor`` holding e's chunk on this rank. ``flat_rows`` F: the value is flat,
    ``[E * F, ...]``, and expert e's slice its rows ``[e * F, (e + 1) * F)``."""
    if flat_rows:
        return _flat_expert_rows(value, e, num_experts, flat_rows, name)
    if isinstance(value, ShardedTensor):
        size = list(value.metadata().size)      # (not value.size(): torch functions on it warn)
        if size[0] != num_experts:
            raise RuntimeError(f"{name}: a stacked tensor of {size[0]} experts, the layer has {num_experts}")
        for s in value.local_shards():
            offsets, sizes = s.metadata.shard_offsets, s.metadata.shard_sizes
            if offsets[0] <= e < offsets[0] + sizes[0] and not any(offsets[1:]) and list(sizes[1:]) == size[1:]:
                return s.tensor[e - offsets[0]]
        raise RuntimeError(f"{name}: expert {e} is not among this rank's chunks of the sharded tensor")
    if hasattr(value, "full_tensor"):      # a DTensor
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() < 1 or value.shape[0] != num_experts:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise RuntimeError(f"{name}: expected a stacked tensor of {num_experts} experts, got {shape}")
    return value[e]


def _flat_expert_rows(value, e: int, num_experts: int, rows: int, name: str) -> torch.Tensor:
    """Expert e's rows ``[e * rows, (e + 1) * rows)`` of a flat ``[E * rows, ...]`` value (plain, DTensor, or
    a ``ShardedTensor`` with a chunk on this rank that holds those rows)."""
    lo, hi = e * rows, (e + 1) * rows
    if isinstance(value, ShardedTensor):
        size = list(value.metadata().size)
        if size[0] != num_experts * rows:
            raise RuntimeError(f"{name}: a flat tensor of {size[0]} rows, the layer has {num_experts} experts of "
                               f"{rows} rows")
        for s in value.local_shards():
            offsets, sizes = s.metadata.shard_offsets, s.metadata.shard_sizes
            if offsets[0] <= lo and hi <= offsets[0] + sizes[0] and not any(offsets[1:]) and list(sizes[1:]) == size[1:]:
                return s.tensor[lo - offsets[0]:hi - offsets[0]]
        raise RuntimeError(f"{name}: expert {e}'s rows are not among this rank's chunks of the sharded tensor")
    if hasattr(value, "full_tensor"):      # a DTensor
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() < 1 or value.shape[0] != num_experts * rows:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise RuntimeError(f"{name}: expected a flat tensor of {num_experts} experts x {rows} rows, got {shape}")
    return value[lo:hi]


def _child_name(name: str) -> str:
    return name.replace(".", "__")     # ExpertShard's parameter name for a stacked weight's name


def _expose_stacked_names(module: nn.Module, names) -> None:
    """Make ``module.<name>`` resolve for the stacked weights' names (torch's distributed state-dict
    functions resolve every key by attribute): to the :class:`StackedWeight` describing it."""
    for name in names:
        *path, last = name.split(".")
        obj = module
        for part in path + [last]:
            existing = obj.__dict__.get(part)
            if (existing is None and hasattr(obj, part)) or (existing is not None and (
                    part == last or not isinstance(existing, _Namespace))):
                raise ValueError(f"stacked expert weight {name!r} shadows an attribute of {type(module).__name__}")
            obj = obj.__dict__.setdefault(part, _Namespace() if part != last else StackedWeight(name))


class _Namespace:
    pass


def _hold_shared(module: nn.Module, experts: nn.Module, names: Sequence[str]) -> None:
    """Register on ``module`` the parameters of ``experts`` that every expert uses (``ExpertBank.shared_names``,
    direct parameters or whole submodules: the bank checked) under their own names: the same parameter
    objects (a shared norm's module itself), so that they stay ordinary dense parameters of the model (the
    dense wrapper reduces them, the optimizer steps them) and their state-dict keys are unchanged."""
    for top in dict.fromkeys(n.split(".", 1)[0] for n in names):
        if top in experts._parameters:
            module.register_parameter(top, experts._parameters[top])
        else:
            module.add_module(top, experts._modules[top])


class StackedWeight:
    """Names one stacked ``[E, ...]`` weight of the unmodified experts module; the sharded experts hold
    its per-expert slices. ``experts.stacked_weight(name)`` gives the weight as this rank holds it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StackedWeight({self.name!r})"


def zero_rows_sharded_tensor(stacked, rows_local: torch.Tensor | None, num_experts: int, num_rows: int, group, *,
                             name: str = ""):
    """A stacked ``[E, ...]`` value (:func:`expert_sharded_tensor`'s) extended by the Z zero-expert rows to
    the user's ``[E + Z, ...]``: each rank's rows (``zero_rows_span``; ``rows_local``, None where it holds
    none) one more chunk at offset ``E + lo``, placed on that rank. Every rank builds the same metadata from
    Z and the world size, so no collective runs; without a process group the concatenation."""
    if group is None:
        return torch.cat([stacked, rows_local])
    md = stacked.metadata()
    size = list(md.size)
    world_size = dist.get_world_size(group)
    global_ranks = dist.get_process_group_ranks(group)
    local = list(stacked.local_shards())
    device = rows_local.device if rows_local is not None else (local[0].tensor.device if local else
                                                               torch.device("cpu"))
    shards_md = list(md.shards_metadata)
    me = dist.get_rank(group)
    for r in range(world_size):
        lo, hi = zero_rows_span(num_rows, world_size, r)
        if hi == lo:
            continue
        chunk_md = ShardMetadata(shard_offsets=[num_experts + lo] + [0] * (len(size) - 1),
                                 shard_sizes=[hi - lo, *size[1:]], placement=f"rank:{global_ranks[r]}/{device}")
        shards_md.append(chunk_md)
        if r == me:
            if rows_local is None or tuple(rows_local.shape) != (hi - lo, *size[1:]):
                raise RuntimeError(f"{name}: rank {me} holds zero-expert rows "
                                   f"{None if rows_local is None else tuple(rows_local.shape)}, expected "
                                   f"{(hi - lo, *size[1:])}")
            local.append(Shard(rows_local.detach().contiguous(), chunk_md))
    size[0] = num_experts + num_rows
    metadata = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(size),
                                     tensor_properties=md.tensor_properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def leading_rows(value, lo: int, hi: int, name: str = "") -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``value`` along its leading dimension: a plain tensor, a DTensor, or a
    ``ShardedTensor`` with one chunk on this rank that holds them."""
    if isinstance(value, ShardedTensor):
        for s in value.local_shards():
            offsets, sizes = s.metadata.shard_offsets, s.metadata.shard_sizes
            if (offsets[0] <= lo and hi <= offsets[0] + sizes[0] and not any(offsets[1:])
                    and list(sizes[1:]) == list(value.metadata().size)[1:]):
                return s.tensor[lo - offsets[0]:hi - offsets[0]]
        raise RuntimeError(f"{name}: rows [{lo}, {hi}) are not among this rank's chunks of the sharded tensor")
    if hasattr(value, "full_tensor"):      # a DTensor
        value = value.full_tensor()
    if not torch.is_tensor(value) or value.dim() < 1 or value.shape[0] < hi:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise RuntimeError(f"{name}: expected a tensor of at least {hi} rows, got {shape}")
    return value[lo:hi]


def _state_dict_zero_rows(module: "ShardedExperts", state_dict, prefix: str) -> None:
    """The zero-expert rows this rank holds join their weight's entry, which becomes ``[E + Z, ...]``."""
    rows = zero_rows_of(module)
    for name, Z in module.bank.zero_rows.items():
        local = state_dict.pop(f"{prefix}{ZERO_ROWS_CHILD}.{_child_name(name)}", None) if rows is not None else None
        state_dict[prefix + name] = zero_rows_sharded_tensor(state_dict[prefix + name], local, module.num_experts,
                                                             Z, module.group, name=f"{module.layer}.{name}")


def _state_dict_in_unmodified_keys(module: "ShardedExperts", state_dict, prefix: str, local_metadata) -> None:
    # ModuleList form: the children's keys already are the unmodified ones. Stacked form: the owned
    # experts' slices become one sharded [E, ...] tensor under the stacked weight's own key.
    if module.bank.form != "stacked":
        return
    owned = module.owned_experts()
    for i, name in enumerate(module.bank.names):
        tensors_E = {e: state_dict.pop(f"{prefix}{e}.{_child_name(name)}") for e in owned}
        state_dict[prefix + name] = module.stacked_weight(name, tensors_E)
    if module.bank.zero_rows:
        _state_dict_zero_rows(module, state_dict, prefix)


def _load_state_dict_in_unmodified_keys(module: "ShardedExperts", state_dict, prefix: str, local_metadata,
                                        strict, missing_keys, unexpected_keys, error_msgs) -> None:
    owned = set(module.owned_experts())
    E = module.num_experts
    if module.bank.form != "stacked":
        # A full state dict (the unmodified model's, on every rank): keep the experts this rank owns
        # (``<prefix><e>.``, or ``<prefix><list>.<e>.`` for a wrapper's list).
        experts_prefix = prefix + (f"{module.bank.list_name}." if module.bank.list_name else "")
        for key in list(state_dict):
            if key.startswith(experts_prefix):
                head = key[len(experts_prefix):].split(".", 1)[0]
                if head.isdigit() and int(head) < E and int(head) not in owned:
                    del state_dict[key]
        return
    for i, name in enumerate(module.bank.names):
        value = state_dict.pop(prefix + name, None)
        if value is None:
            if owned or name in module.bank.zero_rows:
                missing_keys.append(prefix + name)
            continue
        try:
            for e in sorted(owned):
                # (A weight holding zero-expert rows is [E + Z, ...]: expert e is still its row e.)
                state_dict[f"{prefix}{e}.{_child_name(name)}"] = expert_slice(
                    value, e, E + module.bank.zero_rows.get(name, 0), prefix + name,
                    flat_rows=module.bank.rows_of(i))
            if name in module.bank.zero_rows and (rows := zero_rows_of(module)) is not None:
                lo, hi = rows.span
                state_dict[f"{prefix}{ZERO_ROWS_CHILD}.{_child_name(name)}"] = leading_rows(
                    value, E + lo, E + hi, prefix + name)
        except RuntimeError as err:
            error_msgs.append(str(err))
    module._load_prefix = prefix


def _report_in_unmodified_keys(module: "ShardedExperts", incompatible_keys) -> None:
    # The owned experts' own "missing" slices were reported under the stacked key already.
    prefix = module.__dict__.pop("_load_prefix", None)
    if prefix is None or module.bank.form != "stacked":
        return
    internal = {f"{prefix}{e}.{_child_name(n)}" for e in module.owned_experts() for n in module.bank.names}
    internal |= {f"{prefix}{ZERO_ROWS_CHILD}.{_child_name(n)}" for n in module.bank.zero_rows}
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in internal]


class ShardedExperts(nn.Module):
    """Stands in for a layer's experts module: ``(x_TH, ids_TK, weights_TK) -> out_TH``.

    ``kernels_backend``: the dispatch/combine kernels this layer runs (``ThemisConfig.kernels``, set by
    ``optimize``; None: the process default of `kernels.set_backend`). ``expert_row_block``: the most rows
    one call of an expert's code computes (``ThemisConfig.expert_row_block``, set by ``optimize``; None:
    all of an expert's rows in one call); more rows are split into blocks, each a call, and concatenated.

    Holds only the experts this rank owns, each as a child module named by its global expert id
    (``self.<e>``, as in the user's ``nn.ModuleList``), so that an optimizer built from
    ``model.parameters()`` sees exactly the owned experts, and their parameter names are the unmodified
    model's (``...experts.4.w1.weight``). The owned experts are the only children with digit names; a
    stacked experts module's parameters that every expert uses (``bank.shared_names``, a shared norm) are
    held as they were, under their own names: dense parameters of the model (``shared_parameters``), data
    parallel through the dense wrapper like any other, read live at every expert call.
    A stacked module with zero-expert rows after its experts' (``bank.zero_rows``, LongCat-Flash) has this
    rank's share of them as a ``zero_expert_rows`` child (``runtime.experts.ZeroExpertRows``): held like
    the experts (``expert_parameters``), never read, shown under the weight's own key in state dicts.
    When the user's experts module wraps its list (``bank.list_name``, Megatron-Core
    ``SequentialMLP.local_experts``) the owned experts are the children of one ``nn.ModuleDict`` child of
    that name (``...experts.local_experts.4.fc1.weight``).

    State dicts speak the unmodified model's keys and shapes (see ``docs/architecture.md``,
    Checkpointing): a rank's ``state_dict()`` holds its owned experts; for stacked ``[E, ...]`` weights
    each weight is one ``ShardedTensor`` of the global shape with one ``[1, ...]`` chunk per owned expert
    at its global offset. ``load_state_dict`` takes such state dicts, or the unmodified model's full one,
    keeping the experts this rank owns.
    """

    kernels_backend: str | None = None
    # ThemisConfig.expert_row_block, set by ``optimize``: the most rows of one expert per call of its code.
    expert_row_block: int | str | None = None

    def __init__(
        self,
        bank: ExpertBank,
        experts: nn.Module,
        shard: Placement,
        *,
        rank: int,
        world_size: int,
        group=None,
        layer: str = "",
        scale_grads: bool = True,
        uniform_routing: bool = False,
        timeout_s: float = deadline.DEFAULT_TIMEOUT_S,
        skips_empty_experts: bool = False,
    ) -> None:
        super().__init__()
        self.uniform_routing = uniform_routing
        # The user's experts module runs only the experts that receive tokens (NLLB/Switch style): an expert
        # no token of the global batch reached in a forward gets no gradient from it, as in one process.
        self.skips_empty_experts = bool(skips_empty_experts)
        if shard.num_devices != world_size or not shard.is_shard_placement():
            raise ValueError(f"MoE layer {layer!r}: not a shard placement over {world_size} ranks")
        self.bank = bank
        self.layer = layer
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout_s = float(timeout_s)      # deadline of every collective of this layer (runtime/deadline.py)
        self.num_experts = bank.num_experts
        self.shard_placement = shard
        if bank.list_name:
            self.add_module(bank.list_name, nn.ModuleDict())
        for e in shard.experts_on(rank):
            self.add_expert(int(e), bank.shard_of(experts, int(e)))
        _hold_shared(self, experts, bank.shared_names)
        if bank.zero_rows:
            # Rows [E, E + Z) of the weights holding zero experts: split over the ranks, never read.
            span = zero_rows_span(bank.num_zero_experts, world_size, rank)
            if span[1] > span[0]:
                self.add_module(ZERO_ROWS_CHILD, ZeroExpertRows(experts, bank, span))
        self.register_buffer("owner_E", torch.tensor(shard.owners().tolist(), dtype=torch.int64), persistent=False)
        self.grad_scale = 1.0 / world_size if world_size > 1 and scale_grads else 1.0
        if bank.form == "stacked":
            _expose_stacked_names(self, bank.names)
        self.register_state_dict_post_hook(_state_dict_in_unmodified_keys)
        self.register_load_state_dict_pre_hook(_load_state_dict_in_unmodified_keys)
        self.register_load_state_dict_post_hook(_report_in_unmodified_keys)

    def set_shard_placement(self, shard: Placement) -> None:
        """Adopt a new shard placement after re-sharding moved the experts (owned experts updated)."""
        if self.owned_experts() != [int(e) for e in shard.experts_on(self.rank)]:
            raise RuntimeError(f"MoE layer {self.layer!r}: held experts do not match the new shard placement")
        self.shard_placement = shard
        self.owner_E.copy_(torch.tensor(shard.owners().tolist(), dtype=torch.int64))

    # ------------------------------------------------------------------ owned experts (the digit-named children)
    def _held(self) -> dict[str, nn.Module]:
        """The owned experts by name ``str(e)``: this module's children, or its wrapper list's."""
        return self._modules[self.bank.list_name]._modules if self.bank.list_name else self._modules

    def owned_experts(self) -> list[int]:
        """Global ids of the experts this rank holds, ascending."""
        return sorted(int(name) for name in self._held() if name.isdigit())

    def expert(self, e: int) -> nn.Module:
        """The module holding owned expert ``e``'s parameters."""
        return self._held()[str(e)]

    def add_expert(self, e: int, module: nn.Module) -> None:
        """Hold expert ``e`` (it arrived at this rank, or this rank owns it from the start)."""
        if str(e) in self._held():
            raise RuntimeError(f"MoE layer {self.layer!r}: expert {e} is already held on rank {self.rank}")
        (self._modules[self.bank.list_name] if self.bank.list_name else self).add_module(str(e), module)

    def remove_expert(self, e: int) -> nn.Module:
        """Stop holding expert ``e`` (it left for another owner); returns its module."""
        return self._held().pop(str(e))

    def expert_parameters(self) -> list[nn.Parameter]:
        """The owned experts' parameters: what the sharded runtime reduces and the dense wrapper must leave
        alone (``parameters()`` adds the shared ones); with them the zero-expert rows this rank holds (each
        held by one rank, like an expert, with a zero gradient every step: nothing to reduce)."""
        rows = zero_rows_of(self)
        return [p for c in self.local_chunks().values() for p in c] + ([] if rows is None else list(rows.parameters()))

    def shared_parameters(self) -> list[nn.Parameter]:
        """The parameters every expert of the layer uses (``bank.shared_names``): dense, data parallel."""
        return list(self.bank.shared_tensors(self).values())

    def local_chunks(self) -> dict[int, list[torch.Tensor]]:
        """Owned experts' parameters, by global expert id (ascending)."""
        return {e: list(self.expert(e).parameters()) for e in self.owned_experts()}

    def stacked_weight(self, name: str, tensors_E: dict[int, torch.Tensor] | None = None):
        """Stacked weight ``name`` of the unmodified model, ``[E, ...]``, as this rank holds it: a
        ``ShardedTensor`` with one ``[1, ...]`` chunk per owned expert at its global offset (views of the
        owned parameters, or of ``tensors_E`` — e.g. their optimizer state — when given); a plain stacked
        copy without a process group (one process holds every expert)."""
        i = self.bank.names.index(name)
        if tensors_E is None:
            tensors_E = {e: params[i].detach() for e, params in self.local_chunks().items()}
        return expert_sharded_tensor(tensors_E, self.shard_placement, self.bank.spec[i], self.group,
                                     name=f"{self.layer}.{name}", flat=self.bank.flat)

    def _routing_error(self, ids_TK: torch.Tensor) -> bool:
        return bool(ids_TK.numel()) and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= self.num_experts)

    def _check_routing(self, ids_TK: torch.Tensor) -> None:
        # Agreed across ranks before any token moves, so that a bad router on one rank fails every rank
        # instead of leaving the others waiting in the all-to-all.
        bad = torch.tensor([int(self._routing_error(ids_TK))], dtype=torch.int64, device=ids_TK.device)
        if self.world_size > 1:
            deadline.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group, timeout_s=self.timeout_s,
                                purpose="routing check", layer=self.layer)
        if bad.item():
            raise ValueError(f"MoE layer {self.layer!r}: a router chose an expert id outside "
                             f"[0, {self.num_experts})")

    def run_experts(self, chunks: dict[int, Sequence[torch.Tensor]], rows_NH: torch.Tensor,
                    counts_E: Sequence[int], skip_empty: bool = False) -> torch.Tensor:
        """Run every expert with rows, or held here, on its rows (grouped by expert, expert order).

        Held experts with zero rows still run on an empty input so that their gradient is zero, not
        missing — the same as the unsharded model, where every expert runs every step. With
        ``skip_empty`` (EP on a layer whose experts module skips experts without tokens: the owner receives
        every row of its experts, so zero rows here means no token of the global batch) they do not run,
        and their gradient stays missing, as in one process.
        """
        outputs = []
        # Read now, not at construction: the dense wrapper may have swapped them (FSDP2's unsharded ones).
        shared = self.bank.shared_tensors(self) if self.bank.shared_names else None
        # Experts are row-wise (their rows are split over ranks anyway), so a block of rows computes what
        # the whole would: only the weight gradient's sum over rows is taken in another order.
        block = row_block(self.expert_row_block, self.bank.chunk_bytes, rows_NH)
        for e, part in enumerate(torch.split(rows_NH, list(counts_E))):
            params = chunks.get(e)
            if params is None:
                if counts_E[e]:
                    raise RuntimeError(f"MoE layer {self.layer!r}: {counts_E[e]} rows of expert {e} arrived on "
                                       f"rank {self.rank}, which does not hold it")
                continue
            if skip_empty and not counts_E[e]:
                continue
            if block is not None and part.shape[0] > block:
                outputs.extend(self.bank.run(params, piece, shared) for piece in part.split(block))
            else:
                outputs.append(self.bank.run(params, part, shared))
        if not outputs:
            # No expert here (and so no rows): an empty result that stays in the autograd graph, so that
            # this rank joins the all-to-all of the backward pass like every other rank.
            if rows_NH.requires_grad:
                out_NH = rows_NH * 0
            else:
                out_NH = rows_NH.new_zeros(rows_NH.shape).requires_grad_(torch.is_grad_enabled())
            if shared and torch.is_grad_enabled():
                # The shared parameters get a zero gradient here, as on a rank whose experts ran on empty
                # rows: every rank then reduces the same set of dense gradients (DDP, FSDP2).
                out_NH = out_NH + sum(p.sum() * 0 for p in shared.values() if p.requires_grad)
            return out_NH
        return torch.cat(outputs, 0)

    def destinations(self, ids_TK: torch.Tensor) -> torch.Tensor:
        return self.owner_E[ids_TK]

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        with record_function("themis::check_routing"):
            self._check_routing(ids_TK)
        if self.uniform_routing:
            # The paper's "Uniform" reference gate (benchmarking only: it changes the model on purpose).
            ids_TK = uniform_ids(ids_TK, self.num_experts)
        chunks = {e: [scale_grad(p, self.grad_scale) for p in c] for e, c in self.local_chunks().items()}
        return dispatch_compute_combine(
            x_TH, ids_TK, weights_TK, self.destinations(ids_TK), self.num_experts,
            lambda rows, counts: self.run_experts(chunks, rows, counts, skip_empty=self.skips_empty_experts),
            group=self.group, world_size=self.world_size, layer=self.layer, timeout_s=self.timeout_s,
            kernels_backend=self.kernels_backend,
        )


def uniform_ids(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pair (t, k) -> expert (t*K + k) mod E: every expert gets the same number of pairs (up to one)."""
    T, K = ids_TK.shape
    return torch.arange(T * K, device=ids_TK.device).view(T, K) % num_experts
