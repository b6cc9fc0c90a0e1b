"""Experts spread over parallel lists, entry e of each being expert e, joined into one ModuleList of experts.

Three forms: ModuleLists of single layers called per expert (``up[e](rows)``, ``down[e](h)``),
ParameterLists of bare weights applied by the block's own code (``F.linear(rows, w_in[e])``: the section
"Experts held as ParameterLists of bare weights" below), and stacked ``[E, ...]`` parameters of the block
itself indexed by expert id, read as E entries each (``rows @ self.w1[e]``: the section "Stacked weights of
the block itself, indexed by expert id"). The first:

Step / Hunyuan-style blocks and much research code hold expert e as entry e of two parallel
``nn.ModuleList`` s of single layers, and run the block's own code between the two calls::

    for e, rows in enumerate(x_sorted.split(counts)):       # or a loop over nonzero(ids == e)
        h = self.dropout(F.gelu(self.up[e](rows)))           # the block's code between the calls
        outs.append(self.down[e](h))

No module is an expert; the pair is: expert e is ``down[e] ∘ between ∘ up[e]``, ``[N, H] -> [N, H]``,
as long as ``between`` treats every row alone. This module reads ``between`` off a probe (the torch
functions applied to ``up[e]``'s output until ``down[e]`` is called, recorded as an FX graph by
``passes.joined.BetweenRecorder``), checks that every pair of calls on the probe computes ``down``'s input
from ``up``'s output so and that the code is row-wise (``passes.joined.row_mixing_reason``), and joins
entry e of each list into :class:`ListsExpert` e of a :class:`ParallelListsExperts` (an ``nn.ModuleList``
of E identical experts: ``runtime.experts.ExpertBank`` form ``"modulelist"``, parameters
``<e>.up.weight`` ...; the same module and parameter objects as the user's lists).

The block's forward runs as written (routing, sort, counts, combine). While it runs, ``self.up`` and
``self.down`` are :class:`PairedLists` views: ``up[e](rows)`` is the call ``experts[e](rows)`` (the whole
expert on those rows), its result kept, and answers a zero placeholder of ``up``'s width, on which the
block's code between the calls runs to no effect; ``down[e](h)`` answers the kept result. With those
views the block calls ``experts[e](rows)`` one by one, which is what capture and replay
(``passes.replay``) serves with one ``experts(x, ids, weights)`` call: the rewrite is that view (the
class of :func:`paired_block_class`) under ``passes.replay.apply_replay``.

Contract:
    :func:`parallel_lists_plan` is read-only (the lists are restored whatever the probe does) and says
    why the block cannot be joined so, or gives the plan; ``passes.detect`` then proves capture and
    replay on the joined trial and ``passes.shard.prepare_moe_layers`` verifies the rewritten block,
    each expert run alone as the runtime runs it, against the original (values and gradients).
    :func:`apply_parallel_lists` moves the lists' entries into ``block.<attr>`` (the lists leave the
    block) and keeps the block's state-dict keys the user's (``up.3.weight``: :class:`ListsKeys`).

Shape suffixes: N rows, H hidden size, W ``up``'s output width, E experts.
"""

from __future__ import annotations

import operator
import re
from types import SimpleNamespace
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from themis_compile.passes.joined import BetweenRecorder, KeyHook, internal_keys, row_mixing_reason
from themis_compile.passes.own_weights import OwnWeightsKeys, WeightsRecorder, WeightValues
from themis_compile.passes.replay import expert_calls


# --- The experts -------------------------------------------------------------------------------------

class ListsExpert(nn.Module):
    """Expert e of parallel lists: entry e of the first list, the block's row-wise code, entry e of the
    second, children under the lists' own names (``up``, ``down``). ``between`` is not a child (it holds
    no tensors; every expert shares it)."""

    def __init__(self, first_name: str, first: nn.Module, second_name: str, second: nn.Module,
                 between: fx.GraphModule) -> None:
        super().__init__()
        self.first_name, self.second_name = first_name, second_name
        self.add_module(first_name, first)
        self.add_module(second_name, second)
        self.__dict__["between"] = between

    def forward(self, rows_NH: torch.Tensor) -> torch.Tensor:
        return self._modules[self.second_name](self.between(self._modules[self.first_name](rows_NH)))


class ParallelListsExperts(nn.ModuleList):
    """The E experts of a block whose expert e is entry e of each of its parallel lists
    (:class:`ListsExpert`); a ModuleList of identical experts called ``experts[e](rows)``."""


