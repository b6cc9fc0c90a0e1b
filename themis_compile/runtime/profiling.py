"""Measuring the cost model's inputs during training: the effectful half of `cost_model/profile.py`.

- `AttentionProfiler` hooks every attention module (forward pre/post hooks; tensor hooks for the backward),
  times its forward and backward during the first steps at the real shapes, skips ``warmup_steps``, keeps
  the median of ``measure_steps`` and removes its hooks. It also records which attention ran last before
  each MoE layer — the window that layer's SpAG overlaps. The result is a `cost_model.profile.Profile`.
- `measure_bandwidth` runs a point-to-point ping-pong on the actual process group, between two ranks of one
  node (intra-node) and two ranks of different nodes (inter-node) of the `Topology`.
- `annotate_attention` marks attention with `ATTENTION_RANGE` for the profiler; `export_chrome_trace`
  writes the chrome trace of one step, in which the runtime's `SPAG_RANGE` / `SPRS_RANGE` ranges show the
  overlap.
- `phase_breakdown` turns a profile of training steps into milliseconds per step and phase (plan + SpAG,
  dispatch, experts, combine, ...), each range counted once, where it is outermost.
- `annotate_step` marks a model's modules (attention, MoE blocks, experts, embeddings/norms/head) with
  profiler ranges, and `step_breakdown` splits profiled steps into forward and backward by those kinds
  (a backward node counted by the forward op that created it), the sparse collectives' starts and exposed
  waits, the optimizer, re-sharding and FSDP2, adding up to the step with a small rest.

`runtime/budgets.py` drives them and turns their result into t and m (`cost_model.profile.budgets`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from themis_compile.cost_model.profile import (
    ATTENTION_RANGE, AttentionTiming, Profile, attention_modules, hardware_id,
)
from themis_compile.runtime import deadline

logger = logging.getLogger(__name__)

__all__ = ["AttentionProfiler", "PHASES", "annotate_attention", "annotate_step", "export_chrome_trace",
           "measure_bandwidth", "step_breakdown", "step_phases",
           "phase_breakdown", "PART_PHASES", "FORWARD_RANGE", "BACKWARD_RANGE", "OPTIMIZER_RANGE"]


# ----------------------------------------------------------------------------------------- T_attn
def _sync(t: Any) -> None:
    if isinstance(t, torch.Tensor) and t.is_cuda:
        torch.cuda.synchronize(t.device)


def _first_tensor(args: Any) -> torch.Tensor | None:
    if isinstance(args, torch.Tensor):
        return args
    if isinstance(args, (tuple, list)):
        for a in args:
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


class _Range:
    """A ``record_function`` range opened in one hook and closed in another (per-module LIFO)."""

    def __init__(self) -> None:
        self.open: dict[int, list] = {}

    def enter(self, key: int, name: str) -> None:
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        self.open.setdefault(key, []).append(rf)

    def exit(self, key: int) -> None:
        stack = self.open.get(key)
        if stack:
            stack.pop().__exit__(None, None, None)


def annotate_attention(model: nn.Module) -> list:
    """Mark every attention module's forward with the `ATTENTION_RANGE` profiler range; returns hook handles."""
    ranges = _Range()
    handles = []
    for _name, module in attention_modules(model):
        handles.append(module.register_forward_pre_hook(lambda m, a: ranges.enter(id(m), ATTENTION_RANGE)))
        handles.append(module.register_forward_hook(lambda m, a, o: ranges.exit(id(m))))
    return handles


