"""Probes: the inputs detection and the rewrite's verification run a block on, and how they run it.

A probe is a seeded random input for one block (``probe_input``: hidden states ``[PROBE_BATCH, PROBE_SEQ,
H]`` or flat ``[T, H]``, in the block's dtype and device) run under ``torch.no_grad`` with the RNG forked and
every module attribute and buffer restored afterwards (``run_probe``, ``preserved_state``). A block whose
forward needs more than hidden states is probed with the arguments it got in one forward of the whole
model (``record_inputs``; ``recorded_inputs`` / ``probing_as_recorded`` install them, ``probe_arguments``
lays them out for a traced graph). ``ExpertsStandIn`` takes a layer's experts' place on a probe and
records how the block calls them.

Contract:
    Nothing here changes a module for longer than the call: every probe leaves the module's training
    modes, attributes, buffers and the global RNG as it found them, and the same probe (seed
    ``PROBE_SEED``) is drawn on every rank.

Shape suffixes: B batch, S sequence, T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any, Iterator

import torch
from torch import nn

from themis_compile.layer_info import MoELayerInfo, RecordedCall
from themis_compile.passes.replay import restored_attributes
from themis_compile.runtime.experts import loop_combine

logger = logging.getLogger(__name__)

__all__ = ["PROBE_SEED", "PROBE_BATCH", "PROBE_SEQ", "probe_input", "preserved_state", "run_probe", "ExampleInputs",
           "RecordedCall", "SYNTHESIZED_BATCH", "SYNTHESIZED_SEQ", "NOT_CALLED", "recorded_call", "recorded_inputs",
           "probing_as_recorded", "probe_arguments", "synthesized_inputs", "record_inputs", "ExpertsStandIn"]


PROBE_SEED = 1234
PROBE_BATCH, PROBE_SEQ = 2, 4


# --- Probe inputs and runs ---------------------------------------------------------------------------

def _probe_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.get_default_dtype(), torch.device("cpu")


def probe_input(module: nn.Module, hidden_size: int, flat: bool = False) -> torch.Tensor:
    """Seeded random hidden states [2, 4, H] (or [8, H] when ``flat``) in the layer's dtype and device; of
    the recorded hidden states' shape, dtype and device for a module probed with recorded inputs
    (:func:`recorded_inputs`)."""
    dtype, device = _probe_dtype_device(module)
    gen = torch.Generator().manual_seed(PROBE_SEED)
    shape = (PROBE_BATCH * PROBE_SEQ, hidden_size) if flat else (PROBE_BATCH, PROBE_SEQ, hidden_size)
    if (call := recorded_call(module)) is not None:
        # Probed with the arguments it got in a forward of the model: fresh hidden states of the
        # recorded shape (the other arguments, position embeddings or token ids, are sized by it).
        hidden = call.hidden_states
        shape, dtype, device = hidden.shape, hidden.dtype, hidden.device
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Run a probe without leaving traces: module attributes, buffers, modes and the RNG are restored."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    with restored_attributes(module, list(module.modules())):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved_b in buffers:
                    if b.shape == saved_b.shape:
                        b.copy_(saved_b)


def run_probe(module: nn.Module, x: torch.Tensor, *, training: bool | None = None) -> Any:
    """``module(x)`` seeded, without gradients, leaving no state behind (see :func:`preserved_state`)."""
    with preserved_state(module), torch.no_grad():
        modes = [(m, m.training) for m in module.modules()]
        if training is not None:
            module.train(training)
        try:
            torch.manual_seed(PROBE_SEED)
            return module(x.clone())   # forwards may update their input in place (HF jitter noise)
        finally:
            for m, mode in modes:
                m.training = mode


# --- Probes with recorded inputs ---------------------------------------------------------------------

# A block whose forward needs more than hidden states (an HF decoder layer holding the MoE itself needs
# position embeddings and masks; hash routing needs the token ids) is probed with the arguments it got in
# one forward of the whole model: its forward, while detection and the rewrite's verification run, is
# ``_ProbeForward``, which puts a probe's hidden states in place of the recorded ones.

ExampleInputs = tuple | dict   # positional or keyword arguments of model(...), as torch.export takes them
SYNTHESIZED_BATCH, SYNTHESIZED_SEQ = 2, 8
_PASS_INPUTS = ("pass example_inputs to optimize() / explain() (a tuple of positional arguments or a dict of "
                "keyword arguments for model(...)) so that it is probed with the arguments it gets in a forward "
                "of the model")
NOT_CALLED = "it is not called in a forward of the model on the example inputs, so it cannot be probed"


class _ProbeForward:
    """``module.forward`` while it is probed with recorded inputs: a call on hidden states alone (a probe)
    runs the class's forward (rewritten or not) with the recorded arguments around them; any other call
    passes through. A deep copy of the module (a rewrite's trial) gets one bound to the copy."""

    def __init__(self, module: nn.Module, call: RecordedCall) -> None:
        self.module, self.call = module, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            args, kwargs = self.call.bind(args[0])
        return type(self.module).forward(self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _ProbeForward:
        return _ProbeForward(copy.deepcopy(self.module, memo), self.call)


def recorded_call(module: nn.Module) -> RecordedCall | None:
    """The recorded call ``module`` is probed with now (inside :func:`recorded_inputs`), else None."""
    forward = module.__dict__.get("forward")
    return forward.call if isinstance(forward, _ProbeForward) else None


@contextlib.contextmanager
def recorded_inputs(calls: dict[nn.Module, RecordedCall]) -> Iterator[None]:
    """While it runs, each module of ``calls`` called on hidden states alone (every probe of detection and
    of the rewrite's verification) runs with the other arguments of its recorded call. Re-entrant: a
    module already probed so keeps its recording."""
    installed = [m for m, call in calls.items() if call is not None and recorded_call(m) is None]
    for m in installed:
        m.__dict__["forward"] = _ProbeForward(m, calls[m])
    try:
        yield
    finally:
        for m in installed:
            if isinstance(m.__dict__.get("forward"), _ProbeForward):
                del m.__dict__["forward"]


def probing_as_recorded(infos: list[MoELayerInfo]) -> contextlib.AbstractContextManager:
    """:func:`recorded_inputs` for the layers found with a recorded call (``info.probe_call``)."""
    return recorded_inputs({info.module: info.probe_call for info in infos if info.probe_call is not None})


def probe_arguments(module: nn.Module, x: torch.Tensor) -> list[Any]:
    """The positional inputs of ``module``'s FX graph for a probe ``x``: ``[x]``, or with a recorded call
    the values of every parameter of its forward in order (recorded, else defaults), ``x`` in place of
    the hidden states."""
    call = recorded_call(module)
    if call is None:
        return [x]
    args, kwargs = call.bind(x)
    signature = inspect.signature(type(module).forward)
    bound = signature.bind(module, *args, **kwargs)
    bound.apply_defaults()
    values: list[Any] = []
    for p in list(signature.parameters.values())[1:]:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            values.extend(bound.arguments.get(p.name, ()))
        elif p.kind is not inspect.Parameter.VAR_KEYWORD:
            values.append(bound.arguments[p.name])
    return values


def _is_hf_pretrained(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def synthesized_inputs(model: nn.Module) -> dict | None:
    """Keyword arguments for one forward of an HF ``PreTrainedModel``: seeded token ids
    ``[SYNTHESIZED_BATCH, SYNTHESIZED_SEQ]`` drawn from its text config's vocabulary (the same on every
    rank), as ``input_ids`` (``decoder_input_ids`` for a decoder that takes only those; an encoder-decoder
    gets both), with ``use_cache=False``. None for any other model, or one without a vocabulary."""
    if not _is_hf_pretrained(model):
        return None
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    params = inspect.signature(model.forward).parameters
    name = next((n for n in ("input_ids", "decoder_input_ids") if n in params), None)
    if not isinstance(vocab, int) or vocab < 1 or name is None:
        return None
    gen = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab, (SYNTHESIZED_BATCH, SYNTHESIZED_SEQ), generator=gen)
    ids = ids.to(_probe_dtype_device(model)[1])
    kwargs = {name: ids}
    if name == "input_ids" and "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return kwargs


class _AllRecorded(Exception):
    """Stops the recording forward once every module asked for has been called."""


def record_inputs(model: nn.Module, modules: list[nn.Module], example_inputs: ExampleInputs | None = None
                  ) -> tuple[dict[nn.Module, RecordedCall], str | None]:
    """The (args, kwargs) each of ``modules`` gets in one forward of ``model``, and why some are missing.

    The forward runs on ``example_inputs`` (a tuple of positional arguments or a dict of keyword
    arguments), else on :func:`synthesized_inputs`, with forward pre-hooks on ``modules``, under
    ``torch.no_grad``, seeded, in the model's current mode, leaving no state behind
    (:func:`preserved_state`); it stops once every module has been called. Returns ``({}, reason)`` when
    there are no inputs or the forward fails before it reaches them."""
    given = example_inputs is not None
    inputs = example_inputs if given else synthesized_inputs(model)
    if inputs is None:
        return {}, _PASS_INPUTS
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    what = "example_inputs" if given else f"synthesized token ids [{SYNTHESIZED_BATCH}, {SYNTHESIZED_SEQ}]"
    advice = "" if given else f"; {_PASS_INPUTS}"
    calls: dict[nn.Module, RecordedCall] = {}
    wanted = {id(m) for m in modules}
    seen: set[int] = set()

    def hook(m: nn.Module, a: tuple, k: dict) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if (call := RecordedCall.of(a, k)) is not None:
            calls[m] = call
        if seen >= wanted:
            raise _AllRecorded

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    failure = None
    try:
        with preserved_state(model), torch.no_grad():
            torch.manual_seed(PROBE_SEED)
            model(*args, **kwargs)
    except _AllRecorded:
        pass
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        failure = f"a forward of the model on {what} fails before it is called ({error}){advice}"
    finally:
        for h in handles:
            h.remove()
    if failure is None and len(calls) < len(modules):
        failure = f"{NOT_CALLED} ({what}){advice}"
    logger.debug("recorded the inputs of %d of %d modules in a forward of %s", len(calls), len(modules),
                 type(model).__name__)
    return calls, failure


# --- The experts' stand-in ---------------------------------------------------------------------------

class ExpertsStandIn(nn.Module):
    """Stands in for a layer's experts during a probe: records how it is called and answers with the
    interface ``(x_TH, ids_TK, weights_TK) -> out_TH`` computed by the original experts."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.inner = experts
        self.calls: list[tuple] = []
        self.outputs: list[Any] = []

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(tuple(args) + tuple(kwargs.values()))
        if isinstance(self.inner, nn.ModuleList):
            out = loop_combine(self.inner, *args, *kwargs.values())
        else:
            out = self.inner(*args, **kwargs)
        self.outputs.append(out)
        return out