@dataclass(frozen=True)
class ParallelListsPlan:
    """How a block's parallel lists are joined: ``block.<attr>`` will hold the :class:`ParallelListsExperts`
    of ``block.<first>`` and ``block.<second>`` (``width``: ``first``'s output width W); ``replay`` is the
    capture-and-replay plan of the joined block (set by detection)."""

    attr: str
    first: str
    second: str
    between: fx.GraphModule
    width: int
    num_experts: int
    replay: Any = None

    @property
    def lists(self) -> tuple[str, ...]:
        return (self.first, self.second)

    @property
    def skips_empty(self) -> bool:
        return bool(getattr(self.replay, "skips_empty", False))

    def experts_of(self, block: nn.Module) -> nn.Module:
        """The joined experts of ``block``: the ones it holds once rewritten, else new ones of its lists
        (which it leaves where they are)."""
        if self.first not in block._modules:
            return block._modules[self.attr]
        firsts, seconds = block._modules[self.first], block._modules[self.second]
        return ParallelListsExperts(ListsExpert(self.first, a, self.second, b, self.between)
                                    for a, b in zip(firsts, seconds))


# --- Reading the lists on a probe --------------------------------------------------------------------

class _RecordingList:
    """One parallel list as the block's forward sees it on the probe: the real entries, each call logged
    (``(which, e, input, output)``); the first list's first output starts a :class:`BetweenRecorder`, the
    second list's call of the same entry ends it."""

    def __init__(self, entries: nn.ModuleList, first: bool, log: dict) -> None:
        self._entries, self._first, self._log = entries, first, log

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Callable]:
        return iter([self[e] for e in range(len(self._entries))])

    def __getitem__(self, e: Any) -> Callable:
        e = int(e)
        if not 0 <= e < len(self._entries):
            raise IndexError(e)
        return lambda *args, **kwargs: self._call(e, args, kwargs)

    def _call(self, e: int, args: tuple, kwargs: dict) -> Any:
        log = self._log
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            log.setdefault("reason", f"entry {e} is called with {len(args)} positional and {len(kwargs)} keyword "
                                     "arguments, not on rows alone")
        rec = log.get("recorder")
        if not self._first and log.get("open") and e == log["root"]:
            rec.__exit__(None, None, None)
            log["open"] = False
            log["between"] = rec.finish(args[0]) if isinstance(args[0], torch.Tensor) else None
        out = self._entries[e](*args, **kwargs)
        log["calls"].append(("first" if self._first else "second", e, args[0] if args else None, out))
        if self._first and isinstance(out, torch.Tensor) and "recorder" not in log:
            rec = log["recorder"] = BetweenRecorder(out)
            log["root"], log["open"] = e, True
            rec.__enter__()
        return out

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the list is read as .{name} inside the forward; only len, [e], iteration and "
                             "entry(rows) calls are served")


def parallel_lists_plan(module: nn.Module, first: str, second: str, run: Callable[[], Any], hidden: int,
                        attr: str) -> tuple[ParallelListsPlan | None, str]:
    """(plan, "") when ``module.<first>`` and ``module.<second>`` hold expert e as entry e of each, called
    ``second[e](between(first[e](rows)))`` with ``between`` row-wise, on the probe ``run()``; else (None, why).
    Read-only: both lists are restored."""
    lists = module._modules[first], module._modules[second]
    log: dict = {"calls": []}
    module.__dict__[first] = _RecordingList(lists[0], True, log)
    module.__dict__[second] = _RecordingList(lists[1], False, log)
    try:
        with torch.no_grad():
            run()
    except Exception as exc:  # noqa: BLE001 - the forward relies on more than entry(rows) calls
        return None, f"its forward fails with recording lists ({type(exc).__name__}: {exc})".splitlines()[0][:300]
    finally:
        if log.get("open"):
            log["recorder"].__exit__(None, None, None)
        module.__dict__.pop(first, None)
        module.__dict__.pop(second, None)
    if "reason" in log:
        return None, log["reason"]
    rec = log.get("recorder")
    between = log.get("between")
    if rec is None:
        return None, f"'{first}' is never called on a probe"
    if between is None:
        return None, (f"the code between '{first}[e]' and '{second}[e]' cannot be part of an expert: "
                      f"{rec.reason or f'{second} is never called after {first}'}")
    # Pair the calls: each entry's calls of the second list follow its calls of the first, in order.
    pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    pairs = []
    for which, e, x_in, out in log["calls"]:
        if which == "first":
            if not (isinstance(x_in, torch.Tensor) and x_in.dim() >= 1 and x_in.shape[-1] == hidden
                    and isinstance(out, torch.Tensor) and out.shape[:-1] == x_in.shape[:-1]):
                return None, (f"'{first}[{e}]' maps {list(getattr(x_in, 'shape', []))} to "
                              f"{list(getattr(out, 'shape', []))}, not rows [N, {hidden}] to rows")
            pending.setdefault(e, []).append((x_in, out))
            continue
        if not pending.get(e):
            return None, f"'{second}[{e}]' is called without '{first}[{e}]' called before it"
        x_NH, h_NW = pending[e].pop(0)
        if not (isinstance(out, torch.Tensor) and out.shape == x_NH.shape):
            return None, (f"'{second}[{e}]' returns {list(getattr(out, 'shape', []))}, not the "
                          f"{list(x_NH.shape)} rows '{first}[{e}]' got")
        pairs.append((e, x_NH, h_NW, x_in))
    if any(pending.values()) or not pairs:
        return None, f"some call of '{first}[e]' is not followed by a call of '{second}[e]'"
    W = pairs[0][2].shape[-1]
    for e, _, h, given in pairs:
        if h.shape[-1] != W:
            return None, f"'{first}[{e}]' gives rows of width {h.shape[-1]}, '{first}[{pairs[0][0]}]' of {W}"
        try:
            same = torch.allclose(between(h).double(), given.double(), rtol=1e-5, atol=1e-6)
        except Exception:  # noqa: BLE001
            same = False
        if not same:
            return None, (f"the rows given to '{second}[{e}]' are not the code recorded between '{first}' and "
                          f"'{second}' applied to the output of '{first}[{e}]'")
    h_all = torch.cat([h.reshape(-1, W) for _, _, h, _ in pairs])
    if (why := row_mixing_reason(between, h_all)) is not None:
        return None, f"the code between '{first}[e]' and '{second}[e]' cannot be part of an expert: {why}"
    return ParallelListsPlan(attr=attr, first=first, second=second, between=between, width=int(W),
                             num_experts=len(lists[0])), ""


