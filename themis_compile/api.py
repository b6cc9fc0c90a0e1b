"""The public entry points: ``optimize(model, config, *, group)`` and ``explain(model)``."""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from themis_compile.config import ThemisConfig
from themis_compile.passes.detect import MoELayerInfo, explain_moe_layers, find_moe_layers
from themis_compile.passes.shard import prepare_moe_layers
from themis_compile.runtime.collectives import collective_device

logger = logging.getLogger(__name__)

# The models `optimize` rewrote, for helpers handed only their parameters (`clip_grad_norm_`); an entry
# lives as long as its model.
_OPTIMIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclass
class ThemisRuntime:
    """What ``optimize`` did to a model; reachable as ``themis_compile.runtime_of(model)``."""

    config: ThemisConfig
    rank: int
    world_size: int
    group: object
    layers: dict[str, nn.Module] = field(default_factory=dict)   # layer name -> ShardedExperts
    fssdp: object = None                                           # FSSDPState under themis / themis-rm
    reshard_scheduler: object = None                               # ReshardScheduler (Alg. 2 every k steps)

    @property
    def stats(self) -> list:
        """Per-layer, per-iteration load statistics (:class:`~themis_compile.runtime.fssdp.LayerStats`),
        oldest first; empty for policies other than themis / themis-rm."""
        return [] if self.fssdp is None else list(self.fssdp.stats)

    @property
    def layer_order(self) -> list:
        """The sharded experts modules in the order the last forward ran them."""
        return list(self.layers.values()) if self.fssdp is None else list(self.fssdp.layer_order)


def _resolve_group(group) -> tuple[object, int, int]:
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        group = group.get_group()
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _broadcast_experts(module: nn.Module, group) -> None:
    # Every rank built the model; rank 0's experts are the truth (as DDP does for dense parameters), so
    # a rank seeded differently cannot silently train different experts.
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for p in module.parameters():
        dist.broadcast(p.data, src=src, group=group)


def optimize(model: nn.Module, config: ThemisConfig | None = None, *, group=None, strict: bool = False) -> nn.Module:
    """Shard the MoE layers of ``model`` over the ranks of ``group`` and make dense parameters data-parallel.

    Args:
        model: an ``nn.Module`` with MoE layers, built identically on every rank.
        config: a :class:`ThemisConfig`; default ``ThemisConfig()``.
        group: a ProcessGroup or DeviceMesh; default the default group, or world size 1 without one.
        strict: raise instead of warning when no MoE layer is found.

    Returns the same module object, modified in place: its MoE layers' experts are replaced by sharded
    experts holding only the experts this rank owns, and its dense parameters are made data-parallel with
    torch's FSDP2 (``fully_shard``) or DDP (``replicate``, ``dense_parallel="ddp"``) when the world size
    exceeds 1.
    """
    from themis_compile.planner.placement import Placement
    from themis_compile.runtime.ep import ShardedExperts
    from themis_compile.runtime.experts import ExpertBank

    config = ThemisConfig() if config is None else config
    if not isinstance(config, ThemisConfig):
        raise TypeError(f"config must be a ThemisConfig, got {type(config).__name__}")
    group, rank, world_size = _resolve_group(group)
    if getattr(model, "_themis_runtime", None) is not None:
        raise ValueError("this model was already optimized by themis_compile")
    # Detect, rewrite expert loops into one experts(x, ids, weights) call, verify on a probe; warns (or
    # raises with strict=True) when nothing is found, raises naming the layer on a bad top-k.
    infos = prepare_moe_layers(model, strict=strict)
    if not infos:
        return model

    runtime = ThemisRuntime(config=config, rank=rank, world_size=world_size, group=group)
    fssdp = config.policy in ("themis", "themis-rm") and world_size > 1
    if fssdp:
        state = _fssdp_state(config, group, rank, world_size)
        runtime.fssdp = state
    sharded = []
    for index, info in enumerate(infos):
        block = info.module
        original = getattr(block, info.experts_attr)
        if world_size > 1:
            _broadcast_experts(original, group)
        bank = ExpertBank(original, layer=info.name)
        shard = Placement.contiguous(bank.num_experts, world_size)
        if fssdp:
            experts = _fssdp_experts(bank, original, shard, state, index, info, config)
        else:
            experts = ShardedExperts(bank, original, shard, rank=rank, world_size=world_size, group=group,
                                     layer=info.name, uniform_routing=config.policy == "uniform")
        setattr(block, info.experts_attr, experts)
        if world_size > 1 and hasattr(block, "global_tokens_per_expert"):
            block.global_tokens_per_expert = _make_count_reducer(group)
        if config.policy == "uniform" and callable(getattr(block, "route", None)):
            # So that the block's own counts and aux loss see the uniform assignment too.
            block.route = _make_uniform_route(block.route, bank.num_experts)
        runtime.layers[info.name] = experts
        sharded.append(experts)

    if world_size > 1:
        _make_dense_data_parallel(model, sharded, group, config)
    if fssdp and config.reshard_interval:
        from themis_compile.runtime.reshard import ReshardScheduler

        # After the dense wrapper: FSDP2 replaces dense parameters with new (DTensor) parameter objects,
        # which are the ones the user's optimizer will hold.
        sharded_ids = {id(p) for m in sharded for p in m.parameters()}
        dense = [p for p in model.parameters() if id(p) not in sharded_ids]
        runtime.reshard_scheduler = ReshardScheduler(runtime, config.reshard_interval, dense)
    model._themis_runtime = runtime
    _OPTIMIZED.add(model)
    if fssdp:
        state.layers = list(sharded)
    if fssdp and (config.overlap_degree is None or config.materialization_budget is None):
        from themis_compile.runtime.budgets import BudgetController

        state.budget_controller = BudgetController(model, runtime)
    import themis_compile.passes.backend  # noqa: F401  registers torch.compile(backend="themis") without install
    if config.schedule and fssdp:
        # Place each layer's SpAG start before the attention that precedes it (§4.2); layers in no
        # traceable module keep the runtime's own start at their forward (logged).
        from themis_compile.passes.schedule import schedule_model

        schedule_model(model)
    logger.info("themis_compile: %d MoE layers sharded over %d ranks (policy %s)", len(infos), world_size,
                config.policy)
    return model


