"""Profiled inputs of the cost model: T_attn per attention layer, link bandwidths, and the budgets (t, m).

§4.2: "Since the computation pattern of an Attention layer is static during training, T_attn can be
profiled before training or captured at runtime." The capture (hooks, timers, the bandwidth ping-pong)
is effectful and lives in `themis_compile.runtime.profiling`; this module holds what it produces and what
is computed from it:

- `Profile` holds the measured T_attn per attention module (`AttentionTiming`), which attention precedes
  each MoE layer (the window its SpAG overlaps) and the link bandwidths; `ProfileCache` stores profiles
  in a JSON file keyed by the model's attention shapes, the world size and the hardware (`profile_key`);
  `load_override` takes a hand-written profile (a path or a dict); `resolve_profile` combines the two.
- `budgets` turns a profile into t = ⌊T_attn · bw / Ψ⌋ and m (from the memory budget) per MoE layer through
  `themis_compile.cost_model.analytic`; a missing or failed profile gives conservative defaults with a
  logged warning — profiling never blocks training.
- The names of the profiler ranges the runtime opens: `SPAG_RANGE` / `SPRS_RANGE` (and ``..._wait`` for
  the blocking waits) around the sparse collectives, `ATTENTION_RANGE` around attention
  (`runtime.profiling.annotate_attention`).

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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from themis_compile.attention import is_attention_module
from themis_compile.config import ThemisConfig
from themis_compile.cost_model import analytic

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_RANGE", "SPAG_RANGE", "SPRS_RANGE",
    "AttentionTiming", "Profile", "LayerBudget", "ProfileCache",
    "attention_modules", "hardware_id", "profile_key", "load_override", "resolve_profile", "budgets",
    "default_cache_path",
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


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module of ``model`` (`passes.attention.is_attention_module`)."""
    return [(name, m) for name, m in model.named_modules() if is_attention_module(m)]


def profile_key(model: nn.Module, world_size: int, input_shape: Iterable[int] = (), hardware: str | None = None
                ) -> str:
    """A short stable key: attention modules' parameter shapes and dtypes, input shape, world size, hardware."""
    shapes = [(name, [(tuple(p.shape), str(p.dtype)) for p in m.parameters()]) for name, m in
              attention_modules(model)]
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