# --- The rewrite -------------------------------------------------------------------------------------

class PairedLists:
    """``self.<first>`` or ``self.<second>`` in the rewritten block's forward: ``first[e](rows)`` calls
    ``experts[e](rows)`` (whatever ``self.<attr>`` is then: the experts, or capture and replay's view of
    them), keeps its result and answers zeros ``[..., W]``; ``second[e](h)`` answers the kept result."""

    def __init__(self, block: nn.Module, plan: ParallelListsPlan, first: bool, kept: dict) -> None:
        self._block, self._plan, self._first, self._kept = block, plan, first, kept

    def __len__(self) -> int:
        return self._plan.num_experts

    def __iter__(self) -> Iterator[Callable]:
        return iter([self[e] for e in range(self._plan.num_experts)])

    def __getitem__(self, e: Any) -> Callable:
        e = int(e)
        if not 0 <= e < self._plan.num_experts:
            raise IndexError(e)
        return lambda rows: self._call(e, rows)

    def _call(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self._first:
            experts = self._block.__dict__.get(self._plan.attr)
            experts = self._block._modules[self._plan.attr] if experts is None else experts
            y = experts[e](rows)
            self._kept.setdefault(e, []).append(y)
            return rows.new_zeros((*rows.shape[:-1], self._plan.width))
        kept = self._kept.get(e)
        if not kept:
            raise RuntimeError(f"{self._plan.second}[{e}] is called without {self._plan.first}[{e}] before it")
        y = kept.pop(0)
        if y.shape[:-1] != rows.shape[:-1]:
            raise RuntimeError(f"{self._plan.second}[{e}] is called on {list(rows.shape)} rows, "
                               f"{self._plan.first}[{e}] on {list(y.shape)}")
        return y

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the list is read as .{name} inside the forward; only len, [e], iteration and "
                             "entry(rows) calls are served once its entries are sharded")


class ListsKeys(KeyHook):
    """A state-dict hook: the joined experts' keys ``<block>.<attr>.<e>.<list>.<name>`` are the user's
    ``<block>.<list>.<e>.<name>`` when saving (``loading=False``), and back when loading; for ParameterLists
    (no ``.<name>``) ``<block>.<attr>.<e>.<list>`` and ``<block>.<list>.<e>``."""

    def __init__(self, attr: str, lists: Sequence[str], loading: bool) -> None:
        self.attr, self.lists, self.loading = attr, tuple(lists), loading
        names = "|".join(map(re.escape, self.lists))
        self._inner = re.compile(rf"^{re.escape(attr)}\.(\d+)\.({names})((?:\..+)?)$")
        self._outer = re.compile(rf"^({names})\.(\d+)((?:\..+)?)$")

    def inner_key(self, m: Any) -> str:
        return f"{self.attr}.{m[2]}.{m[1]}{m[3]}"

    def save(self, state_dict: dict, prefix: str) -> None:
        # The user's order too, each list's entries in turn (where the joined experts' keys were).
        items = list(state_dict.items())
        inner = [(i, m) for i, (k, _) in enumerate(items)
                 if k.startswith(prefix) and (m := self._inner.match(k[len(prefix):]))]
        if not inner:
            return
        renamed = sorted(((self.lists.index(m[2]), int(m[1]), i), f"{prefix}{m[2]}.{m[1]}{m[3]}", items[i][1])
                         for i, m in inner)
        at, drop = inner[0][0], {i for i, _ in inner}
        state_dict.clear()
        for i, (k, v) in enumerate(items):
            if i == at:
                state_dict.update((key, value) for _, key, value in renamed)
            if i not in drop:
                state_dict[k] = v