def _make_dense_data_parallel(model: nn.Module, sharded: list[nn.Module], group, config: ThemisConfig) -> None:
    """Dense (non-expert) parameters: torch's DDP (composable ``replicate``) or FSDP2 (``fully_shard``)."""
    if config.dense_parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(dist.get_world_size())):
            raise ValueError("dense_parallel='fsdp2' needs the default group's ranks in order")
        device = collective_device(group).type
        mesh = init_device_mesh(device, (len(ranks),))
        expert_params = {p for m in sharded for p in m.parameters()}
        fully_shard(model, mesh=mesh, ignored_params=expert_params)
        return
    from torch.distributed._composable.replicate import replicate

    replicate(model, ignored_modules=sharded, process_group=group)


def _fssdp_state(config: ThemisConfig, group, rank: int, world_size: int):
    from themis_compile.planner import Topology
    from themis_compile.runtime.fssdp import FSSDPState

    topology = Topology.from_env(world_size, config.devices_per_node, intra_node_bw=config.intra_node_bw,
                                 inter_node_bw=config.inter_node_bw)
    # The sparse collectives get a group of their own so that their point-to-point traffic never
    # interleaves with the all-to-all of the token exchange.
    comm_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
    # Its first operation involves every rank: on NCCL, batched point-to-point operations may involve a
    # subset of the group's ranks only once the communicator exists (torch's batch_isend_irecv contract).
    dist.all_reduce(torch.zeros(1, device=collective_device(comm_group)), group=comm_group)
    return FSSDPState(rank=rank, world_size=world_size, group=group, comm_group=comm_group, topology=topology,
                      rematerialize=config.rematerialize, calibrate=config.calibrate,
                      timeout_s=config.collective_timeout_s, check_plans=config.check_plans)


def _fssdp_experts(bank, experts, shard, state, index: int, info: MoELayerInfo, config: ThemisConfig):
    from themis_compile.planner import PlanCost
    from themis_compile.runtime.fssdp import FSSDPExperts, default_budgets

    t, m = default_budgets(bank.num_experts, state.world_size, config.overlap_degree,
                           config.materialization_budget)
    # Forward FLOPs of one token through one expert at a nominal 1e10 FLOP/s until a profile exists.
    flops = 2 * sum(torch.Size(shape).numel() for shape, _ in bank.spec)
    cost = PlanCost(time_per_token_s=flops / 1e10, expert_bytes=float(bank.chunk_bytes), topology=state.topology)
    return FSSDPExperts(bank, experts, shard, state=state, layer_index=index, overlap_degree=t,
                        materialization_budget=m, cost=cost, predictor_window=config.predictor_window,
                        layer=info.name)


def _make_count_reducer(group):
    def global_tokens_per_expert(counts_E: torch.Tensor) -> torch.Tensor:
        counts_E = counts_E.clone()
        dist.all_reduce(counts_E, group=group)
        return counts_E

    return global_tokens_per_expert


def uniform_ids(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pair (t, k) -> expert (t*K + k) mod E: every expert gets the same number of pairs (up to one)."""
    T, K = ids_TK.shape
    return torch.arange(T * K, device=ids_TK.device).view(T, K) % num_experts


def _make_uniform_route(route, num_experts: int):
    """The reference gate of the paper's "Uniform": pairs spread round-robin over the experts (top-k
    distinct per token), gate weights and gradients from the user's router. Benchmarking only."""

    def uniform_route(x_TH: torch.Tensor):
        weights_TK, ids_TK, probs_TE = route(x_TH)
        T, K = ids_TK.shape
        return weights_TK, uniform_ids(ids_TK, num_experts), probs_TE

    return uniform_route


def optimized_models() -> list[nn.Module]:
    """The live models ``optimize`` rewrote (in no particular order)."""
    return list(_OPTIMIZED)


def runtime_of(model: nn.Module) -> ThemisRuntime:
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is None:
        raise ValueError("this model was not optimized by themis_compile.optimize")
    return runtime


def explain(model: nn.Module, verbose: bool = False) -> str:
    """A report of the MoE layers ``optimize`` would shard (router kind, experts form, top-k, activation,
    shared experts) and of MoE-like modules it rejected, with the reason; ``verbose`` adds the router
    path, score function, auxiliary outputs and how the experts are called."""
    if verbose:
        return explain_moe_layers(model)
    infos, rejected = find_moe_layers(model)
    lines = [f"{len(infos)} MoE layer(s) found"]
    lines += [f"  {info.name}: {info.describe()}" for info in infos]
    lines += [f"  rejected {name}: {why}" for name, why in rejected]
    return "\n".join(lines)
