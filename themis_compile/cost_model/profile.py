"""Profiled inputs of the cost model: T_attn per attention layer, link bandwidths, and the budgets (t, m).

§4.2: "Since the computation pattern of an Attention layer is static during training, T_attn can be
profiled before training or captured at runtime." This module captures it at runtime:

- `AttentionProfiler` hooks every attention module (forward pre/post hooks, full backward pre/post hooks),
  times its forward and backward during the first steps at the real shapes, skips ``warmup_steps``, keeps
  the median of ``measure_steps`` and removes its hooks. It also records which attention ran last before
  each MoE layer — the window that layer's SpAG overlaps.
- `measure_bandwidth` runs a point-to-point ping-pong on the actual process group, between two ranks of one
  node (intra-node) and two ranks of different nodes (inter-node) of the `Topology`.
- `Profile` holds both; `ProfileCache` stores profiles in a JSON file keyed by the model's attention shapes,
  the world size and the hardware; `load_override` takes a hand-written profile (a path or a dict).
- `budgets` turns a profile into t = ⌊T_attn · bw / Ψ⌋ and m (from the memory budget) per MoE layer through
  `themis_compile.cost_model.analytic`; a missing or failed profile gives conservative defaults with a
  logged warning — profiling never blocks training.

Evidence of overlap: the runtime marks its sparse collectives with ``torch.profiler.record_function``
ranges `SPAG_RANGE` / `SPRS_RANGE` (and ``..._wait`` for the blocking waits); `annotate_attention` marks
attention with `ATTENTION_RANGE`; `export_chrome_trace` writes the chrome trace of one step.

Legend: B batch, S sequence, H d_model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from themis_compile.passes.attention import is_attention_module
from themis_compile.runtime import deadline

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_RANGE", "SPAG_RANGE", "SPRS_RANGE",
    "AttentionTiming", "Profile", "LayerBudget", "AttentionProfiler", "ProfileCache",
    "annotate_attention", "export_chrome_trace", "hardware_id", "profile_key", "measure_bandwidth",
    "load_override", "resolve_profile", "budgets", "apply_budgets", "default_cache_path",
]

ATTENTION_RANGE = "themis::attention"
ATTENTION_BACKWARD_RANGE = "themis::attention_backward"
SPAG_RANGE = "themis::spag"
SPRS_RANGE = "themis::sprs"

# Conservative defaults when no profile exists: one expert per window (t = 1) keeps the exposed transfer of
# a misjudged window to a single chunk while still balancing the heaviest expert.
DEFAULT_OVERLAP_DEGREE = 1


# ----------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class AttentionTiming:
    """Median forward/backward seconds of one attention module at ``input_shape``."""

    forward_s: float
    backward_s: float | None
    input_shape: tuple[int, ...] = ()
    samples: int = 0


@dataclass
class Profile:
    """Measured (or hand-given) cost-model inputs.

    Attributes:
        attention: attention module name -> timing.
        preceding_attention: MoE layer name -> the attention module that ran last before it (its window).
        intra_node_bw, inter_node_bw: measured bytes/s of one link, ``None`` when not measured.
        world_size, hardware, key: what the profile is valid for (see `profile_key`).
        source: "measured", "cache", "override" or "default".
    """

    attention: dict[str, AttentionTiming] = field(default_factory=dict)
    preceding_attention: dict[str, str] = field(default_factory=dict)
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    world_size: int = 1
    hardware: str = ""
    key: str = ""
    source: str = "measured"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["attention"] = {k: dataclasses.asdict(v) for k, v in self.attention.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str | None = None) -> Profile:
        if not isinstance(d, Mapping):
            raise ValueError(f"a profile must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known - {"t_attn_s", "t_attn_backward_s"}
        if unknown:
            raise ValueError(f"unknown profile field(s) {sorted(unknown)}; known: {sorted(known)} (+ t_attn_s)")
        attention = {}
        for name, t in (d.get("attention") or {}).items():
            if isinstance(t, (int, float)):
                t = {"forward_s": t}
            attention[name] = AttentionTiming(
                forward_s=float(t["forward_s"]),
                backward_s=None if t.get("backward_s") is None else float(t["backward_s"]),
                input_shape=tuple(t.get("input_shape", ())), samples=int(t.get("samples", 0)))
        if "t_attn_s" in d:  # one window for every layer
            attention["*"] = AttentionTiming(float(d["t_attn_s"]), d.get("t_attn_backward_s"))
        for name, t in attention.items():
            if not (t.forward_s >= 0 and math.isfinite(t.forward_s)):
                raise ValueError(f"profile: T_attn of {name!r} must be a finite number >= 0, got {t.forward_s}")
        for bw in ("intra_node_bw", "inter_node_bw"):
            v = d.get(bw)
            if v is not None and not (float(v) > 0 and math.isfinite(float(v))):
                raise ValueError(f"profile: {bw} must be a positive finite number, got {v}")
        return cls(attention=attention, preceding_attention=dict(d.get("preceding_attention") or {}),
                   intra_node_bw=None if d.get("intra_node_bw") is None else float(d["intra_node_bw"]),
                   inter_node_bw=None if d.get("inter_node_bw") is None else float(d["inter_node_bw"]),
                   world_size=int(d.get("world_size", 1)), hardware=str(d.get("hardware", "")),
                   key=str(d.get("key", "")), source=source or str(d.get("source", "override")))

    def t_attn(self, moe_layer: str) -> float | None:
        """T_attn of the window of ``moe_layer`` (its preceding attention), or None if unknown."""
        name = self.preceding_attention.get(moe_layer)
        timing = self.attention.get(name) if name is not None else None
        if timing is None:
            timing = self.attention.get("*")
        return None if timing is None else timing.forward_s

    def merged(self, other: Profile) -> Profile:
        """This profile with ``other``'s known values taking precedence (hand overrides over measurements)."""
        return Profile(attention={**self.attention, **other.attention},
                       preceding_attention={**self.preceding_attention, **other.preceding_attention},
                       intra_node_bw=other.intra_node_bw or self.intra_node_bw,
                       inter_node_bw=other.inter_node_bw or self.inter_node_bw,
                       world_size=self.world_size, hardware=self.hardware, key=self.key, source=other.source)