# torch.distributed.checkpoint's state-dict functions name every entry by its module path
# (``<block>.<attr>.<e>.<list>.<name>``: they check state-dict keys against parameter names), and the user's
# key swaps two of its parts, which no ``_fqn_modifiers`` can express. So within `internal_keys` the hooks
# stand aside, and `to_user_keys` renames the results of those functions afterwards (and back before a load).
def _joined_blocks(model: nn.Module) -> list[tuple[str, ParallelListsPlan]]:
    """(key prefix without wrapper names, plan) of every rewritten block in ``model``."""
    return _rewritten_blocks(model, "_themis_parallel_lists")


def _rewritten_blocks(model: nn.Module, plan_attr: str) -> list[tuple[str, Any]]:
    """(key prefix without wrapper names, plan) of every block of ``model`` whose class holds ``plan_attr``."""
    out = []
    for path, module in model.named_modules():
        plan = getattr(type(module), plan_attr, None)
        if plan is not None:
            fqn = ".".join(part for part in path.split(".") if part not in ("_orig_mod", "_checkpoint_wrapped_module"))
            out.append((f"{fqn}." if fqn else "", plan))
    return out


def to_user_keys(model: nn.Module, state_dict: dict, *, heads: Sequence[str] = ("",), loading: bool = False) -> None:
    """Rename in place the keys of ``state_dict`` (a model state dict, or an optimizer's ``state`` dict, or
    a flattened optimizer state dict with ``heads=("state.", "param_groups.")``) from the joined experts'
    module paths to the user's keys, or back with ``loading=True``."""
    for prefix, plan in _joined_blocks(model):
        hook = ListsKeys(plan.attr, plan.lists, loading)
        for head in heads:
            hook.apply(state_dict, head + prefix)
    for prefix, plan in _rewritten_blocks(model, "_themis_own_weights"):
        hook = OwnWeightsKeys(plan.attr, plan.names, loading, order=plan.order)
        for head in heads:
            hook.apply(state_dict, head + prefix)


def user_key(model: nn.Module, key: str, *, loading: bool = False) -> str:
    """One key renamed as `to_user_keys` renames it."""
    d = {key: None}
    to_user_keys(model, d, loading=loading)
    return next(iter(d))


def paired_block_class(block_cls: type, plan: ParallelListsPlan) -> type:
    """A subclass of ``block_cls`` whose forward is its own with ``self.<first>`` / ``self.<second>`` seen
    as :class:`PairedLists` over ``self.<attr>`` (inside the forward only)."""

    def block_forward(self, *args, **kwargs):
        kept: dict = {}
        self.__dict__[plan.first] = PairedLists(self, plan, True, kept)
        self.__dict__[plan.second] = PairedLists(self, plan, False, kept)
        try:
            return block_cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__.pop(plan.first, None)
            self.__dict__.pop(plan.second, None)

    block_forward.__doc__ = (f"{block_cls.__name__}.forward with {plan.first}[e] and {plan.second}[e] served by "
                             f"{plan.attr}[e].")
    return type(block_cls.__name__, (block_cls,), {"forward": block_forward, "__module__": block_cls.__module__,
                                                   "_themis_original_class": block_cls,
                                                   "_themis_parallel_lists": plan})


def apply_parallel_lists(block: nn.Module, plan: ParallelListsPlan) -> None:
    """Rewrite ``block`` in place: the entries of its two lists move into ``block.<attr>`` (a
    :class:`ParallelListsExperts`, the same modules and parameter objects), its class gets the forward of
    :func:`paired_block_class`, and its state-dict keys stay the user's (:class:`ListsKeys`). Capture and
    replay (``passes.replay.apply_replay``) goes on top."""
    experts = plan.experts_of(block)
    del block._modules[plan.first], block._modules[plan.second]
    block.add_module(plan.attr, experts)
    block.__class__ = paired_block_class(type(block), plan)
    block.register_state_dict_post_hook(ListsKeys(plan.attr, (plan.first, plan.second), loading=False))
    block.register_load_state_dict_pre_hook(ListsKeys(plan.attr, (plan.first, plan.second), loading=True))


