"""Attention windows from the order modules run in, scheduled with module hooks (§4.2).

The FX path of the scheduling pass needs a traceable module around attention and MoE block; HF decoder
layers (and any forward with data-dependent Python) do not trace. This path needs no graph: the first
forward of the model shows the order in which attention modules and MoE blocks run, which tells the
attention preceding each MoE layer (its window); hooks on that attention then start the layer's SpAG and
fence the attention's inputs for the SpRS wait, exactly where the FX path puts its ``themis::`` nodes.
Nothing of the user's forward is replaced, so wrappers around it (activation checkpointing, FSDP2, DDP)
keep working.

Contract of `WindowHooks`
    Assumes: ``layers`` maps MoE layer names to (MoE block module, layer id of `register_layer`); the
    modules are submodules of ``root``, which is the module the user calls.
    Guarantees:
    - the first completed forward of ``root`` is observed only (forward pre/post hooks that append to a
      list): it computes as without them, and the recorder hooks are removed when it ends;
    - from the next forward on, for every layer l that ran in the observed forward, with A_l the last
      outermost attention module that started after the previous MoE block started and before MoE block l
      started (`attention_windows`):
      - A_l's forward pre-hook (run before any other pre-hook) starts SpAG of l (`start_spag`);
      - each tensor argument of A_l that is floating and requires grad passes through
        `eager_reduction_fence(x, l)`, whose backward — the end of A_l's backward — waits for SpRS of l;
      - without A_l (a layer after a block without attention): SpAG of l starts when the previous MoE block's
        forward ends, or, for the first layer, when ``root``'s forward starts; layers in ``upgrade_only``
        are left alone in that case (their FX graph already starts them at that point);
    - inside a backward pass (a forward replayed by activation checkpointing) and while compiling the
      hooks start nothing (`start_spag`); `remove` removes every hook.

Pseudo-code
    events = [(kind, module, start|end)]  of root's first forward       # kind: attn or moe
    for l, A in attention_windows(events):
        if A:        pre_hook(A):    start_spag(l); fence(A's inputs, l)
        elif l > 0:  post_hook(moe l-1): start_spag(l)
        else:        pre_hook(root):  start_spag(l)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from themis_compile.attention import is_attention_module
from themis_compile.passes.ops import eager_reduction_fence, start_spag

logger = logging.getLogger(__name__)

__all__ = ["Event", "LayerWindow", "attention_windows", "WindowHooks"]

ATTN, MOE, START, END = "attn", "moe", "start", "end"


@dataclass(frozen=True)
class Event:
    """One module boundary of the observed forward: ``kind`` attn/moe, ``name`` the module's, ``phase``."""

    kind: str
    name: str
    phase: str


@dataclass(frozen=True)
class LayerWindow:
    """Where the hooks put one MoE layer's collectives.

    Attributes:
        layer: the layer id; name: the MoE layer's name.
        attention: name of the attention module whose forward starts SpAG and whose backward ends with
            the SpRS wait; ``None`` when no attention precedes the layer (fallback).
        start: where SpAG starts: ``"attention <name>"``, ``"after <previous MoE layer>"`` or ``"forward
            start"``; ``"unchanged"`` for a layer left to its FX graph's start (``upgrade_only``).
    """

    layer: int
    name: str
    attention: str | None
    start: str

    @property
    def fallback(self) -> bool:
        return self.attention is None


def attention_windows(events: Sequence[Event]) -> dict[str, str | None]:
    """MoE layer name -> the attention preceding it in ``events`` (see the Contract), in first-run order.

    An attention counts when it starts outside any other attention and outside any MoE block; each MoE
    block takes the latest such attention since the previous MoE block started (so no attention is the
    window of two layers). A layer running twice keeps the window of its first run.
    """
    windows: dict[str, str | None] = {}
    candidate: str | None = None
    attn_depth = moe_depth = 0
    for ev in events:
        if ev.kind == ATTN:
            if ev.phase == START:
                if attn_depth == 0 and moe_depth == 0:
                    candidate = ev.name
                attn_depth += 1
            else:
                attn_depth = max(attn_depth - 1, 0)
        elif ev.phase == START:
            if moe_depth == 0:
                windows.setdefault(ev.name, candidate)
                candidate = None
            moe_depth += 1
        else:
            moe_depth = max(moe_depth - 1, 0)
    return windows


