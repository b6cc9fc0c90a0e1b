"""Capture and replay: serve a block's own calls ``experts[i](rows_i)`` with one ``experts(x, ids, weights)`` call.

The FSSDP runtime (paper §3.1) replaces a layer's experts with a module computing
``experts(x_TH, ids_TK, weights_TK) -> out_TH`` in one call per forward. A block whose forward loops over
an ``nn.ModuleList`` of experts itself, with Python control flow on tensor values that FX cannot trace
(DeepSeek-V3's reference ``moe_infer``: counts through ``.cpu().numpy()``, tokens sorted by expert and
split by those counts), or over an ``nn.ModuleDict`` of experts (HF Switch Transformers and NLLB-MoE
before transformers 5: ``getattr(self.experts, f"expert_{idx}")(rows)`` for the experts with tokens),
cannot have its loop rewritten into that call. Its routing code is kept as written instead and run twice:

- **pass A (capture)**: the block's forward with every expert replaced by a stand-in that records the
  rows it is given (the differentiable tensors the user's code built) and answers zeros; module state is
  isolated (buffers are clones, attributes restored, RNG forked), so statistics and bias updates happen
  once, in pass B, and pass B sees the same random numbers;
- **runtime**: one call ``experts(X_NH, ids_N1, ones_N1)``, every captured row routed to the expert it
  was given to with weight 1 (as :class:`~themis_compile.passes.shard.SortedRowsCall` does);
- **pass B (replay)**: the block's forward again, each stand-in answering the next slice of the result
  (its expert and row count checked against pass A's; :class:`ReplayError` otherwise).

The forward reaches the experts through a view that behaves like the container it stands for: a
ModuleList's ``len``, ``[i]``, iteration; a ModuleDict's ``getattr(experts, key)``, ``[key]``, ``keys()``,
``values()``, ``items()``, iteration over the keys, ``len``, ``in``. A ModuleDict's entries without
parameters are not experts (``runtime.experts.expert_modules``): the view gives the real module (a
token dropout), which the block holds since the runtime replaces the container. The experts may also be
one module of stacked ``[E, ...]`` weights already called as ``experts(x, ids, weights)`` (the block's
own stacked weights indexed by expert id, moved there by ``passes.parallel_lists``): expert e on rows is
then that call with every row routed to e (:func:`expert_calls`). An expert read as a
module (``experts["expert_0"].wi.weight``) fails with the reason.

Gradients: the expert inputs get theirs through pass A's graph (the captured rows), the router and
everything else through pass B's; the expert outputs enter pass B only as the runtime's result, so each
path of the original chain rule is counted once. Cost: the routing code (everything of the forward but
the experts) runs twice and pass A's routing graph is kept for backward; when the block was seen to
call every expert exactly once, pass A stops at its last expert call.

Contract:
    :func:`replay_mismatch` says (on a probe, read-only) why a block cannot be served this way, or None:
    every expert call is ``experts[i](rows [..., H])`` (or ``experts[key]``) returning rows of the same
    shape, the rows given to the experts do not depend on any expert's output (no chain of experts), and
    every expert is called on every forward, even one that receives no token (with an empty batch of
    rows; one that is skipped has no gradient in one process but a zero gradient from the sharded
    runtime) — unless ``allow_skipping``: the plan then says ``skips_empty`` and the runtime must leave
    experts without tokens ungraded, as the block does.
    :func:`replay_classes` changes only classes: the block's forward runs the two passes around one call
    of ``self.<attr>`` (whatever module the runtime put there), and the ModuleList's (ModuleDict's)
    forward becomes ``experts(x, ids, weights)`` over the same expert modules (parameters, names,
    state-dict keys unchanged).
    A ReplayError (this rank's batch made the passes differ) is reported to the other ranks before it is
    raised (``runtime.deadline.report_failure``), so that they do not wait for a collective's deadline.

Pseudo-code (each forward of the rewritten block):
    with isolated(block): rows, ids = forward(stand-ins record rows, answer zeros)     # Step 1, pass A
    check every expert was called                                                        # Step 2
    Y = experts(cat(rows), repeat(ids, rows per call), ones)                             # Step 3
    return forward(stand-ins answer the slices of Y, checked against pass A's calls)     # Step 4, pass B

Shape suffixes: N captured rows, H hidden size, E experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from themis_compile.runtime import deadline
from themis_compile.runtime.experts import expert_modules, loop_combine, stacked_layout

logger = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    """The block's forward did not call its experts the same way in both passes (or skipped one)."""