# --- Experts held as ParameterLists of bare weights ----------------------------------------------------
#
# Expert e may be entry e of one or more parallel ``nn.ParameterList`` s, applied by the block's own code:
#
#     for e, (w_in, w_out) in enumerate(zip(self.w_in, self.w_out)):
#         rows = torch.nonzero(ids == e).flatten()
#         if rows.numel():                                               # experts without tokens skipped
#             y = F.linear(F.gelu(F.linear(x[rows], w_in)), w_out)       # expert e: the code on its weights
#             out = out.index_add(0, rows, y * weight[rows, None])
#
# No module is an expert, and no call: the code on entry e's weights is. It is read off a probe
# (``passes.own_weights.WeightsRecorder`` on the first used expert's weights: its uses, the torch functions
# taking them or values computed from them alone (``w.t()``), from the first to the U-th, U the uses per
# expert, with the one other tensor the first use on another takes as the rows), checked to be what every
# expert computes on the probe, and becomes :class:`EntriesExpert` e (parameters ``w_in``, ``w_out``: the
# user's parameter objects) of a :class:`ParamListsExperts`. The rewritten block runs its forward as written
# with its lists seen as tuples of shape-only (meta) stand-ins (:class:`EntryStandIns`): the first use of
# expert e's stand-ins on rows calls ``experts[e](rows)`` and, like every use but the U-th, answers zeros,
# on which the block's code runs to no effect; the U-th answers the expert's result. So the block calls
# ``experts[e](rows)`` one by one, which capture and replay (``passes.replay``) serves with one
# ``experts(x, ids, weights)`` call.

class EntriesExpert(nn.Module):
    """Expert e of parallel ParameterLists: entry e of each list, under the list's name, computing the
    block's own code on them (``region(expert, rows_NH) -> [N, H]``, recorded on a probe; not a child: it
    holds no tensors and every expert shares it)."""

    def __init__(self, weights: dict[str, nn.Parameter], region: fx.GraphModule) -> None:
        super().__init__()
        for name, w in weights.items():
            self.register_parameter(name, w)
        self.__dict__["region"] = region

    def forward(self, rows_NH: torch.Tensor) -> torch.Tensor:
        return self.region(self, rows_NH)


class ParamListsExperts(nn.ModuleList):
    """The E experts of a block whose expert e is entry e of each of its ParameterLists
    (:class:`EntriesExpert`); a ModuleList of identical experts called ``experts[e](rows)``."""


@dataclass(frozen=True)
class ParamListsPlan:
    """How a block's ParameterLists ``lists`` become ``block.<attr>`` (a :class:`ParamListsExperts`):
    each expert computes ``region``, which takes its weights in ``uses`` torch functions; ``specs`` is
    (list, entry shape, dtype) of each list; ``replay`` the capture-and-replay plan (set by detection).
    ``stacked``: the "lists" are stacked ``[E, ...]`` parameters of the block itself, entry e being ``w[e]``,
    and become an :class:`IndexedExperts` (``order``: the block's own parameters in the user's order)."""

    attr: str
    lists: tuple[str, ...]
    region: fx.GraphModule
    uses: int
    specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    num_experts: int
    replay: Any = None
    stacked: bool = False
    order: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.lists

    @property
    def skips_empty(self) -> bool:
        return bool(getattr(self.replay, "skips_empty", False))

    def experts_of(self, block: nn.Module) -> nn.Module:
        """The experts of ``block``: the ones it holds once rewritten, else new ones over its lists'
        entries (which stay where they are)."""
        if self.stacked:
            if self.attr in block._modules:
                return block._modules[self.attr]
            return IndexedExperts({name: block._parameters[name] for name in self.lists}, self.region)
        if self.lists[0] not in block._modules:
            return block._modules[self.attr]
        lists = [block._modules[name] for name in self.lists]
        return ParamListsExperts(EntriesExpert({name: entries[e] for name, entries in zip(self.lists, lists)},
                                               self.region) for e in range(self.num_experts))


def describe_region(region: fx.GraphModule) -> str:
    """The recorded expert code in a few words: its functions in order (``linear gelu linear``)."""
    names = [getattr(n.target, "__name__", str(n.target)) for n in region.graph.nodes
             if n.op == "call_function" and n.target not in (getattr, operator.getitem)]
    return " ".join(names) or "nothing"


class EntryUses(TorchFunctionMode):
    """Logs, on a probe, every use of entries of ``lists`` (by identity; a use as in ``passes.own_weights``: a
    torch function taking them, or values computed from them alone, and giving a tensor): ``(e, the other
    tensors it takes, its output)``; ``reason`` says why the code is no expert code (one function taking the
    weights of two experts)."""

    def __init__(self, lists: Sequence[nn.ParameterList]) -> None:
        super().__init__()
        self._values = WeightValues({e: [entries[e] for entries in lists] for e in range(len(lists[0]))})
        self.log: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
        self.reason: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        experts, others = self._values.split(flat)
        if experts and isinstance(out, torch.Tensor):
            if len(experts) > 1 and self.reason is None:
                name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
                self.reason = f"{name} takes the weights of experts {sorted(experts)} at once"
            self.log.append((min(experts), others, out))
            self._values.follow(experts, others, out)
        return out