@dataclass(frozen=True)
class LayerBudget:
    """t and m of one MoE layer and the inputs they came from (§4.2)."""

    overlap_degree: int
    materialization_budget: int
    t_attn_s: float | None
    bw: float
    psi_bytes: int
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"t": self.overlap_degree, "m": self.materialization_budget, "T_attn_s": self.t_attn_s,
                "bw": self.bw, "psi_bytes": self.psi_bytes, "source": self.source}


# ----------------------------------------------------------------------------------------- keys / cache
def hardware_id() -> str:
    """GPU name when CUDA is available, else the CPU model."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{name or platform.processor() or platform.machine()}"


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_attention_module(m)]


def profile_key(model: nn.Module, world_size: int, input_shape: Iterable[int] = (), hardware: str | None = None
                ) -> str:
    """A short stable key: attention modules' parameter shapes and dtypes, input shape, world size, hardware."""
    shapes = [(name, [(tuple(p.shape), str(p.dtype)) for p in m.parameters()]) for name, m in
              _attention_modules(model)]
    blob = json.dumps({"attention": shapes, "input": list(input_shape), "world_size": int(world_size),
                       "hardware": hardware or hardware_id()}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def default_cache_path() -> Path:
    root = os.environ.get("THEMIS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "themis_compile")
    return Path(root) / "profiles.json"


class ProfileCache:
    """Profiles in one JSON file, ``{key: profile}``. Unreadable files are treated as empty (with a warning)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError) as exc:
            logger.warning("themis profile cache %s is unreadable (%s); ignoring it", self.path, exc)
            return {}

    def get(self, key: str) -> Profile | None:
        entry = self._read().get(key)
        if entry is None:
            return None
        try:
            return Profile.from_json(entry, source="cache")
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("themis profile cache entry %s is invalid (%s); ignoring it", key, exc)
            return None

    def put(self, profile: Profile) -> None:
        if not profile.key:
            raise ValueError("a profile needs a key to be cached")
        data = self._read()
        data[profile.key] = profile.to_json()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)          # atomic: concurrent readers see old or new, never half
        except OSError as exc:
            logger.warning("themis profile cache %s is not writable (%s); profile not cached", self.path, exc)


def load_override(source: str | os.PathLike | Mapping[str, Any]) -> Profile:
    """A hand-written profile from a JSON file path or a dict.

    Accepted fields: ``attention`` ({module name: seconds or {"forward_s", "backward_s"}}), ``t_attn_s`` (one
    window for every layer), ``preceding_attention``, ``intra_node_bw``, ``inter_node_bw``.
    """
    if isinstance(source, Mapping):
        return Profile.from_json(source, source="override")
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the profile override {path}: {exc}") from exc
    return Profile.from_json(data, source="override")


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
    for _name, module in _attention_modules(model):
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
        model: the model (attention modules found by `themis_compile.passes.schedule.is_attention_module`).
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
        self._attn = _attention_modules(model)
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
            self._fail("the model has no attention module (mark one with themis_compile.passes.schedule."
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


# ----------------------------------------------------------------------------------------- budgets
def _memory_bytes(memory_budget: float, device: torch.device | None) -> float:
    if memory_budget > 1.0:
        return float(memory_budget)
    if device is not None and device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 0
    return float(memory_budget) * float(free)


def budgets(profile: Profile | None, layers: Mapping[str, int], *, config=None, topology=None,
            param_bytes: int = 4, device: torch.device | None = None) -> dict[str, LayerBudget]:
    """t and m per MoE layer (§4.2) from a profile.

    Args:
        profile: measured/cached/overridden inputs; ``None`` means none exists (defaults, with a warning).
        layers: MoE layer name -> Ψ, one expert's parameter bytes (``ExpertBank.chunk_bytes``).
        config: a `ThemisConfig` (``overlap_degree``/``materialization_budget`` override the model,
            ``memory_budget`` sizes m, ``intra_node_bw``/``inter_node_bw`` are the bandwidth defaults).
        topology: the `Topology`; on several nodes bw is the inter-node bandwidth (the per-node ingress
            binds, §4.2), else the intra-node one.
        param_bytes: bytes per parameter (gradients the same), for m.
        device: where replicas live (free memory for a fractional ``memory_budget``).
    """
    from themis_compile.config import ThemisConfig
    from themis_compile.cost_model import analytic

    config = config or ThemisConfig()
    multi_node = topology is not None and topology.num_nodes > 1
    if multi_node:
        bw = (profile.inter_node_bw if profile else None) or config.inter_node_bw
    else:
        bw = (profile.intra_node_bw if profile else None) or config.intra_node_bw
    if profile is None:
        logger.warning("themis: no cost-model profile; using conservative defaults (t=%d, bw=%.3g B/s)",
                       DEFAULT_OVERLAP_DEGREE, bw)
    precision = analytic.Precision(param_bytes=param_bytes, grad_bytes=param_bytes, optimizer_bytes=0)
    memory = _memory_bytes(config.memory_budget, device)
    out = {}
    for name, psi in layers.items():
        t_attn = profile.t_attn(name) if profile is not None else None
        if config.overlap_degree is not None:
            t, source = int(config.overlap_degree), "config"
        elif t_attn is None:
            if profile is not None:
                logger.warning("themis: no T_attn for MoE layer %s; using t=%d", name, DEFAULT_OVERLAP_DEGREE)
            t, source = DEFAULT_OVERLAP_DEGREE, "default"
        else:
            t, source = analytic.overlap_degree(t_attn, bw, psi), profile.source
        if config.materialization_budget is not None:
            m = int(config.materialization_budget)
        else:
            m = analytic.materialization_budget(memory, psi, max(len(layers), 1),
                                                rematerialize=config.rematerialize, precision=precision)
        out[name] = LayerBudget(overlap_degree=t, materialization_budget=m, t_attn_s=t_attn, bw=float(bw),
                                psi_bytes=int(psi), source=source)
    return out


def apply_budgets(runtime_layers: Mapping[str, nn.Module], layer_budgets: Mapping[str, LayerBudget]) -> list[str]:
    """Set ``overlap_degree``/``materialization_budget`` on the runtime's layers that have them; returns the
    names updated."""
    updated = []
    for name, b in layer_budgets.items():
        layer = runtime_layers.get(name)
        if layer is not None and hasattr(layer, "overlap_degree"):
            layer.overlap_degree = b.overlap_degree
            layer.materialization_budget = b.materialization_budget
            updated.append(name)
    return updated


# ----------------------------------------------------------------------------------------- traces
def export_chrome_trace(step: Callable[[], Any], path: str | os.PathLike, *, with_stack: bool = False) -> Path:
    """Run ``step()`` once under ``torch.profiler`` (CPU, and CUDA when available) and write its chrome trace
    to ``path``; the themis ranges (`SPAG_RANGE`, `SPRS_RANGE`, `ATTENTION_RANGE`, ...) appear in it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, with_stack=with_stack) as prof:
        step()
    prof.export_chrome_trace(str(path))
    return path


def resolve_profile(model: nn.Module, *, world_size: int = 1, input_shape: Iterable[int] = (),
                    cache: ProfileCache | None = None,
                    override: str | os.PathLike | Mapping[str, Any] | None = None) -> Profile | None:
    """The profile to plan with, without measuring: the cached one for this model, world size and hardware,
    with a hand override (path or dict) on top; ``None`` when neither exists (then measure, or use
    `budgets`' defaults). A broken override raises ValueError — it is the user's explicit input."""
    key = profile_key(model, world_size, input_shape)
    found = (cache or ProfileCache()).get(key)
    if override is not None:
        manual = load_override(override)
        found = manual if found is None else found.merged(manual)
        found.key = key
    return found