OTHER_ENTRIES = "_themis_replay_other_entries"   # block attribute: a ModuleDict's entries that are not experts


class _CaptureDone(BaseException):
    """Stops pass A at its last expert call (a BaseException: user code catching ``Exception`` keeps it)."""


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What a probe showed about a block's expert calls: ``calls_each_once`` when every expert was called
    exactly once per forward, so that pass A may stop at the E-th call; ``hidden_size`` H of the rows;
    ``skips_empty`` when the block does not call experts that receive no tokens (accepted only where the
    runtime leaves such experts without gradient, as one process does); for experts in an
    ``nn.ModuleDict``, ``keys`` (every entry, in order) and ``expert_keys`` (the entries with parameters,
    in expert order: :func:`dict_layout`), empty for a ModuleList."""

    num_experts: int
    calls_each_once: bool = False
    hidden_size: int = 0
    skips_empty: bool = False
    keys: tuple[str, ...] = ()
    expert_keys: tuple[str, ...] = ()


# --- The experts attribute as the block's forward sees it in either pass ------------------------------

class _Pass:
    """One pass of the block's forward: what each stand-in call does."""

    def call(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _ExpertStandIn:
    """``self.<attr>[e]`` during a pass: called with the expert's input rows, as the user's code calls it."""

    def __init__(self, run: _Pass, e: int) -> None:
        self._run, self._e = run, e

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise ReplayError(f"expert {self._e} is called with {len(args)} positional and {len(kwargs)} keyword "
                              "arguments; capture and replay serves expert(rows) calls only")
        return self._run.call(self._e, args[0])

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"expert {self._e} is read as .{name} inside the forward; capture and replay "
                             "serves only expert(rows) calls (the expert's parameters live in the runtime)")


class ExpertsView:
    """``self.<attr>`` during a pass: indexable, iterable and sized like the ModuleList of E experts."""

    def __init__(self, run: _Pass, num_experts: int) -> None:
        self._stand_ins = [_ExpertStandIn(run, e) for e in range(num_experts)]

    def __len__(self) -> int:
        return len(self._stand_ins)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._stand_ins)

    def __contains__(self, item: Any) -> bool:
        return any(item is s for s in self._stand_ins)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, torch.Tensor):
            index = int(index)
        return self._stand_ins[index]

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the experts are read as .{name} inside the forward; capture and replay serves "
                             "only len(experts), experts[i], iteration and expert(rows) calls")


class ExpertsDictView(ExpertsView):
    """``self.<attr>`` during a pass when the experts are an ``nn.ModuleDict`` (HF Switch / NLLB before
    transformers 5): reached as the ModuleDict is, ``getattr(experts, key)``, ``experts[key]``, ``keys()``,
    ``values()``, ``items()``, iteration over the keys, ``len``, ``key in experts``. An entry with
    parameters is an expert (its stand-in); an entry without (a token dropout) is not, and is the real
    module (``runtime.experts.expert_modules``)."""

    def __init__(self, run: _Pass, keys: tuple[str, ...], expert_keys: tuple[str, ...],
                 others: dict[str, nn.Module]) -> None:
        super().__init__(run, len(expert_keys))
        index = {k: e for e, k in enumerate(expert_keys)}
        self._entries = {k: self._stand_ins[index[k]] if k in index else others[k] for k in keys}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def __getitem__(self, key: Any) -> Any:
        return self._entries[key]

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def values(self) -> Iterable[Any]:
        return self._entries.values()

    def items(self) -> Iterable[tuple[str, Any]]:
        return self._entries.items()

    def __getattr__(self, name: str) -> Any:
        entries = self.__dict__.get("_entries", {})
        if name in entries:
            return entries[name]
        raise AttributeError(f"the experts are read as .{name} inside the forward, which is not one of their "
                             "entries; capture and replay serves only getattr(experts, key), experts[key], "
                             "keys(), values(), items(), iteration, len, `in` and expert(rows) calls")