def param_lists_plan(module: nn.Module, lists: Sequence[str], run: Callable[[], Any], hidden: int, attr: str
                     ) -> tuple[ParamListsPlan | None, str]:
    """(plan, "") when entry e of each of ``module``'s ParameterLists ``lists`` is expert e, applied by the
    same code on rows ``[N, hidden] -> [N, hidden]`` on the probe ``run()``; else (None, why). Read-only."""
    entries = {name: tuple(module._modules[name]) for name in lists}
    found, why = _entries_code(entries, run, hidden)
    if found is None:
        return None, why
    region, uses = found
    specs = tuple((name, tuple(lst[0].shape), lst[0].dtype) for name, lst in entries.items())
    return ParamListsPlan(attr=attr, lists=tuple(lists), region=region, uses=uses, specs=specs,
                          num_experts=len(entries[lists[0]])), ""


def _entries_code(entries: dict[str, Sequence[torch.Tensor]], run: Callable[[], Any], hidden: int
                  ) -> tuple[tuple[fx.GraphModule, int] | None, str]:
    """((region, uses), "") when entry e of each of ``entries`` (name -> E tensors) is expert e, applied by the
    same code on rows ``[N, hidden] -> [N, hidden]`` on the probe ``run()``; else (None, why)."""
    names, lists = tuple(entries), list(entries.values())
    E = len(lists[0])
    # Step 1: which expert each use of the entries serves, and how many uses per expert.
    seen = EntryUses(lists)
    with torch.no_grad(), seen:
        run()
    if seen.reason is not None:
        return None, seen.reason
    uses_E = [sum(e == u[0] for u in seen.log) for e in range(E)]
    if not any(uses_E):
        return None, "no torch function uses their entries on a probe"
    used = [e for e in range(E) if uses_E[e]]
    if len({uses_E[e] for e in used}) != 1:
        return None, (f"the experts' weights have different numbers of uses on a probe "
                      f"({dict((e, uses_E[e]) for e in used)}): no one code is every expert's")
    U = uses_E[used[0]]
    # Step 2: the code of the first used expert, from its first use to the U-th.
    first = seen.log[0][0]
    recorder = WeightsRecorder({name: lst[first] for name, lst in zip(names, lists)}, U,
                               words=(f"expert {first}'s weights", "its rows", "its rows alone"))
    with torch.no_grad(), recorder:
        run()
    region = recorder.finish()
    if region is None:
        return None, f"the code on expert {first}'s weights cannot be recorded as an expert: {recorder.reason}"
    if not (len(recorder.x_shape) >= 1 and recorder.x_shape[-1] == hidden and recorder.y_shape == recorder.x_shape):
        return None, (f"the code on an expert's weights maps {list(recorder.x_shape)} to {list(recorder.y_shape)}, "
                      f"not rows [N, {hidden}] to rows of the same shape")
    # Step 3: that code, on each expert's weights, is what the block computed for every expert.
    for e in used:
        calls = [u for u in seen.log if u[0] == e]
        weights = SimpleNamespace(**{name: lst[e] for name, lst in zip(names, lists)})
        for i in range(0, len(calls), U):
            rows, y = next((u[1] for u in calls[i:i + U] if u[1]), []), calls[i + U - 1][2]
            if len(rows) != 1 or rows[0].dim() != len(recorder.x_shape) or rows[0].shape[-1] != hidden:
                return None, f"the first use of expert {e}'s weights on another tensor does not take its rows alone"
            try:
                with torch.no_grad():
                    same = torch.allclose(region(weights, rows[0]).double(), y.double(), rtol=1e-5, atol=1e-6)
            except Exception:  # noqa: BLE001
                same = False
            if not same:
                return None, (f"the code recorded on expert {first}'s weights, applied to expert {e}'s, does not give "
                              f"what the block computes for expert {e}")
    return (region, U), ""