def _inactive() -> bool:
    return torch.compiler.is_compiling()


def _fence(value: Any, layer: int) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
        return eager_reduction_fence(value, layer)
    return value


class WindowHooks:
    """Observe ``root``'s first forward, then schedule each layer's SpAG/SpRS by hooks; see the Contract.

    Args:
        root: the module the user calls (its forward delimits one observed forward).
        layers: MoE layer name -> (MoE block module, layer id).
        upgrade_only: layer names whose start is already placed elsewhere (an FX graph's fallback): they
            get hooks only if the observed order gives them an attention window.
    """

    def __init__(self, root: nn.Module, layers: Mapping[str, tuple[nn.Module, int]],
                 upgrade_only: Iterable[str] = ()) -> None:
        self.root = root
        self.layers = dict(layers)
        self.upgrade_only = set(upgrade_only)
        self.events: list[Event] = []
        self.windows: dict[str, LayerWindow] | None = None    # set when the observed forward ended
        self._recording = False
        self._recorders: list[Any] = []
        self._handles: list[Any] = []
        self._install_recorders()

    # ------------------------------------------------------------------ step 1: observe one forward
    def _install_recorders(self) -> None:
        def mark(kind: str, name: str, phase: str):
            def hook(*_args) -> None:
                if self._recording and not _inactive():
                    self.events.append(Event(kind, name, phase))
            return hook

        watched = [(ATTN, name, m) for name, m in self.root.named_modules() if is_attention_module(m)]
        watched += [(MOE, name, block) for name, (block, _layer) in self.layers.items()]
        for kind, name, module in watched:
            self._recorders.append(module.register_forward_pre_hook(mark(kind, name, START)))
            self._recorders.append(module.register_forward_hook(mark(kind, name, END), always_call=True))
        self._recorders.append(self.root.register_forward_pre_hook(self._begin, prepend=True))
        self._recorders.append(self.root.register_forward_hook(self._end))

    def _begin(self, *_args) -> None:
        # A forward that raised left its events behind: each forward starts a fresh record.
        if not _inactive() and self.windows is None:
            self.events.clear()
            self._recording = True

    def _end(self, *_args) -> None:
        if not self._recording or _inactive():
            return
        self._recording = False
        for handle in self._recorders:
            handle.remove()
        self._recorders.clear()
        self._install(attention_windows(self.events))

    # ------------------------------------------------------------------ step 2: hooks at the windows
    def _install(self, found: Mapping[str, str | None]) -> None:
        modules = dict(self.root.named_modules())
        self.windows = {}
        previous: str | None = None
        for name, attention in found.items():
            if name not in self.layers:
                continue
            block, layer = self.layers[name]
            if attention is not None:
                self._handles.append(modules[attention].register_forward_pre_hook(
                    self._attention_hook(layer), prepend=True, with_kwargs=True))
                start = f"attention {attention}"
            elif name in self.upgrade_only:
                start = "unchanged"
            elif previous is not None:
                self._handles.append(self.layers[previous][0].register_forward_hook(self._start_hook(layer)))
                start = f"after {previous}"
            else:
                self._handles.append(self.root.register_forward_pre_hook(self._start_hook(layer)))
                start = "forward start"
            self.windows[name] = LayerWindow(layer=layer, name=name, attention=attention, start=start)
            previous = name
        unseen = [name for name in self.layers if name not in self.windows]
        if unseen:
            logger.info("themis schedule: MoE layers %s did not run in the observed forward; their SpAG starts "
                        "at their own forward", unseen)
        for w in self.windows.values():
            logger.debug("themis schedule (hooks): layer %s: SpAG starts at %s", w.name, w.start)

    @staticmethod
    def _attention_hook(layer: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict):
            if _inactive():
                return None
            start_spag(layer)
            if not torch.is_grad_enabled():
                return None
            return tuple(_fence(a, layer) for a in args), {k: _fence(v, layer) for k, v in kwargs.items()}
        return hook

    @staticmethod
    def _start_hook(layer: int):
        def hook(*_args) -> None:
            if not _inactive():
                start_spag(layer)
        return hook

    def remove(self) -> None:
        """Remove every hook (recorders and schedule)."""
        for handle in self._recorders + self._handles:
            handle.remove()
        self._recorders.clear()
        self._handles.clear()
        self._recording = False