def dict_layout(experts: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every key, the experts' keys) of a ModuleDict of experts, in order: its experts are the entries
    with parameters (as ``runtime.experts.expert_modules`` counts them); ((), ()) for any other module."""
    if not isinstance(experts, nn.ModuleDict):
        return (), ()
    return tuple(experts.keys()), tuple(k for k, m in experts.items() if any(True for _ in m.parameters()))


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """(device type, enabled, dtype) of autocast where an expert is called: the block may run its experts
    inside its own ``torch.autocast`` region, and the runtime's one call, made outside it, must run them
    the same way."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _view(run: _Pass, num_experts: int, keys: tuple[str, ...], expert_keys: tuple[str, ...],
          others: dict[str, nn.Module]) -> ExpertsView:
    """The view of the experts container for one pass: a ModuleDict's when ``keys``, else a ModuleList's."""
    return ExpertsDictView(run, keys, expert_keys, others) if keys else ExpertsView(run, num_experts)


class _Capture(_Pass):
    """Pass A: record (expert, rows) of each call and answer zeros (no gradient)."""

    def __init__(self, num_experts: int, stop_at_last: bool) -> None:
        self.num_experts, self.stop_at_last = num_experts, stop_at_last
        self.ids: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.autocast: set[tuple[str, bool, torch.dtype]] = set()   # autocast state at each call

    def call(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        self.ids.append(e)
        self.rows.append(rows)
        self.autocast.add(autocast_state(rows.device.type))
        if self.stop_at_last and len(self.ids) == self.num_experts and len(set(self.ids)) == self.num_experts:
            raise _CaptureDone
        return torch.zeros_like(rows, requires_grad=False)


class _Replay(_Pass):
    """Pass B: answer call j with slice j of the runtime's result, after checking it is pass A's call j."""

    def __init__(self, ids: list[int], outputs: list[torch.Tensor], layer: str) -> None:
        self.ids, self.outputs, self.layer = ids, outputs, layer
        self.next = 0

    def call(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        j = self.next
        if j >= len(self.ids):
            raise ReplayError(f"MoE layer {self.layer!r}: the replayed forward calls its experts more often "
                              f"({j + 1} calls) than the captured one ({len(self.ids)}); the expert calls must "
                              "depend only on module state, inputs and the RNG, not on expert outputs")
        if e != self.ids[j] or rows.shape != self.outputs[j].shape:
            raise ReplayError(f"MoE layer {self.layer!r}: expert call {j} is expert {e} on rows "
                              f"{list(rows.shape)} in the replayed forward but expert {self.ids[j]} on rows "
                              f"{list(self.outputs[j].shape)} in the captured one; the expert calls must depend "
                              "only on module state, inputs and the RNG, not on expert outputs")
        self.next += 1
        return self.outputs[j]

    def finish(self) -> None:
        if self.next != len(self.ids):
            raise ReplayError(f"MoE layer {self.layer!r}: the replayed forward made {self.next} expert calls, the "
                              f"captured one {len(self.ids)}; the expert calls must depend only on module state, "
                              "inputs and the RNG")


# --- Pass A's isolation -------------------------------------------------------------------------------

@contextlib.contextmanager
def restored_attributes(module: nn.Module, modules: list[nn.Module]) -> Iterator[None]:
    """While it runs, anything may be set on ``modules``; afterwards their attributes and their
    parameter, buffer and submodule dicts are as before, and the RNG (CPU and ``module``'s first CUDA
    device) has been forked. The common part of `isolated` and `passes.probe.preserved_state`."""
    dicts = {m: dict(m.__dict__) for m in modules}
    inner = {m: (dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules}
    devices = [p.device for p in module.parameters() if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices[:1]):
        try:
            yield
        finally:
            for m, saved in dicts.items():
                for key in [k for k in m.__dict__ if k not in saved]:
                    del m.__dict__[key]
                m.__dict__.update(saved)
                for d, s in zip((m._parameters, m._buffers, m._modules), inner[m]):
                    d.clear()
                    d.update(s)


@contextlib.contextmanager
def isolated(module: nn.Module, skip: nn.Module | None = None) -> Iterator[None]:
    """Run a forward of ``module`` without leaving traces: its buffers are clones while it runs (in-place
    statistics and bias updates land on the clones; the originals are not touched, so tensors saved for
    backward by other forwards stay valid), attributes it sets are restored, and the RNG is forked (the
    next forward draws the same random numbers). ``skip`` (the experts, which pass A never runs) and its
    submodules are left out."""
    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    modules = [m for m in module.modules() if id(m) not in skipped]
    with restored_attributes(module, modules):
        for m in modules:
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = b.clone()
        yield


def output_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a block's output, in order: through nested tuples, lists and dicts (pytrees) and
    through dataclasses, which pytree takes for one opaque leaf (a block returning
    ``MoEOutput(hidden_states, aux_loss)``): a probe comparison that flattened only the pytree would
    compare nothing in such an output and pass."""
    flat: list[torch.Tensor] = []

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            flat.append(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for field in dataclasses.fields(v):
                tree_map(visit, getattr(v, field.name))

    tree_map(visit, value)
    return flat


def _clone_tensors(value: Any) -> Any:
    """Pass A's inputs: clones (differentiable), since a forward may update its input in place (jitter)."""
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


# --- The rewritten classes ----------------------------------------------------------------------------

def capture_and_replay(forward: Callable, module: nn.Module, attr: str, plan: ReplayPlan, layer: str,
                       args: tuple, kwargs: dict) -> Any:
    """``forward(module, *args, **kwargs)`` with ``module.<attr>`` served by one ``experts(x, ids, weights)``
    call of ``module._modules[attr]`` (the module docstring's pseudo-code). A :class:`ReplayError` is
    reported to the other ranks of the runtime's process group before it is raised
    (``runtime.deadline.report_failure``): it depends on this rank's batch, and the others would
    otherwise wait for the deadline in a collective this rank will not post."""
    try:
        return _capture_and_replay(forward, module, attr, plan, layer, args, kwargs)
    except ReplayError as err:
        experts = module._modules[attr]
        if hasattr(experts, "group"):      # the runtime's experts (not a probe's or a verification's)
            deadline.report_failure(f"{type(err).__name__}: {err}", group=experts.group)
        raise


def _capture_and_replay(forward: Callable, module: nn.Module, attr: str, plan: ReplayPlan, layer: str,
                        args: tuple, kwargs: dict) -> Any:
    """Steps 1-4 of the module docstring's pseudo-code."""
    E = plan.num_experts
    others = module.__dict__.get(OTHER_ENTRIES, {})    # a ModuleDict's entries that are not experts
    for m in others.values():
        m.train(module.training)
    # Step 1 (pass A): the rows each expert call gets; the forward's result and state changes are dropped.
    capture = _Capture(E, stop_at_last=plan.calls_each_once)
    with isolated(module, skip=module._modules[attr]):
        module.__dict__[attr] = _view(capture, E, plan.keys, plan.expert_keys, others)
        try:
            forward(module, *_clone_tensors(args), **_clone_tensors(kwargs))
        except _CaptureDone:
            pass
    # Step 2: an expert the forward skipped has no gradient in one process; the runtime would give zero.
    if torch.is_grad_enabled() and not plan.skips_empty and len(set(capture.ids)) != E:
        missing = sorted(set(range(E)) - set(capture.ids))
        raise ReplayError(f"MoE layer {layer!r}: this forward did not call experts {missing}; one process leaves "
                          "their gradient None where the sharded runtime gives zero (AdamW moves a zero-gradient "
                          "parameter by its momentum). Call every expert each step (an empty batch of rows)")
    # Step 3: one runtime call, every captured row routed to its expert with weight 1. Made even without
    # rows (an eval forward that called no expert): every rank runs the runtime's collectives once.
    experts = module._modules[attr]
    if capture.rows:
        H = capture.rows[0].shape[-1]
        rows_NH = torch.cat([r.reshape(-1, H) for r in capture.rows])
    else:
        like = next((t for t in output_tensors((args, kwargs)) if t.is_floating_point()), None)
        like = like if like is not None else next(module.parameters())
        rows_NH = like.new_zeros((0, plan.hidden_size or like.shape[-1]))
    H = rows_NH.shape[-1]
    sizes = [r.numel() // H for r in capture.rows]
    ids_N1 = torch.repeat_interleave(torch.tensor(capture.ids, dtype=torch.long),
                                     torch.tensor(sizes, dtype=torch.long)).view(-1, 1).to(rows_NH.device)
    ones_N1 = torch.ones(ids_N1.shape, dtype=rows_NH.dtype, device=rows_NH.device)
    if len(capture.autocast) > 1:
        raise ReplayError(f"MoE layer {layer!r}: the forward calls its experts under different autocast states "
                          f"{sorted(capture.autocast, key=str)}; one experts call runs them all in one: call "
                          "every expert inside the same torch.autocast region (or all outside one)")
    device_type, enabled, dtype = next(iter(capture.autocast), autocast_state(rows_NH.device.type))
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):   # the experts' autocast, as called
        y_NH = experts(rows_NH, ids_N1, ones_N1)
    outputs = [y.view(r.shape) for y, r in zip(y_NH.split(sizes), capture.rows)]
    # Step 4 (pass B): the forward as written, each expert call answered by its slice of the result.
    replay = _Replay(capture.ids, outputs, layer)
    module.__dict__[attr] = _view(replay, E, plan.keys, plan.expert_keys, others)
    try:
        out = forward(module, *args, **kwargs)
    finally:
        module.__dict__.pop(attr, None)
    replay.finish()
    return out


class _OneOfStacked:
    """Expert e of a module of stacked weights called as ``experts(x_TH, ids_TK, weights_TK)``, as a callable
    on rows ``[..., H]``: every row routed to e with weight 1."""

    def __init__(self, experts: nn.Module, e: int) -> None:
        self.experts, self.e = experts, e

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows_NH = rows.reshape(-1, rows.shape[-1])
        ids_N1 = torch.full((rows_NH.shape[0], 1), self.e, dtype=torch.long, device=rows.device)
        ones_N1 = torch.ones(ids_N1.shape, dtype=rows.dtype, device=rows.device)
        return self.experts(rows_NH, ids_N1, ones_N1).view(*rows.shape[:-1], -1)


def expert_calls(experts: nn.Module, num_experts: int | None = None) -> list[Callable]:
    """Expert e of ``experts`` as a callable on rows, for every e: the modules of a ModuleList or ModuleDict
    (``runtime.experts.expert_modules``), else (``num_experts`` given) the experts of one module of stacked
    weights called as ``experts(x, ids, weights)``."""
    modules = expert_modules(experts)
    if modules is not None:
        return modules
    if num_experts is None:
        raise ValueError(f"{type(experts).__name__} is no ModuleList or ModuleDict of experts; the number of "
                         "experts of a stacked module must be given")
    return [_OneOfStacked(experts, e) for e in range(num_experts)]


def _experts_forward(self: nn.Module, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                     weights_TK: torch.Tensor) -> torch.Tensor:
    """The experts ModuleList or ModuleDict (not yet replaced by the runtime) as ``experts(x, ids, weights)``."""
    return loop_combine(expert_modules(self), x_TH, ids_TK, weights_TK)


def _experts_forward_skipping_empty(self: nn.Module, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                                    weights_TK: torch.Tensor) -> torch.Tensor:
    """As :func:`_experts_forward`, but an expert without rows is not run (no gradient), as the block's own
    loop does."""
    out_TH = torch.zeros_like(x_TH)
    for e, expert in enumerate(expert_modules(self)):
        token_N, k_N = torch.where(ids_TK == e)
        if token_N.numel():
            y_NH = expert(x_TH[token_N]) * weights_TK[token_N, k_N, None]
            out_TH.index_add_(0, token_N, y_NH.to(out_TH.dtype))
    return out_TH


def replay_classes(block_cls: type, experts_cls: type, attr: str, plan: ReplayPlan, layer: str
                   ) -> tuple[type, type]:
    """(block class, experts class) of the capture-and-replay rewrite: subclasses of the user's whose
    forwards are :func:`capture_and_replay` and ``experts(x_TH, ids_TK, weights_TK)`` (the loop over the
    same expert modules, one at a time; ``experts_cls`` as it is when it is no ModuleList or ModuleDict:
    a module of stacked weights called so already)."""

    def block_forward(self, *args, **kwargs):
        return capture_and_replay(block_cls.forward, self, attr, plan, layer, args, kwargs)

    block_forward.__doc__ = (f"{block_cls.__name__}.forward run twice (capture, replay) around one "
                             f"{attr}(x, ids, weights) call.")
    new_block = type(block_cls.__name__, (block_cls,), {"forward": block_forward, "__module__": block_cls.__module__,
                                                        "_themis_original_class": block_cls})
    if not issubclass(experts_cls, (nn.ModuleList, nn.ModuleDict)):
        return new_block, experts_cls
    new_experts = type(experts_cls.__name__, (experts_cls,), {
        "forward": _experts_forward_skipping_empty if plan.skips_empty else _experts_forward,
        "__module__": experts_cls.__module__, "_themis_original_class": experts_cls,
        "__doc__": f"{experts_cls.__name__} called as experts(x_TH, ids_TK, weights_TK)."})
    return new_block, new_experts


def apply_replay(module: nn.Module, attr: str, plan: ReplayPlan, layer: str = "") -> None:
    """Rewrite ``module`` in place (classes only, see :func:`replay_classes`). A ModuleDict's entries
    without parameters are not experts: the block holds them (unregistered, ``OTHER_ENTRIES``, their
    training mode following the block's), since the runtime replaces the whole container."""
    experts = module._modules[attr]
    if not isinstance(experts, (nn.ModuleList, nn.ModuleDict)) and stacked_layout(experts) is None:
        raise ValueError(f"MoE layer {layer!r}: capture and replay needs an nn.ModuleList or nn.ModuleDict of "
                         f"experts, or a module of stacked [E, ...] weights, not {type(experts).__name__}")
    keys, expert_keys = dict_layout(experts)
    if (keys, expert_keys) != (plan.keys, plan.expert_keys) or len(expert_calls(experts, plan.num_experts)
                                                                   ) != plan.num_experts:
        raise ValueError(f"MoE layer {layer!r}: its experts {type(experts).__name__} (keys {list(keys)}) are not "
                         f"the ones the replay plan was made for (keys {list(plan.keys)}, {plan.num_experts} "
                         "experts)")
    if others := {k: m for k, m in experts.items() if k not in expert_keys} if keys else {}:
        module.__dict__[OTHER_ENTRIES] = others
    block_cls, experts_cls = replay_classes(type(module), type(experts), attr, plan, layer)
    module.__class__ = block_cls
    experts.__class__ = experts_cls


# --- Whether a block can be served this way (on a probe) ----------------------------------------------

class _RealCalls(_Pass):
    """The experts run as written, recording (expert, rows): what pass A's capture must match."""

    def __init__(self, experts: list[Callable]) -> None:
        self.experts = experts
        self.ids: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.outputs: list[Any] = []

    def call(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        self.ids.append(e)
        self.rows.append(rows)
        out = self.experts[e](rows)
        self.outputs.append(out)
        return out


def _probe_pass(module: nn.Module, attr: str, run: _Pass, E: int, x: torch.Tensor, seed: int,
                training: bool) -> None:
    experts = module._modules[attr]
    keys, expert_keys = dict_layout(experts)
    others = {k: m for k, m in experts.items() if k not in expert_keys} if keys else {}
    with isolated(module), torch.no_grad():
        modes = [(m, m.training) for m in module.modules()]
        module.train(training)
        module.__dict__[attr] = _view(run, E, keys, expert_keys, others)
        try:
            torch.manual_seed(seed)
            module(x.clone())
        finally:
            for m, mode in modes:
                m.training = mode


def captured_rows(module: nn.Module, attr: str, x: torch.Tensor, seed: int, num_experts: int | None = None) -> int:
    """How many rows the block's forward gives its experts on the probe ``x`` (train mode, read-only):
    K rows per token for a top-K routing without drops. ``num_experts``: as for :func:`expert_calls`."""
    E = len(expert_calls(module._modules[attr], num_experts))
    capture = _Capture(E, stop_at_last=False)
    _probe_pass(module, attr, capture, E, x, seed, True)
    return sum(r.shape[:-1].numel() for r in capture.rows)


def replay_mismatch(module: nn.Module, attr: str, x: torch.Tensor, seed: int, *, allow_skipping: bool = False,
                    num_experts: int | None = None) -> tuple[ReplayPlan | None, str | None]:
    """(plan, None) when capture and replay serves ``module``'s expert calls on the probe ``x``
    (train and eval mode), else (None, why). Read-only: every pass runs :func:`isolated`, without grad.
    A block that skips experts without tokens is rejected unless ``allow_skipping`` (the runtime then
    has to leave those experts without gradient: ``plan.skips_empty``). ``num_experts``: as for
    :func:`expert_calls`."""
    experts = module._modules[attr]
    calls = expert_calls(experts, num_experts)
    E = len(calls)
    keys, expert_keys = dict_layout(experts)
    each_once = True
    for training in (True, False):
        real, capture = _RealCalls(calls), _Capture(E, stop_at_last=False)
        try:
            _probe_pass(module, attr, real, E, x, seed, training)
            _probe_pass(module, attr, capture, E, x, seed, training)
        except Exception as exc:  # noqa: BLE001 - the forward relies on more than expert(rows) calls
            return None, (f"its forward fails with its experts served by stand-ins ({type(exc).__name__}: "
                          f"{exc})").splitlines()[0][:300]
        for j, (rows, out) in enumerate(zip(real.rows, real.outputs)):
            if rows.shape[-1:] != x.shape[-1:] or not rows.is_floating_point():
                return None, (f"expert call {j} gets {rows.dtype} rows {list(rows.shape)}, not hidden states "
                              f"[..., {x.shape[-1]}]")
            if not isinstance(out, torch.Tensor) or out.shape != rows.shape:
                return None, (f"expert {real.ids[j]} maps rows {list(rows.shape)} to "
                              f"{list(getattr(out, 'shape', []))}; the runtime's experts map [N, H] rows to [N, H]")
        same = real.ids == capture.ids and all(a.shape == b.shape and torch.equal(a, b)
                                               for a, b in zip(real.rows, capture.rows))
        if not same:
            return None, ("the rows it gives its experts depend on other experts' outputs (a chain of experts): "
                          "with zeros in their place it calls them otherwise; every expert input must be computed "
                          "before any expert output is used")
        each_once = each_once and sorted(real.ids) == list(range(E))
    # One token selects at most K < E experts: a forward that skips experts without tokens shows it here.
    one = x.reshape(-1, x.shape[-1])[:1].reshape((1,) * (x.dim() - 1) + x.shape[-1:])
    capture = _Capture(E, stop_at_last=False)
    try:
        _probe_pass(module, attr, capture, E, one, seed, True)
    except Exception as exc:  # noqa: BLE001 - a block that cannot run one token is probed with more
        logger.debug("one-token probe of %s failed: %s", type(module).__name__, exc)
    else:
        if len(set(capture.ids)) != E and allow_skipping:
            return ReplayPlan(num_experts=E, hidden_size=x.shape[-1], skips_empty=True, keys=keys,
                              expert_keys=expert_keys), None
        if len(set(capture.ids)) != E:
            called = sorted(set(capture.ids))
            return None, (f"it skips experts that receive no tokens (on a one-token probe it calls only experts "
                          f"{called} of {E}): one process leaves their gradient None, the sharded runtime gives "
                          "zero, and AdamW moves a zero-gradient parameter by its momentum; call every expert "
                          "each step (an empty batch of rows)")
    return ReplayPlan(num_experts=E, calls_each_once=each_once, hidden_size=x.shape[-1], keys=keys,
                      expert_keys=expert_keys), None


# --- Gradients on the probe ---------------------------------------------------------------------------

def gradient_mismatch(original: nn.Module, rewritten: nn.Module, x: torch.Tensor, seed: int,
                      rtol: float = 1e-4, atol: float = 1e-5) -> str | None:
    """Why the gradients of a seeded probe loss (w.r.t. the input and every parameter of ``original``)
    differ between ``original`` and ``rewritten`` (sharing its parameters), in train and eval mode; None
    when they agree."""
    params = [p for p in original.parameters() if p.requires_grad]
    for training in (True, False):
        grads = []
        for m in (original, rewritten):
            with isolated(m), torch.enable_grad():
                modes = [(s, s.training) for s in m.modules()]
                m.train(training)
                try:
                    torch.manual_seed(seed)
                    x_in = x.clone().requires_grad_(True)
                    # A forward may update its input in place: it gets a clone.
                    flat = [v for v in output_tensors(m(x_in.clone())) if v.is_floating_point()]
                    if not flat:
                        return "the block's output holds no floating-point tensor to compare gradients through"
                    g = torch.Generator().manual_seed(seed)
                    loss = sum((v * torch.randn(v.shape, generator=g).to(v)).sum() for v in flat)
                    grads.append(torch.autograd.grad(loss, [x_in] + params, allow_unused=True))
                finally:
                    for s, mode in modes:
                        s.training = mode
        names = ["the input"] + [n for n, p in original.named_parameters() if p.requires_grad]
        for name, a, b in zip(names, *grads):
            if (a is None) != (b is None):
                return f"{'train' if training else 'eval'} mode: gradient of {name} is None in one of them"
            if a is not None and not torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol):
                err = float((a.double() - b.double()).abs().max())
                return f"{'train' if training else 'eval'} mode: gradient of {name} differs by up to {err:.3g}"
    return None


# --- What the machinery cannot serve ------------------------------------------------------------------

_TOP1_SELECTIONS = (torch.max, torch.Tensor.max, torch.argmax, torch.Tensor.argmax)


class _TopkSeen(TorchFunctionMode):
    """Whether a forward selects experts: a top-k, or a top-1 by ``max`` / ``argmax`` along a dimension
    (the GShard / Switch routers: ``argmax(gates, dim=1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            self.seen = True
        elif func in _TOP1_SELECTIONS and ("dim" in kwargs or (len(args) > 1 and type(args[1]) is int)):
            self.seen = True
        return func(*args, **kwargs)


def inline_expert_weights_reason(module: nn.Module) -> str | None:
    """Why a block whose experts are flat or stacked parameters of its own (MegaBlocks dMoE: ``w1 [E*F, H]``
    sliced per expert in the forward; Tutel / Grok: ``w [E, H, F]`` applied to all experts' slots at once), next
    to a router of E experts and with a top-k (or a top-1 ``max`` / ``argmax``) on a probe, cannot be
    sharded; None for any other module. Capture and replay intercepts expert *calls*: inline slices of
    the block's own weights have no call whose input and output rows could be captured, and no experts
    module for the runtime to replace."""
    routers = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear) and c.out_features >= 2]
    for rname, router in routers:
        E, H = router.out_features, router.in_features
        flat = [(n, p) for n, p in module.named_parameters(recurse=False)
                if p.dim() == 2 and H in p.shape and any(d % E == 0 and d >= 2 * E for d in p.shape if d != H)]
        # Stacked [E, ...] weights of the block itself (Tutel / Grok style: a matmul or einsum over them all).
        stacked = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 3 and p.shape[0] == E]
        if len(stacked) >= 2:
            flat, layout = stacked, "stacked"
        elif len(flat) >= 2:
            layout = "flat"
        else:
            continue
        seen = _TopkSeen()
        x = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(0)).to(router.weight)
        try:
            with isolated(module), torch.no_grad(), seen:
                module(x)
        except Exception:  # noqa: BLE001 - not a block run on hidden states: not this case
            return None
        if not seen.seen:
            continue
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in flat)
        how = "sliced per expert inline" if layout == "flat" else "applied inline"
        return (f"its expert weights are {layout} parameters of the block itself ({shapes}, {E} experts scored by "
                f"'{rname}') {how}: there is no experts module for the runtime to replace and "
                "no expert call to capture; hold them in a child module (stacked [E, F, H] weights called as "
                "experts(x, ids, weights), or an nn.ModuleList called per expert)")
    return None