class StackedEntries(tuple):
    """A stacked ``[E, ...]`` weight of the block seen as the tuple of its E entries ``w[e]`` (the
    indexed-weights reading), its metadata still readable as the weight's: ``w.shape[0]``, ``w.size(0)``,
    ``w.dim()``, ``w.dtype`` (a forward sizing a ``bincount`` by them). Its values are read only entry by
    entry."""

    def __new__(cls, entries: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
                device: torch.device) -> StackedEntries:
        obj = super().__new__(cls, entries)
        obj.shape, obj.dtype, obj.device = torch.Size(shape), dtype, device
        return obj

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class EntryStandIns(TorchFunctionMode):
    """The rewritten block's ParameterLists while its forward runs: ``lists[name]`` is a tuple of E
    shape-only (meta) stand-ins. Of every ``plan.uses`` uses of expert e's stand-ins, one on them alone
    answers a stand-in too (``w.t()``), the first taking another tensor calls ``call(e, rows)`` on it, and
    every other one but the last answers zeros of its shape, the last the call's result."""

    def __init__(self, plan: ParamListsPlan, call: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lists = {name: self._entries(plan, shape, dtype) for name, shape, dtype in plan.specs}
        self._values = WeightValues({e: [stand_ins[e] for stand_ins in self.lists.values()]
                                     for e in range(plan.num_experts)})
        self.plan, self.call = plan, call
        self.uses_E = [0] * plan.num_experts
        self._kept: dict[int, torch.Tensor] = {}

    @staticmethod
    def _entries(plan: ParamListsPlan, shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        entries = tuple(torch.empty(shape, dtype=dtype, device="meta") for _ in range(plan.num_experts))
        return StackedEntries(entries, (plan.num_experts, *shape), dtype, torch.device("meta")) if plan.stacked \
            else entries

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        experts, real = self._values.split(flat)
        if not experts:
            return func(*args, **kwargs)
        meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (tuple(args), kwargs))
        out_meta = func(*meta[0], **meta[1])
        if not isinstance(out_meta, torch.Tensor):
            return out_meta      # a size, a dimension, a dtype of a weight
        if len(experts) > 1:
            raise RuntimeError(f"a torch function takes the weights of experts {sorted(experts)} at once, which the "
                               "probe did not show")
        (e,) = experts
        self.uses_E[e] += 1
        step = (self.uses_E[e] - 1) % self.plan.uses + 1
        if not real and step < self.plan.uses:
            self._values.follow(experts, real, out_meta)
            return out_meta      # computed from the weights alone: a stand-in too
        if e not in self._kept:
            if len(real) != 1:
                raise RuntimeError(f"the first use of expert {e}'s weights on other tensors takes {len(real)}, on "
                                   "the probe its rows alone")
            self._kept[e] = self.call(e, real[0])
        if step == self.plan.uses:
            y = self._kept.pop(e)
            if y.shape != out_meta.shape:
                raise RuntimeError(f"the last torch function taking expert {e}'s weights gives "
                                   f"{list(out_meta.shape)}, the expert {list(y.shape)}")
            return y
        return torch.zeros(out_meta.shape, dtype=out_meta.dtype, device=real[0].device if real else None)


def listed_block_class(block_cls: type, plan: ParamListsPlan) -> type:
    """A subclass of ``block_cls`` whose forward is its own with ``self.<list>`` seen as the stand-ins of
    :class:`EntryStandIns` over ``self.<attr>`` (inside the forward only)."""

    def block_forward(self, *args, **kwargs):
        def call(e: int, rows: torch.Tensor) -> torch.Tensor:
            experts = self.__dict__.get(plan.attr)      # capture and replay's view, else the experts
            if experts is not None:
                return experts[e](rows)
            return expert_calls(self._modules[plan.attr], plan.num_experts)[e](rows)

        mode = EntryStandIns(plan, call)
        self.__dict__.update(mode.lists)
        try:
            with mode:
                out = block_cls.forward(self, *args, **kwargs)
        finally:
            for name in plan.lists:
                self.__dict__.pop(name, None)
        if any(n % plan.uses for n in mode.uses_E):
            raise RuntimeError(f"{block_cls.__name__}: torch functions took its experts' weights {mode.uses_E} times, "
                               f"not a multiple of {plan.uses} (the probe's) each; the moved code would not be what "
                               "the block computes")
        return out

    block_forward.__doc__ = (f"{block_cls.__name__}.forward with the code on entry e of {', '.join(plan.lists)} "
                             f"served by {plan.attr}[e].")
    # (Which key hook `to_user_keys` applies: the stacked weights' keys are own weights', ``w1``.)
    plan_attr = "_themis_own_weights" if plan.stacked else "_themis_parallel_lists"
    return type(block_cls.__name__, (block_cls,), {"forward": block_forward, "__module__": block_cls.__module__,
                                                   "_themis_original_class": block_cls, plan_attr: plan})


def apply_param_lists(block: nn.Module, plan: ParamListsPlan) -> None:
    """Rewrite ``block`` in place: the entries of its ParameterLists move into ``block.<attr>`` (a
    :class:`ParamListsExperts`, the same parameter objects), its class gets the forward of
    :func:`listed_block_class`, and its state-dict keys stay the user's (``w_in.3``: :class:`ListsKeys`).
    Capture and replay (``passes.replay.apply_replay``) goes on top. Stacked weights (``plan.stacked``) move
    into an :class:`IndexedExperts`, their keys staying the user's ``w1`` (:class:`OwnWeightsKeys`)."""
    experts = plan.experts_of(block)
    for name in plan.lists:
        if plan.stacked:
            del block._parameters[name]
        else:
            del block._modules[name]
    block.add_module(plan.attr, experts)
    block.__class__ = listed_block_class(type(block), plan)
    if plan.stacked:
        block.register_state_dict_post_hook(OwnWeightsKeys(plan.attr, plan.lists, loading=False, order=plan.order))
        block.register_load_state_dict_pre_hook(OwnWeightsKeys(plan.attr, plan.lists, loading=True))
        return
    block.register_state_dict_post_hook(ListsKeys(plan.attr, plan.lists, loading=False))
    block.register_load_state_dict_pre_hook(ListsKeys(plan.attr, plan.lists, loading=True))


# --- Stacked weights of the block itself, indexed by expert id ------------------------------------------
#
# A block may hold its experts' weights stacked, ``[E, ...]`` parameters of its own, and apply expert e's
# by indexing them with a Python int in a loop, as torchtitan's for-loop fallback of its grouped experts does:
#
#     for e, rows in enumerate(x_sorted.split(counts)):
#         outs.append(F.gelu(rows @ self.w1[e]) @ self.w2[e])
#
# Indexed by an int, a stacked weight is E entries: it is read as the ParameterLists above are, with each
# weight seen as the tuple of its E entries ``w[e]`` while the probe runs (code that reads a stacked weight
# otherwise, ``self.w1[ids]`` or ``self.w1.shape``, fails so and is not this form). The experts are one
# module of the user's stacked parameters, :class:`IndexedExperts` (the runtime's stacked form; the
# checkpoint holds ``w1 [E, ...]`` under the user's key, :class:`OwnWeightsKeys`), called ``experts(x, ids,
# weights)``, expert e the recorded code on the entries ``w[e]``. The rewritten block runs its forward as
# the ParameterList blocks do, each weight a tuple of E shape-only entries (:class:`EntryStandIns`), and
# capture and replay serves expert e's calls (``passes.replay.expert_calls``).

class IndexedExperts(nn.Module):
    """The stacked ``[E, ...]`` weights a block held itself and indexed by expert id, under their own names;
    expert e computes ``region`` (recorded on a probe; not a child) on the entries ``w[e]``. Called as the
    runtime calls experts, ``experts(x_TH, ids_TK, weights_TK)``; one expert alone is this module with
    ``[1, ...]`` slices."""

    def __init__(self, weights: dict[str, nn.Parameter], region: fx.GraphModule) -> None:
        super().__init__()
        for name, w in weights.items():
            self.register_parameter(name, w)
        self.__dict__["region"] = region

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        E = next(iter(self._parameters.values())).shape[0]
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):      # every expert, on no rows too: each stacked weight has a gradient every step
            token_N, k_N = torch.where(ids_TK == e)
            entries = SimpleNamespace(**{name: w[e] for name, w in self._parameters.items()})
            y_NH = self.region(entries, x_TH[token_N]) * weights_TK[token_N, k_N, None]
            out_TH.index_add_(0, token_N, y_NH.to(out_TH.dtype))
        return out_TH


