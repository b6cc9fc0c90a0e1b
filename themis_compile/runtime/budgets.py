"""Where the planner's t and m come from during training (§4.2): the profiled cost model.

At ``optimize`` time, unless the config fixes both t and m:

1. a cached profile for this model, world size and hardware (``ThemisConfig.profile_path``) is used if one
   exists (rank 0 reads it; every rank plans with rank 0's numbers);
2. otherwise training starts with conservative defaults (logged), the link bandwidth is measured once on
   the process group (intra- and inter-node pairs), and an :class:`AttentionProfiler` times every
   attention's forward and backward at the real shapes over the first steps (warm-up excluded). When it
   is done, at the start of the next iteration every rank adopts rank 0's profile, t = floor(T_attn*bw/Ψ)
   and m from the memory budget are applied to each layer, and rank 0 caches the profile.

Profiling never blocks training: any failure keeps the defaults with a warning.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from themis_compile.cost_model.profile import LayerBudget, Profile, ProfileCache, budgets, profile_key, resolve_profile
from themis_compile.runtime import deadline
from themis_compile.runtime.collectives import collective_device
from themis_compile.runtime.profiling import AttentionProfiler, measure_bandwidth

logger = logging.getLogger(__name__)


class BudgetController:
    """Owns the cost-model inputs of one optimized model and applies t, m to its FSSDP layers."""

    def __init__(self, model: nn.Module, runtime: Any, *, warmup_steps: int = 1, measure_steps: int = 3) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.state = runtime.fssdp
        self.psi = {name: layer.bank.chunk_bytes for name, layer in runtime.layers.items()}
        self.cache = ProfileCache(self.config.profile_path)
        self.profile = None
        self.profiler = None
        self._pending = None
        self._checks = 0
        self._bw: dict[str, float] = {}
        # Where small collective tensors live: the group's device (NCCL needs CUDA tensors).
        self._device = collective_device(self.state.group) if self.state.world_size > 1 else torch.device("cpu")
        # The deadline of this controller's collectives: the set-up one inside optimize, then the training one.
        self._timeout_s = deadline.setup_timeout(self.state.timeout_s)
        cached = self._rank0(lambda: self._cached(model))
        if cached is not None:
            self._apply(Profile.from_json(cached, source="cache"))
            self._timeout_s = self.state.timeout_s
            return
        self._apply(None)   # conservative defaults until measured
        try:
            self._bw = measure_bandwidth(self.state.group, self.state.topology, nbytes=1 << 20, iters=3,
                                         timeout_s=self._timeout_s)
        except deadline.CollectiveError:
            raise       # a rank that does not take part: the group is unusable, training cannot go on
        except Exception as exc:  # noqa: BLE001 - profiling must never block training
            logger.warning("themis: bandwidth measurement failed (%s); using configured bandwidths", exc)
        moe_blocks = dict(model.named_modules())
        blocks = {name: moe_blocks[name] for name in runtime.layers if name in moe_blocks}
        self.profiler = AttentionProfiler(model, blocks, warmup_steps=warmup_steps, measure_steps=measure_steps,
                                          on_done=self._on_profiled)
        self._key_model = model
        self._timeout_s = self.state.timeout_s

    def _cached(self, model: nn.Module):
        found = resolve_profile(model, world_size=self.state.world_size, cache=self.cache)
        return None if found is None else found.to_json()

    def _rank0(self, fn):
        """Run ``fn`` on rank 0 and give its (picklable) result to every rank; an exception on rank 0 is
        raised on every rank (no rank is left waiting in the broadcast)."""
        box: list = [None]
        if self.state.rank == 0:
            try:
                box = [("ok", fn())]
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                box = [("err", exc)]
        if self.state.world_size > 1:
            box = [deadline.broadcast_object(box[0], 0, group=self.state.group, timeout_s=self._timeout_s,
                                             purpose="cost-model result from rank 0")]
        status, value = box[0]
        if status == "err":
            raise value
        return value

    def _on_profiled(self, profile) -> None:
        # Called from inside a hook; the collective exchange happens at the next iteration start.
        self._pending = profile

    def maybe_update(self) -> None:
        """At an iteration start on every rank: adopt rank 0's profile once every rank has finished
        profiling (a profiler can finish, or fail, on one rank and not another: readiness is agreed by a
        small all-reduce each iteration until adopted, so every rank takes the same collective path)."""
        if self.profiler is None:
            return
        self._checks += 1
        # Profiling that has not finished by then never will (e.g. a compiled model, whose hooks are
        # no-ops, or no attention running with gradients): give up rather than check every iteration.
        give_up = self._checks > self.profiler.warmup_steps + self.profiler.measure_steps + 6
        flags = torch.tensor([int(self._pending is None), int(bool(self.profiler.failed) or give_up)],
                             dtype=torch.int64, device=self._device)
        if self.state.world_size > 1:
            deadline.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.state.group, timeout_s=self.state.timeout_s,
                                purpose="profiling readiness")
        not_ready, failed = (int(v) for v in flags.tolist())
        if failed:
            logger.warning("themis: attention profiling did not complete on every rank; keeping the default "
                           "budgets")
            self.profiler.remove()
            self.profiler = None
            return
        if not_ready:
            return
        self.profiler = None
        measured, self._pending = self._pending, None
        measured.intra_node_bw = self._bw.get("intra")
        measured.inter_node_bw = self._bw.get("inter")
        data = self._rank0(lambda: measured.to_json())
        profile = Profile.from_json(data, source="measured")
        self._apply(profile)
        if self.state.rank == 0:
            try:
                profile.key = profile_key(self._key_model, self.state.world_size)
                self.cache.put(profile)
            except Exception as exc:  # noqa: BLE001
                logger.warning("themis: could not cache the profile (%s)", exc)

    def _apply(self, profile: Profile | None) -> None:
        self.profile = profile
        # Computed on rank 0 and shared: m depends on the free memory of the machine at this moment, and
        # every rank must plan with the same t and m (the plans drive collectives).
        device = next((p.device for layer in self.runtime.layers.values() for c in layer.local_chunks().values()
                       for p in c), self._device)
        layer_budgets = self._rank0(lambda: budgets(profile, self.psi, config=self.config,
                                                    topology=self.state.topology, device=device))
        apply_budgets(self.runtime.layers, layer_budgets)
        self.budgets = layer_budgets
        if self.state.rank == 0:
            logger.info("themis: budgets %s", {n: (b.overlap_degree, b.materialization_budget, b.source)
                                               for n, b in layer_budgets.items()})


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
