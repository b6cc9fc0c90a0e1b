"""Experts split over two stacked modules called on the same sorted rows, joined into one experts module.

HF JetMoE's MoE block (``JetMoeMoE``) holds each expert in two halves, ``input_linear.weight [E, 2F, H]``
and ``output_linear.weight [E, H, F]`` (two ``ParallelExperts``), both called on the rows sorted by
expert with the rows per expert, and runs code of its own between the two calls::

    h_N2F = self.input_linear(x_TH[batch_index], expert_size)    # [N, H] -> [N, 2F], expert by expert
    g_NF = act(h_N2F.chunk(2, -1)[0]) * h_N2F.chunk(2, -1)[1]      # the block's code between the calls
    y_NH = self.output_linear(g_NF, expert_size)                  # [N, F] -> [N, H], expert by expert

Neither half maps an expert's input rows to its output rows, but together they do: expert e is
``output_linear[e] ∘ between ∘ input_linear[e]`` on rows ``[N, H] -> [N, H]`` as soon as ``between``
treats every row alone. This module reads ``between`` off a probe (:class:`BetweenRecorder`: the torch
functions applied to the first half's output until the second half is called, as an FX graph), checks
that it is row-wise (:func:`row_mixing_reason`), and joins the three into :class:`JoinedExperts`, a
stacked experts module (parameters ``input_linear.weight [E, ...]``, ``output_linear.weight [E, ...]``,
the user's own modules as its children) called as ``experts(x_TH, ids_TK, weights_TK)``, which
``runtime.experts.ExpertBank`` cuts into chunks and runs one expert at a time like any stacked module.

The block's forward keeps running as written (its router, its sort, its combine, ``+ self.bias``); while
it runs, ``self.input_linear`` is :meth:`JoinedCall.first`, which serves the rows with ONE call of the
(sharded) joined experts and answers a zero placeholder of the first half's width, on which the block's
code between the calls runs to no effect, and ``self.output_linear`` is :meth:`JoinedCall.second`,
which answers the joined result (:func:`joined_block_class`).

Contract:
    Detection is read-only: :func:`record_between` runs the block on a probe with recording stand-ins
    for the two halves and restores them. A layer is joined only when each half is called once per
    forward on the same counts, the first on rows ``[N, H]`` and the second returning rows ``[N, H]``,
    and the rows given to the second are computed from the first's output by torch functions alone (no
    other tensor: a parameter of the block, a value from the router; nothing modified in place);
    :func:`row_mixing_reason` then proves the code row-wise on the probe (a subset of rows, reversed,
    gives those rows of the whole), and ``passes.shard.prepare_moe_layers`` verifies the rewritten block,
    each expert run alone as the runtime runs it, against the original (values and gradients). Parameter
    objects are the user's; the block's state-dict keys stay the user's (``mlp.input_linear.weight``,
    :class:`JoinedKeys`), and ``torch.distributed.checkpoint`` resolves them through ``_fqn_modifiers``.

Pseudo-code:
    first, second = the two stacked children called on rows sorted by expert     # passes.detect
    between = record(ops on first's output until second is called)              # Step 1
    reject unless between(h[rows]) == between(h)[rows] for a reversed subset     # Step 2
    experts = JoinedExperts(first, second, between)                              # Step 3
    block.<experts> = experts; block.forward sees first/second as JoinedCall       # Step 4 (rewrite)

Shape suffixes: T tokens, K top-k, H hidden size, E experts, N rows sorted by expert, W the first half's
output width.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from themis_compile.runtime.experts import NUM_EXPERTS_ATTRS


# --- Step 1: the code between the two calls -----------------------------------------------------------

VALUE_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__}


def in_place_call(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` writes into its input: ``mul_``, ``__iadd__``, ``inplace=True`` (``F.relu``,
    ``F.dropout``); a function that returns its input untouched (dropout with p = 0) is not."""
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__") or name.startswith("__i") or bool(kwargs.get("inplace"))