def indexed_weights_plan(module: nn.Module, names: Sequence[str], run: Callable[[], Any], hidden: int, attr: str
                         ) -> tuple[ParamListsPlan | None, str]:
    """(plan, "") when entry e (``w[e]``) of each of ``module``'s own stacked weights ``names`` is expert e's,
    applied by the same code on rows ``[N, hidden] -> [N, hidden]`` on the probe ``run()`` with every weight
    seen as the tuple of its E entries; else (None, why). Read-only."""
    weights = {name: module._parameters[name] for name in names}
    with torch.no_grad():
        entries = {name: StackedEntries(w.unbind(0), w.shape, w.dtype, w.device) for name, w in weights.items()}

    def run_on_entries() -> Any:
        module.__dict__.update(entries)
        try:
            return run()
        finally:
            for name in names:
                module.__dict__.pop(name, None)

    try:
        found, why = _entries_code(entries, run_on_entries, hidden)
    except Exception as exc:  # noqa: BLE001 - the forward reads the stacked weights otherwise than w[e]
        return None, (f"its forward fails with each stacked weight seen as the tuple of its entries w[e] "
                      f"({type(exc).__name__}: {exc})").splitlines()[0][:300]
    if found is None:
        return None, why
    region, uses = found
    specs = tuple((name, tuple(w.shape[1:]), w.dtype) for name, w in weights.items())
    return ParamListsPlan(attr=attr, lists=tuple(names), region=region, uses=uses, specs=specs,
                          num_experts=int(next(iter(weights.values())).shape[0]), stacked=True,
                          order=tuple(module._parameters)), ""