class AttentionProfiler:
    """Times attention forward and backward during the first steps of training, then removes itself.

    A step begins when the first attention module (in forward order) runs its forward with gradients
    enabled; steps ``1..warmup_steps`` are discarded, the next ``measure_steps`` measured. When done,
    ``profile`` holds the medians and ``on_done(profile)`` is called once. Timing hooks synchronize CUDA
    only while measuring. Any exception inside a hook disables profiling with a warning — never training.

    Args:
        model: the model (attention modules found by `themis_compile.passes.attention.is_attention_module`).
        moe_layers: MoE layer name -> module whose forward marks that layer (to learn each layer's window).
        warmup_steps, measure_steps: see above.
        on_done: callback receiving the finished `Profile`.
    """

    def __init__(self, model: nn.Module, moe_layers: Mapping[str, nn.Module] | None = None, *,
                 warmup_steps: int = 1, measure_steps: int = 3,
                 on_done: Callable[[Profile], None] | None = None) -> None:
        if warmup_steps < 0 or measure_steps < 1:
            raise ValueError(f"warmup_steps must be >= 0 and measure_steps >= 1, got {warmup_steps}, {measure_steps}")
        self.warmup_steps, self.measure_steps = int(warmup_steps), int(measure_steps)
        self.on_done = on_done
        self.profile: Profile | None = None
        self.failed: str | None = None
        self.step = 0
        self._attn = attention_modules(model)
        self._names = {id(m): n for n, m in self._attn}
        self._first = id(self._attn[0][1]) if self._attn else None
        self._fwd: dict[str, list[float]] = {n: [] for n, _ in self._attn}
        self._bwd: dict[str, list[float]] = {n: [] for n, _ in self._attn}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._t0: dict[int, float] = {}
        self._b0: dict[int, float] = {}
        self._last_attention: str | None = None
        self._preceding: dict[str, str] = {}
        self._ranges = _Range()
        self._handles: list = []
        if not self._attn:
            self._fail("the model has no attention module (mark one with themis_compile.passes.attention."
                       "mark_attention)")
            return
        # Backward is timed with tensor hooks (gradient of the output: start; of the input: end), not
        # module backward hooks, which torch.compile cannot capture without compiled autograd. Under
        # torch.compile every hook is a no-op, so profiling never breaks a graph.
        for _name, m in self._attn:
            self._handles += [m.register_forward_pre_hook(self._guard(self._pre)),
                              m.register_forward_hook(self._guard(self._post))]
        for name, m in (moe_layers or {}).items():
            self._handles.append(m.register_forward_pre_hook(self._guard(self._moe_hook(name))))

    # hooks -----------------------------------------------------------------------------------------
    def _guard(self, fn):
        def hook(*args):
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - profiling must never break training
                self._fail(f"{type(exc).__name__}: {exc}")
                return None
        return hook

    @property
    def measuring(self) -> bool:
        return self.profile is None and self.failed is None and self.warmup_steps < self.step

    def _pre(self, m, args):
        if torch.compiler.is_compiling():
            return None
        if m is not None and id(m) == self._first and torch.is_grad_enabled():
            self.step += 1
            if self.step > self.warmup_steps + self.measure_steps:
                self._finish()
                return None
        name = self._names[id(m)]
        self._last_attention = name
        if self.measuring and torch.is_grad_enabled():  # training steps only: eval shapes may differ
            x = _first_tensor(args)
            if x is not None:
                self._shapes[name] = tuple(x.shape)
                _sync(x)
                if x.requires_grad:
                    x.register_hook(self._guard(lambda g, key=id(m): self._bpost(key, g)))
            self._ranges.enter(id(m), ATTENTION_RANGE)
            self._t0[id(m)] = time.perf_counter()
        return None

    def _post(self, m, args, out):
        if torch.compiler.is_compiling():
            return None
        t0 = self._t0.pop(id(m), None)
        if t0 is not None:
            y = _first_tensor(out)
            _sync(y)
            self._fwd[self._names[id(m)]].append(time.perf_counter() - t0)
            self._ranges.exit(id(m))
            if y is not None and y.requires_grad:
                y.register_hook(self._guard(lambda g, key=id(m): self._bpre(key, g)))
        return None

    def _bpre(self, key: int, grad_out: torch.Tensor) -> None:
        """Gradient of the attention's output is ready: its backward starts."""
        _sync(grad_out)
        self._b0[key] = time.perf_counter()

    def _bpost(self, key: int, grad_in: torch.Tensor) -> None:
        """Gradient of the attention's input is ready: its backward is done."""
        t0 = self._b0.pop(key, None)
        if t0 is not None:
            _sync(grad_in)
            self._bwd[self._names[key]].append(time.perf_counter() - t0)

    def _moe_hook(self, layer: str):
        def hook(m, args):
            if self._last_attention is not None:
                self._preceding.setdefault(layer, self._last_attention)
            return None
        return hook

    # results ---------------------------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            logger.warning("themis: attention profiling failed (%s); the cost model falls back to defaults", why)
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _finish(self) -> None:
        attention = {}
        for name, samples in self._fwd.items():
            if samples:
                bwd = self._bwd.get(name) or []
                attention[name] = AttentionTiming(statistics.median(samples),
                                                  statistics.median(bwd) if bwd else None,
                                                  self._shapes.get(name, ()), len(samples))
        self.remove()
        if not attention:
            self._fail("no attention forward was timed")
            return
        self.profile = Profile(attention=attention, preceding_attention=dict(self._preceding), source="measured",
                               hardware=hardware_id(),
                               world_size=dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
        logger.info("themis: profiled T_attn of %d attention modules (median of %d steps)", len(attention),
                    self.measure_steps)
        if self.on_done is not None:
            self.on_done(self.profile)

    def finish(self) -> Profile | None:
        """Stop now and return what was measured (None if nothing was)."""
        if self.profile is None and self.failed is None:
            self._finish()
        return self.profile


# ----------------------------------------------------------------------------------------- bandwidth
def _pairs(world_size: int, topology) -> dict[str, tuple[int, int]]:
    pairs = {}
    if topology is None:
        if world_size >= 2:
            pairs["intra"] = (0, 1)
        return pairs
    offsets = topology.node_offsets
    for n, count in enumerate(topology.devices_per_node):
        if count >= 2:
            pairs["intra"] = (int(offsets[n]), int(offsets[n]) + 1)
            break
    if topology.num_nodes >= 2:
        pairs["inter"] = (int(offsets[0]), int(offsets[1]))
    return pairs


def measure_bandwidth(group=None, topology=None, *, nbytes: int = 1 << 22, iters: int = 5, warmup: int = 1,
                      device: torch.device | str | None = None,
                      timeout_s: float = deadline.DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """Bytes/s of one link by point-to-point ping-pong, ``{"intra": bw, "inter": bw}`` (keys present only
    for pairs the topology has). Collective: every rank of ``group`` must call it; all get the same result;
    each of its messages fails after ``timeout_s`` (`runtime/deadline.py`).
    Returns ``{}`` without a process group or with one rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        return {}
    if nbytes < 1 or iters < 1:
        raise ValueError(f"nbytes and iters must be >= 1, got {nbytes}, {iters}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for kind, (a, b) in _pairs(world, topology).items():
        ga, gb = dist.get_global_rank(group, a), dist.get_global_rank(group, b)
        times = []
        deadline.barrier(group=group, timeout_s=timeout_s, purpose=f"bandwidth measurement ({kind})")
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            ping = dict(group=group, timeout_s=timeout_s, purpose=f"bandwidth measurement ({kind})")
            if rank == a:
                deadline.send(buf, gb, **ping)
                deadline.recv(buf, gb, **ping)
            elif rank == b:
                deadline.recv(buf, ga, **ping)
                deadline.send(buf, ga, **ping)
            _sync(buf)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        bw = torch.tensor([nbytes / (statistics.median(times) / 2) if rank == a else 0.0], dtype=torch.float64,
                          device=device)
        deadline.broadcast(bw, ga, group=group, timeout_s=timeout_s, purpose=f"bandwidth measurement ({kind})")
        result[kind] = float(bw.item())
    return result


# ----------------------------------------------------------------------------------------- traces
def export_chrome_trace(step: Callable[[], Any], path: str | os.PathLike, *, with_stack: bool = False) -> Path:
    """Run ``step()`` once under ``torch.profiler`` (CPU, and CUDA when available) and write its chrome trace
    to ``path``; the themis ranges (`SPAG_RANGE`, `SPRS_RANGE`, `ATTENTION_RANGE`, ...) appear in it."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, with_stack=with_stack) as prof:
        step()
    prof.export_chrome_trace(str(path))
    return path


# ----------------------------------------------------------------------------------------- phases
# The phases of a step, each a set of profiler ranges (by name prefix): the runtime's themis:: ranges and
# FSDP2's own. Ranges nest (themis::spag_start holds themis::plan, FSDP::pre_forward its all-gather), so a
# range counts towards the phase of its outermost phase range only; what no phase range covers is the
# model's own compute outside the experts (attention, the backward of everything, the optimizer step).
PHASES = (
    ("plan + SpAG", ("themis::spag", "themis::plan", "themis::rematerialize_for_recompute")),
    ("routing", ("themis::token_counts", "themis::calibrate", "themis::dispatch_plan", "themis::check_routing",
                 "themis::count_exchange", "themis::assign_destinations")),
    ("dispatch", ("themis::dispatch", "themis::routing_metadata", "themis::permute")),     # + its backward
    ("experts (forward)", ("themis::experts",)),
    ("combine", ("themis::combine", "themis::unpermute_combine")),                      # + its backward
    ("all-to-all (backward)", ("themis::all_to_all_backward",)),
    ("SpRS", ("themis::sprs",)),
    ("re-shard", ("themis::reshard",)),
    ("dense FSDP2", ("FSDP::",)),
)
OTHER_PHASE = "rest of the step"
# The parts of a step a training loop may mark (``with record_function(FORWARD_RANGE): ...``): within each,
# the time no phase range covers is that part's own compute, reported under its phase here instead of
# OTHER_PHASE (which then holds only what lies outside every part).
FORWARD_RANGE, BACKWARD_RANGE, OPTIMIZER_RANGE = "step::forward", "step::backward", "step::optimizer"
PART_PHASES = (
    (FORWARD_RANGE, "forward, dense (attention, norms, router)"),
    (BACKWARD_RANGE, "backward, dense (their gradients)"),
    (OPTIMIZER_RANGE, "optimizer step"),
)


def _phase_of(name: str) -> str | None:
    for phase, prefixes in PHASES:
        if name.startswith(prefixes):
            return phase
    return None


def phase_breakdown(events, steps: int, step_range: str) -> dict[str, float]:
    """Milliseconds per step of every phase of `PHASES` in ``events`` (``torch.profiler.profile(...).events()``
    of ``steps`` steps, each inside a ``step_range`` range), then, for each part of `PART_PHASES` the step
    marks, the part's time no phase covers, and `OTHER_PHASE`: the step ranges' time no phase or part covers.
    A range nested in another phase range counts towards the outer one only, so the phases add up to the
    step's time."""
    parts = dict(PART_PHASES)
    totals = {phase: 0.0 for phase, _ in PHASES}
    part_us = {name: 0.0 for name in parts}          # each part's time, less the phases inside it
    step_us = 0.0
    for event in events:
        if event.name == step_range:
            step_us += event.time_range.elapsed_us()
            continue
        if event.name in parts:
            part_us[event.name] += event.time_range.elapsed_us()
            continue
        phase = _phase_of(event.name)
        if phase is None:
            continue
        parent, nested, part = event.cpu_parent, False, None
        while parent is not None and not nested:
            nested = _phase_of(parent.name) is not None
            if parent.name in parts and part is None:
                part = parent.name
            parent = parent.cpu_parent
        if not nested:
            totals[phase] += event.time_range.elapsed_us()
            if part is not None:
                part_us[part] -= event.time_range.elapsed_us()
    out = {phase: us / 1e3 / steps for phase, us in totals.items() if us > 0}
    out.update({parts[name]: max(us, 0.0) / 1e3 / steps for name, us in part_us.items() if us > 0})
    out[OTHER_PHASE] = max(step_us / 1e3 / steps - sum(out.values()), 0.0)
    return out


# ----------------------------------------------------------------------------------------- the step's breakdown
# `step_breakdown` splits a profiled step into forward and backward per kind of compute (attention, router,
# dispatch, experts, combine, ...), the sparse collectives' starts and exposed waits, FSDP2's dense
# collectives, the optimizer step and re-sharding. The forward kinds come from ranges around modules
# (`annotate_step`) and the runtime's own ranges; a backward node counts towards the kind of the forward op
# that created it (the profiler records both with the autograd sequence number), so the backward needs no
# hook of its own. Each instant of the step counts once, towards the innermost range that has a phase.
ROUTER_RANGE = "themis::router"              # a MoE block's forward: the gate and top-k (the experts nest in it)
MOE_RUNTIME_RANGE = "themis::moe_runtime"    # the sharded experts' forward: the runtime's own bookkeeping
DENSE_RANGE = "themis::dense"                # embeddings, norms, head and dense MLPs outside attention and MoE
MODEL_RANGE = "themis::model_forward"        # the model's forward (its own glue: residual adds, reshapes)
HARNESS_RANGE = "bench::harness"             # a benchmark's own work inside a step, outside its timings
HARNESS_PHASE = "harness (not in the timed steps)"

FORWARD_KINDS = (
    ("attention", (ATTENTION_RANGE,)),
    ("router", (ROUTER_RANGE,)),
    ("token counts + dispatch plan", (MOE_RUNTIME_RANGE, "themis::token_counts", "themis::calibrate",
                                      "themis::dispatch_plan", "themis::check_routing", "themis::count_exchange",
                                      "themis::assign_destinations")),
    ("dispatch", ("themis::dispatch", "themis::routing_metadata", "themis::permute")),
    ("experts", ("themis::experts",)),
    ("combine", ("themis::combine", "themis::unpermute_combine")),
    ("dense (embeddings, norms, head)", (DENSE_RANGE,)),
    ("loss", (FORWARD_RANGE,)),    # what step::forward runs outside the model's forward: the loss
)
COMM_PHASES = (
    ("SpAG start (plan, post)", ("themis::spag_start", "themis::plan", "themis::spag", "themis::spag_window_end",
                                 "themis::spag_rematerialize")),
    ("SpAG exposed (wait)", ("themis::spag_wait", "themis::spag_calibration", "themis::rematerialize_for_recompute")),
    ("SpRS start", ("themis::sprs",)),
    ("SpRS exposed (wait)", ("themis::sprs_wait",)),
    ("optimizer step", (OPTIMIZER_RANGE,)),
    ("re-shard", ("themis::reshard",)),
)
DENSE_FSDP2_PHASE = "dense FSDP2 (gather, reduce)"
GRAD_ACCUMULATION_PHASE = "backward: gradient accumulation"
# Ranges whose own time is the rest: the step's and its parts' glue (Python between the phases, the autograd
# engine between nodes) and the model's glue.
_REST_RANGES = (BACKWARD_RANGE, MODEL_RANGE)
_EVALUATE = "autograd::engine::evaluate_function: "


def step_phases() -> list[str]:
    """Every phase `step_breakdown` may report, in order (forward kinds, the same backward, the rest)."""
    kinds = [kind for kind, _ in FORWARD_KINDS]
    return ([f"forward: {k}" for k in kinds] + [COMM_PHASES[0][0], COMM_PHASES[1][0]]
            + [f"backward: {k}" for k in kinds] + [GRAD_ACCUMULATION_PHASE]
            + [name for name, _ in COMM_PHASES[2:]] + [DENSE_FSDP2_PHASE, HARNESS_PHASE, OTHER_PHASE])


_FORWARD_KIND_OF = {name: kind for kind, names in FORWARD_KINDS for name in names}
_COMM_PHASE_OF = {name: phase for phase, names in COMM_PHASES for name in names}


def _label(event) -> str | None:
    """The phase an event's own time counts towards ("kind:..." for a forward kind), None: its parent's."""
    name = event.name
    if name in _COMM_PHASE_OF:
        return _COMM_PHASE_OF[name]
    if name in _FORWARD_KIND_OF:
        return "kind:" + _FORWARD_KIND_OF[name]
    if name.startswith("FSDP::"):
        return DENSE_FSDP2_PHASE
    if name == HARNESS_RANGE:
        return HARNESS_PHASE
    if name.startswith(_EVALUATE):
        return "backward"
    if name in _REST_RANGES:
        return OTHER_PHASE
    return None


def step_breakdown(events, steps: int, step_range: str) -> dict[str, float]:
    """Milliseconds per step of every phase of `step_phases` in ``events`` (``torch.profiler`` events of
    ``steps`` steps, each inside a ``step_range`` range, modules marked by `annotate_step`); the phases add
    up to the step ranges' time, `OTHER_PHASE` holding what no phase covers.

    Pseudo-code:
        kind[seq]  = forward kind of the innermost marked range around the forward op numbered seq
        label(e)   = phase of e's range; a backward node: "backward: " + kind[its sequence number]
        own(e)     = duration(e) - Σ duration of the nearest labelled events inside e
        phase time = Σ own(e) over the labelled events inside the step ranges, by label
    """
    inside: list = []               # (event, label) of labelled events within a step range
    kind_of_seq: dict[int, str | None] = {}
    for event in events:
        chain, in_step, in_backward = [], False, False
        parent = event.cpu_parent
        while parent is not None:
            chain.append(parent)
            in_step = in_step or parent.name == step_range
            in_backward = in_backward or parent.name.startswith(_EVALUATE) or parent.name == BACKWARD_RANGE
            parent = parent.cpu_parent
        if event.name == step_range:
            inside.append((event, OTHER_PHASE))
            continue
        if not in_step:
            continue
        seq = getattr(event, "sequence_nr", -1)
        # An op records the sequence number the next autograd node will get: the last forward op with it
        # is the one that created the node (or runs inside it).
        if seq is not None and seq >= 0 and not in_backward and not event.name.startswith(_EVALUATE):
            kind = next((_FORWARD_KIND_OF[p.name] for p in [event] + chain if p.name in _FORWARD_KIND_OF), None)
            marked = next((p.name for p in [event] + chain if _label(p) is not None), None)
            # an op whose innermost marked range is the model's glue has no kind (the rest)
            kind_of_seq[seq] = kind if marked not in _REST_RANGES else None
        label = _label(event)
        if label is not None:
            inside.append((event, label))
    own: dict[int, float] = {}
    labelled = {id(e) for e, _ in inside}
    for event, _label_ in inside:
        own[id(event)] = own.get(id(event), 0.0) + event.time_range.elapsed_us()
        parent = event.cpu_parent
        while parent is not None and id(parent) not in labelled:
            parent = parent.cpu_parent
        if parent is not None:
            own[id(parent)] = own.get(id(parent), 0.0) - event.time_range.elapsed_us()
    totals: dict[str, float] = {}
    for event, label in inside:
        if label == "backward":
            if "AccumulateGrad" in event.name:
                label = GRAD_ACCUMULATION_PHASE
            else:
                kind = kind_of_seq.get(getattr(event, "sequence_nr", -1))
                label = f"backward: {kind}" if kind is not None else OTHER_PHASE
        elif label.startswith("kind:"):
            label = "forward: " + label[5:]
        totals[label] = totals.get(label, 0.0) + own[id(event)]
    out = {phase: totals[phase] / 1e3 / steps for phase in step_phases() if totals.get(phase, 0.0) > 0}
    out[OTHER_PHASE] = max(totals.get(OTHER_PHASE, 0.0), 0.0) / 1e3 / steps
    return out


def _norm_module(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def annotate_step(model: nn.Module, moe_blocks: Sequence[nn.Module] = (), experts: Sequence[nn.Module] = ()) -> list:
    """Mark the modules `step_breakdown` reads: the model's forward (`MODEL_RANGE`), attention
    (`ATTENTION_RANGE`), MoE blocks (`ROUTER_RANGE`: what they compute outside their experts), their experts
    modules (a sharded one `MOE_RUNTIME_RANGE`, its runtime's ranges nested; plain experts, e.g. under plain
    FSDP2, ``themis::experts``), and the outermost embeddings, norms and other weighted layers outside
    attention and MoE blocks (`DENSE_RANGE`). Returns the hook handles (``.remove()`` each to unmark)."""
    ranges = _Range()
    handles: list = []

    def mark(module: nn.Module, name: str) -> None:
        # First in and last out: the range holds the module's other hooks too.
        handles.append(module.register_forward_pre_hook(lambda m, a, name=name: ranges.enter(id(m), name),
                                                        prepend=True))
        handles.append(module.register_forward_hook(lambda m, a, o: ranges.exit(id(m)), always_call=True))

    blocks, expert_modules = list(moe_blocks), list(experts)
    special = {id(m) for m in blocks + expert_modules}
    special |= {id(m) for _n, m in attention_modules(model)}

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in special:
                continue
            if isinstance(child, (nn.Embedding, nn.Linear)) or _norm_module(child):
                mark(child, DENSE_RANGE)
            elif len(list(child.children())) == 0 and any(True for _ in child.parameters(recurse=False)):
                mark(child, DENSE_RANGE)        # another leaf with its own weights (a custom norm or head)
            else:
                walk(child)

    mark(model, MODEL_RANGE)
    walk(model)
    for _name, module in attention_modules(model):
        mark(module, ATTENTION_RANGE)
    for module in blocks:
        mark(module, ROUTER_RANGE)
    for module in expert_modules:
        if hasattr(module, "shard_placement"):
            mark(module, MOE_RUNTIME_RANGE)
        else:    # a ModuleList of experts is never called itself: its experts are
            for expert in (module if isinstance(module, nn.ModuleList) else [module]):
                mark(expert, "themis::experts")
    return handles