class BetweenRecorder(TorchFunctionMode):
    """Records, as an FX graph of one input, the torch functions applied to ``root`` (the first half's
    output) and to everything computed from it, until :meth:`finish` names the tensor given to the second
    half. ``reason`` says why the code cannot be replayed on other rows (a tensor not computed from
    ``root`` used beside it, a tensor modified in place, a value read into Python), None while it can."""

    def __init__(self, root: torch.Tensor) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self._node: dict[int, tuple[torch.Tensor, fx.Node]] = {id(root): (root, self.graph.placeholder("h"))}
        self.reason: str | None = None

    def _tracked(self, v: Any) -> fx.Node | None:
        entry = self._node.get(id(v)) if isinstance(v, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is v else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        if not any(self._tracked(v) is not None for v in flat):
            return out      # code of the block that does not touch the rows (nothing to replay)
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if self.reason is None:
            untracked = [v for v in flat if isinstance(v, torch.Tensor) and self._tracked(v) is None]
            if untracked:
                self.reason = (f"{name} uses a tensor {list(untracked[0].shape)} that is not computed from the first "
                               "half's rows (a parameter of the block, a routing value)")
            elif func is torch.Tensor.__setitem__ or (
                    any(out is v for v in flat if isinstance(v, torch.Tensor)) and in_place_call(func, kwargs)):
                self.reason = f"{name} modifies rows in place"
            elif any(out is v for v in flat if isinstance(v, torch.Tensor)):
                return out      # returns its input as it is (dropout in eval mode or with p = 0): nothing to replay
            elif func in VALUE_READS:
                # Python control flow on the rows' values would be replayed as the probe took it.
                self.reason = f"{name} reads values of the rows into Python (a branch or a count on them)"
        if self.reason is not None or not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            return out      # (a size, a dtype: used as constants where the code goes on)
        node = self.graph.call_function(func, *tree_map(lambda v: self._tracked(v) or v, (tuple(args), kwargs)))
        if isinstance(out, torch.Tensor):
            self._node[id(out)] = (out, node)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    self._node[id(t)] = (t, self.graph.call_function(operator.getitem, (node, i)))
        return out

    def finish(self, given: torch.Tensor) -> fx.GraphModule | None:
        """The recorded code as a module ``between(h) -> given``, or None (``reason`` says why)."""
        if self.reason is None and (node := self._tracked(given)) is None:
            self.reason = ("the rows given to the second half are not computed from the first half's output by "
                           "torch functions alone")
        if self.reason is not None:
            return None
        self.graph.output(node)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        return fx.GraphModule(nn.Module(), self.graph, class_name="Between")


def describe_between(between: fx.GraphModule) -> str:
    """The code between the two halves in a few words: its functions in order (``chunk silu mul``)."""
    names = [getattr(n.target, "__name__", str(n.target)) for n in between.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    return " ".join(names) or "nothing"


class _RecordingHalf(nn.Module):
    """Stands in for one half on a probe: runs it, records its calls; the first half's output starts a
    :class:`BetweenRecorder`, the second half's call ends it."""

    def __init__(self, half: nn.Module, first: bool, log: dict) -> None:
        super().__init__()
        self.inner, self.first, self.log = half, first, log

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = tuple(args) + tuple(kwargs.values())
        self.log["calls"].append(("first" if self.first else "second", call))
        rec = self.log.get("recorder")
        if not self.first and rec is not None and self.log.get("open"):
            rec.__exit__(None, None, None)
            self.log["open"] = False
            self.log["between"] = rec.finish(call[0]) if isinstance(call[0], torch.Tensor) else None
        out = self.inner(*args, **kwargs)
        self.log["outputs"].append(out)
        if self.first and isinstance(out, torch.Tensor) and "recorder" not in self.log:
            rec = self.log["recorder"] = BetweenRecorder(out)
            rec.__enter__()
            self.log["open"] = True
        return out


@dataclass
class BetweenRecord:
    """What one probe forward shows of the two halves: every call (``("first" | "second", args)``, in order),
    their outputs, the code between them (None with ``reason``) and the first half's output it starts from."""

    calls: list[tuple[str, tuple]]
    outputs: list[Any]
    between: fx.GraphModule | None
    reason: str | None
    h: torch.Tensor | None


def record_between(module: nn.Module, first: str, second: str, run: Any) -> BetweenRecord:
    """Run ``run()`` (a probe forward of ``module``) with ``module.<first>`` and ``module.<second>`` seen as
    recording stand-ins; both are restored whatever happens."""
    halves = getattr(module, first), getattr(module, second)
    log: dict = {"calls": [], "outputs": []}
    setattr(module, first, _RecordingHalf(halves[0], True, log))
    setattr(module, second, _RecordingHalf(halves[1], False, log))
    try:
        run()
    finally:
        if log.get("open"):
            log["recorder"].__exit__(None, None, None)
        setattr(module, first, halves[0])
        setattr(module, second, halves[1])
    rec = log.get("recorder")
    reason = None if rec is None else rec.reason
    if rec is not None and "between" not in log and reason is None:
        reason = "the second half is never called after the first"
    first_out = next((o for (which, _), o in zip(log["calls"], log["outputs"]) if which == "first"), None)
    return BetweenRecord(log["calls"], log["outputs"], log.get("between"), reason,
                         first_out if isinstance(first_out, torch.Tensor) else None)


# --- Step 2: row-wise ------------------------------------------------------------------------------------

def row_mixing_reason(between: nn.Module, h_NW: torch.Tensor) -> str | None:
    """Why ``between`` does not treat every row alone, or None when on the probe rows ``h_NW`` it does: the
    rows of a reversed subset (every other row, from the last) give exactly those rows of the whole (a
    cumulative sum or a mean over rows, a view sized by N, a sort of the rows all fail it)."""
    N = h_NW.shape[0]
    with torch.no_grad():
        try:
            whole = between(h_NW)
            rows = torch.arange(N - 1, -1, -2, device=h_NW.device)
            part = between(h_NW[rows])
        except Exception as exc:
            return (f"the code between the two calls fails on other rows than the probe's ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:120]})")
        if not isinstance(whole, torch.Tensor) or whole.dim() != 2 or whole.shape[0] != N:
            return "the code between the two calls does not give one row per row"
        if part.shape != whole[rows].shape or not torch.allclose(part.double(), whole[rows].double(),
                                                                 rtol=1e-5, atol=1e-6, equal_nan=True):
            return ("the code between the two calls mixes rows (some rows of it differ when it runs on fewer rows, "
                    "e.g. a cumulative sum or a mean over rows): it is no part of an expert, which sees only its "
                    "own rows")
    return None


# --- Step 3: the joined experts ------------------------------------------------------------------------

class JoinedExperts(nn.Module):
    """The experts of a block that holds each in two stacked halves with row-wise code between them:
    expert e is ``second[e] ∘ between ∘ first[e]``, ``[N, H]`` rows to ``[N, H]`` rows, called as
    ``experts(x_TH, ids_TK, weights_TK) -> out_TH`` (each (token, slot) pair a row, sorted by expert, the
    two halves called on those rows as the block calls them, the results combined with the weights).

    The halves are the user's modules, children under their own names (``input_linear``,
    ``output_linear``), so the parameters are stacked ``[E, ...]`` under ``input_linear.weight``...:
    ``runtime.experts.ExpertBank`` reads it as a stacked module and runs one expert as a parameter-free
    copy with ``num_experts = 1`` and ``[1, ...]`` slices; setting :attr:`num_experts` sets every
    ``num_experts``-like attribute of the halves that equals it too (JetMoE's ``ParallelExperts`` loops
    over ``range(self.num_experts)``)."""

    def __init__(self, first_name: str, first: nn.Module, second_name: str, second: nn.Module,
                 between: nn.Module, num_experts: int, counts_as_list: bool) -> None:
        super().__init__()
        self.first_name, self.second_name = first_name, second_name
        self.add_module(first_name, first)
        self.add_module(second_name, second)
        self.between = between
        self._num_experts = num_experts
        self.counts_as_list = counts_as_list     # the block passes the counts as a list of ints (else a tensor)

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @num_experts.setter
    def num_experts(self, value: int) -> None:
        for half in (self._modules[self.first_name], self._modules[self.second_name]):
            for sub in half.modules():
                for attr in NUM_EXPERTS_ATTRS:
                    if getattr(sub, attr, None) == self._num_experts and not isinstance(getattr(sub, attr), bool):
                        setattr(sub, attr, value)
        self._num_experts = value

    def rows(self, rows_NH: torch.Tensor, counts_E: Any) -> torch.Tensor:
        """The experts on rows sorted by expert, ``counts_E[e]`` of them for expert e: both halves as the
        block calls them, the code between them in between."""
        h_NW = self._modules[self.first_name](rows_NH, counts_E)
        return self._modules[self.second_name](self.between(h_NW), counts_E)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        T, K = ids_TK.shape
        flat_N = ids_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)
        counts_E = torch.zeros(self.num_experts, dtype=torch.long, device=flat_N.device).scatter_add_(
            0, flat_N, torch.ones_like(flat_N))
        y_NH = self.rows(x_TH[order_N // K], counts_E.tolist() if self.counts_as_list else counts_E)
        # view(T, K, H), not (T, K, -1): an expert with no rows (T = 0) runs too.
        y_TKH = torch.empty_like(y_NH).index_copy_(0, order_N, y_NH).view(T, K, y_NH.shape[-1])
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))


@dataclass(frozen=True)
class JoinedPlan:
    """How a block's two halves are joined: ``block.<attr>`` will hold the :class:`JoinedExperts` of
    ``block.<first>`` and ``block.<second>`` (``width``: the first half's output width W)."""

    attr: str
    first: str
    second: str
    between: fx.GraphModule
    width: int
    num_experts: int
    counts_as_list: bool

    def experts_of(self, block: nn.Module) -> JoinedExperts:
        """The joined experts of ``block``: the one it holds once rewritten, else a new one of its halves
        (which it leaves where they are)."""
        held = block._modules.get(self.attr)
        if isinstance(held, JoinedExperts) or self.first not in block._modules:
            return held
        return JoinedExperts(self.first, block._modules[self.first], self.second, block._modules[self.second],
                             self.between, self.num_experts, self.counts_as_list)


def free_attribute(module: nn.Module, base: str = "experts") -> str:
    """``base``, or ``base_2``, ``base_3`` ..., the first that names nothing on ``module``."""
    name, i = base, 1
    while hasattr(module, name):
        i += 1
        name = f"{base}_{i}"
    return name


# --- Step 4: the block's forward, its state-dict keys -------------------------------------------------------

class JoinedCall:
    """The two halves as the rewritten block's forward sees them. :meth:`first` serves the sorted rows with
    one call of the experts' interface (every row a token of its own, routed to its expert with weight 1:
    the whole expert, both halves and the code between) and answers a zero placeholder ``[N, W]``, on which
    the block's code between the calls runs to no effect; :meth:`second` answers that result."""

    def __init__(self, experts: nn.Module, plan: JoinedPlan, layer: str = "") -> None:
        self.experts, self.plan, self.layer = experts, plan, layer
        self._pending: torch.Tensor | None = None

    def first(self, rows_NH: torch.Tensor, counts_E: Any) -> torch.Tensor:
        if self._pending is not None:
            raise RuntimeError(f"MoE layer {self.layer!r}: {self.plan.first} is called twice before "
                               f"{self.plan.second}")
        counts = torch.as_tensor(counts_E, device=rows_NH.device).long()
        ids_N1 = torch.repeat_interleave(torch.arange(len(counts), device=rows_NH.device), counts).view(-1, 1)
        ones_N1 = torch.ones(ids_N1.shape, dtype=rows_NH.dtype, device=rows_NH.device)
        self._pending = self.experts(rows_NH, ids_N1, ones_N1)
        return rows_NH.new_zeros((rows_NH.shape[0], self.plan.width))

    def second(self, rows: torch.Tensor, counts_E: Any) -> torch.Tensor:
        y_NH, self._pending = self._pending, None
        if y_NH is None or y_NH.shape[0] != rows.shape[0]:
            raise RuntimeError(f"MoE layer {self.layer!r}: {self.plan.second} is called on {rows.shape[0]} rows "
                               f"without {self.plan.first} called on as many before it")
        return y_NH


class JoinedKeys:
    """A state-dict hook of a rewritten block: the joined experts' keys ``<block>.<attr>.<half>.<name>`` are
    the user's ``<block>.<half>.<name>`` when saving (``loading=False``, a post-hook), and back when loading
    (a pre-hook, which runs before the children load)."""

    def __init__(self, attr: str, halves: Sequence[str], loading: bool) -> None:
        self.attr, self.halves, self.loading = attr, tuple(halves), loading

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        inner = f"{prefix}{self.attr}."
        src, dst = (prefix, inner) if self.loading else (inner, prefix)
        for key in [k for k in state_dict if k.startswith(src) and k[len(src):].split(".")[0] in self.halves]:
            state_dict[dst + key[len(src):]] = state_dict.pop(key)


def joined_block_class(block_cls: type, plan: JoinedPlan) -> type:
    """A subclass of ``block_cls`` whose forward is its own with ``self.<first>`` / ``self.<second>`` seen as
    :class:`JoinedCall` over ``self.<attr>`` (instance attributes before ``nn.Module.__getattr__``, inside
    the forward only), and whose ``_fqn_modifiers`` tell ``torch.distributed.checkpoint`` that the keys of
    the halves (and of the sharded experts' own children) skip ``<attr>``."""

    def block_forward(self, *args, **kwargs):
        call = JoinedCall(self._modules[plan.attr], plan, getattr(self, "_themis_layer", ""))
        self.__dict__[plan.first], self.__dict__[plan.second] = call.first, call.second
        try:
            return block_cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__.pop(plan.first, None)
            self.__dict__.pop(plan.second, None)

    def fqn_modifiers(self) -> dict[str, str]:
        held = self._modules[plan.attr]
        return {name: plan.attr for name in (plan.first, plan.second, *held._modules)}

    block_forward.__doc__ = (f"{block_cls.__name__}.forward with {plan.first} and {plan.second} served by one "
                             f"{plan.attr}(x, ids, weights) call.")
    return type(block_cls.__name__, (block_cls,), {"forward": block_forward, "_fqn_modifiers": fqn_modifiers,
                                                   "__module__": block_cls.__module__,
                                                   "_themis_original_class": block_cls})


def apply_joined(block: nn.Module, plan: JoinedPlan, layer: str = "") -> None:
    """Rewrite ``block`` in place: its halves move into ``block.<attr>`` (a :class:`JoinedExperts`, the same
    modules and parameter objects), its class gets the forward of :func:`joined_block_class`, and its
    state-dict keys stay the user's (:class:`JoinedKeys`)."""
    experts = plan.experts_of(block)
    del block._modules[plan.first], block._modules[plan.second]
    block.add_module(plan.attr, experts)
    block.__class__ = joined_block_class(type(block), plan)
    block._themis_layer = layer
    block.register_state_dict_post_hook(JoinedKeys(plan.attr, (plan.first, plan.second), loading=False))
    block.register_load_state_dict_pre_hook(JoinedKeys(plan.attr, (plan.first, plan.second), loading=True))


# --- The keys of rewritten blocks ---------------------------------------------------------------------
# Rewrites that move a block's experts into a child keep the user's state-dict keys by hooks. Torch's
# sharded state-dict functions look tensors up by module path; inside `internal_keys` the hooks leave the
# keys as the module paths, and `passes.parallel_lists.to_user_keys` renames afterwards.
_INTERNAL_KEYS = contextvars.ContextVar("themis_internal_keys", default=False)


@contextlib.contextmanager
def internal_keys():
    """Within it, state dicts of rewritten blocks keep the joined experts' module paths as keys."""
    token = _INTERNAL_KEYS.set(True)
    try:
        yield
    finally:
        _INTERNAL_KEYS.reset(token)




class KeyHook:
    """A state-dict hook renaming a rewritten block's keys: its internal module paths are the user's keys
    when saving (``loading=False``) and back when loading; inside `internal_keys` it stands aside.
    Subclasses give ``_outer`` (a user key, under the block's prefix), `inner_key` (its internal key) and
    `save` (the renaming, in the user's order)."""

    loading: bool
    _outer: Any

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        if not _INTERNAL_KEYS.get():
            self.apply(state_dict, prefix)

    def apply(self, state_dict: dict, prefix: str) -> None:
        """Rename the keys under ``prefix`` of ``state_dict`` in place."""
        if not self.loading:
            self.save(state_dict, prefix)
            return
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if m := self._outer.match(key[len(prefix):]):
                state_dict[prefix + self.inner_key(m)] = state_dict.pop(key)

    def inner_key(self, m: Any) -> str:
        raise NotImplementedError

    def save(self, state_dict: dict, prefix: str) -> None:
        raise NotImplementedError
