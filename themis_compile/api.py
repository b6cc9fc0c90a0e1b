"""The public entry points: ``optimize(model, config, *, group)`` and ``explain(model)``."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

from themis_compile.config import ThemisConfig
from themis_compile.export import bind_save_pretrained, guard_state_dict
from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import shared_parameter_names
from themis_compile.passes.detect import SEARCHED, find_moe_layers
from themis_compile.passes.explain import explain_moe_layers
from themis_compile.passes.probe import probing_as_recorded
from themis_compile.passes.schedule import schedule_model
from themis_compile.passes.styles import describe_layer, left_as_they_are, prepare_found
from themis_compile.planner import PlanCost, Placement, Topology
from themis_compile.runtime import deadline
from themis_compile.runtime.budgets import BudgetController
from themis_compile.runtime.collectives import collective_device
from themis_compile.runtime.ep import ShardedExperts, uniform_ids
from themis_compile.runtime.experts import ExpertBank, zero_rows_of
from themis_compile.runtime.fssdp import FSSDPExperts, FSSDPState, default_budgets
from themis_compile.runtime.registry import ThemisRuntime, optimized_models, register, runtime_of
from themis_compile.runtime.replicas import install_replica_check
from themis_compile.runtime.reshard import ReshardScheduler
from themis_compile.runtime.unused import UnusedGradients

__all__ = ["ThemisRuntime", "explain", "optimize", "optimized_models", "runtime_of", "uniform_ids"]

logger = logging.getLogger(__name__)

def _resolve_group(group) -> tuple[object, int, int, object]:
    """(the experts' process group, this rank in it, its size, the dense parameters' 2-D mesh or None).

    A 1-D ``DeviceMesh`` is its group. A 2-D one, ``(replicate, shard)`` as torch's HSDP takes it, shards
    the experts over all of its ranks and the dense parameters by FSDP2 over the mesh itself: sharded
    along the second dimension (a node, typically), replicated along the first."""
    mesh = None
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim == 2:
            mesh = group
            ranks = group.mesh.flatten().tolist()
            if not (dist.is_initialized() and ranks == list(range(dist.get_world_size()))):
                raise ValueError(f"optimize: a 2-D DeviceMesh must span the default group's ranks in order "
                                 f"(init_device_mesh(device, (replicas, shards))); this one holds ranks {ranks}")
            group = None
        elif group.ndim != 1:
            raise ValueError(f"optimize: group is a {group.ndim}-D DeviceMesh {tuple(group.shape)}; give a 1-D mesh "
                             f"or group (experts and dense parameters over its ranks) or a 2-D (replicate, shard) "
                             f"mesh for HSDP of the dense parameters")
        else:
            group = group.get_group()
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1, None
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group), mesh


def _broadcast_experts(module: nn.Module, group, timeout_s: float = deadline.DEFAULT_TIMEOUT_S) -> None:
    # Every rank built the model; rank 0's experts are the truth (as DDP does for dense parameters), so
    # a rank seeded differently cannot silently train different experts.
    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    for p in module.parameters():
        deadline.broadcast(p.data, src, group=group, timeout_s=timeout_s, purpose="experts from rank 0")


def optimize(model: nn.Module, config: ThemisConfig | None = None, *, group=None, strict: bool = False,
             example_inputs: tuple | dict | None = None) -> nn.Module:
    """Shard the MoE layers of ``model`` over the ranks of ``group`` and make dense parameters data-parallel.

    Args:
        model: an ``nn.Module`` with MoE layers, built identically on every rank.
        config: a :class:`ThemisConfig`; default ``ThemisConfig()``.
        group: a ProcessGroup or DeviceMesh; default the default group, or world size 1 without one.
        strict: raise ``ValueError`` instead of warning when no MoE layer is found or when a module that
            looks MoE-like is not sharded (rejected, or found but its rewrite failed its check on a probe).
        example_inputs: arguments for one forward of ``model``, as for ``torch.export``: a tuple of
            positional arguments or a dict of keyword arguments of ``model(...)``, the same on every rank.
            Used only when a candidate MoE layer's forward does not run on hidden states alone (it needs
            position embeddings, masks or token ids): detection then probes it with the arguments it gets
            in that forward. Default: seeded token ids ``[2, 8]`` from the text config's vocabulary for an
            HF ``PreTrainedModel``; for any other model such a candidate is rejected with a reason that
            asks for ``example_inputs``.

    Returns the same module object, modified in place: its MoE layers' experts are replaced by sharded
    experts holding only the experts this rank owns, and everything else is made data-parallel with
    torch's FSDP2 (``fully_shard``) or DDP (``replicate``, ``dense_parallel="ddp"``) when the world size
    exceeds 1. Whatever is not sharded is data-parallel, never left out: a model with no MoE layer found
    is entirely data-parallel, and an MoE-like module that is rejected keeps its experts as dense
    parameters (a warning names each such module and why; ``strict=True`` raises instead). Either way the
    model trains as it would in one process on the whole global batch.
    """
    config = ThemisConfig() if config is None else config
    if not isinstance(config, ThemisConfig):
        raise TypeError(f"config must be a ThemisConfig, got {type(config).__name__}")
    group, rank, world_size, dense_mesh = _resolve_group(group)
    if getattr(model, "_themis_runtime", None) is not None:
        raise ValueError("this model was already optimized by themis_compile")
    # Detect once (read-only); name what will not be sharded before anything changes. Then rewrite each
    # layer by its style into one experts(x, ids, weights) call, each checked on a probe first (raises
    # naming the layer).
    found, rejected = find_moe_layers(model, example_inputs)
    _report_unsharded(model, found, rejected, strict=strict, world_size=world_size, config=config)
    with probing_as_recorded(found):     # layers found with recorded inputs are probed with them
        infos, left = prepare_found(found, rejected, strict=strict) if found else ([], [])
    if left:     # their rewrite failed its check: data-parallel like a rejected module, said so
        fate = f"data-parallel through {config.dense_parallel} over {world_size} ranks" if world_size > 1 else \
            "as they are (world size 1)"
        warnings.warn(left_as_they_are(left, "themis_compile.optimize", fate), UserWarning, stacklevel=2)
        rejected = rejected + left

    runtime = ThemisRuntime(config=config, rank=rank, world_size=world_size, group=group,
                            unsharded=[(name, _one_line(why)) for name, why in rejected])
    # "uniform" is themis' own path with an even assignment and no replicas: the force-balanced ideal.
    fssdp = bool(infos) and config.policy in ("themis", "themis-rm", "uniform") and world_size > 1
    if fssdp:
        state = _fssdp_state(config, group, rank, world_size)
        runtime.fssdp = state
    sharded = []
    for info in infos:
        block = info.module
        if info.tied_to:
            # Tied weights: these experts are an earlier layer's, whose sharded experts serve both calls
            # (their gradients accumulate into the one owner's chunk, as into one parameter in one process).
            experts = runtime.layers[info.tied_to]
        else:
            original = getattr(block, info.experts_attr)
            if world_size > 1:
                _broadcast_experts(original, group, deadline.setup_timeout(config.collective_timeout_s))
            bank = ExpertBank(original, layer=info.name, num_experts=info.num_experts)
            shard = Placement.contiguous(bank.num_experts, world_size)
            if fssdp:
                experts = _fssdp_experts(bank, original, shard, state, len(sharded), info, config)
                experts.uniform_routing = config.policy == "uniform"
            else:
                experts = ShardedExperts(bank, original, shard, rank=rank, world_size=world_size, group=group,
                                         layer=info.name, uniform_routing=config.policy == "uniform",
                                         timeout_s=config.collective_timeout_s,
                                         skips_empty_experts=info.skips_empty_experts)
            experts.kernels_backend = config.kernels    # the dispatch/combine kernels of this model
            experts.expert_row_block = config.expert_row_block
        setattr(block, info.experts_attr, experts)
        if world_size > 1 and hasattr(block, "global_tokens_per_expert"):
            block.global_tokens_per_expert = _make_count_reducer(group, info.name, config.collective_timeout_s)
        if config.policy == "uniform" and callable(getattr(block, "route", None)):
            # So that the block's own counts and aux loss see the uniform assignment too.
            block.route = _make_uniform_route(block.route, experts.num_experts)
        if info.tied_to:
            continue
        runtime.layers[info.name] = experts
        runtime.layer_infos[info.name] = info
        sharded.append(experts)

    if world_size > 1:
        _make_dense_data_parallel(model, sharded, group, config, conditional=runtime.unsharded, mesh=dense_mesh)
    if fssdp and config.reshard_interval and config.policy != "uniform":     # even loads: nothing to re-shard
        # After the dense wrapper: FSDP2 replaces dense parameters with new (DTensor) parameter objects,
        # which are the ones the user's optimizer will hold.
        sharded_ids = {id(p) for m in sharded for p in m.expert_parameters()}
        dense = [p for p in model.parameters() if id(p) not in sharded_ids]
        runtime.reshard_scheduler = ReshardScheduler(runtime, config.reshard_interval, dense)
    register(model, runtime)
    guard_state_dict(model)          # state_dict() raises where it would hold only this rank's experts
    bind_save_pretrained(model)      # an HF model's save_pretrained writes the whole model
    if fssdp:
        state.layers = list(sharded)
    if fssdp and config.policy != "uniform" and (config.overlap_degree is None or config.materialization_budget is None):
        state.budget_controller = BudgetController(model, runtime)
    # torch.compile(backend="themis") also from a source tree the package's entry point does not cover.
    from themis_compile.passes.backend import register_backend

    register_backend()
    if config.schedule and fssdp:
        # Place each layer's SpAG start before the attention that precedes it (§4.2): in FX graphs where
        # the model traces, by module hooks from the first forward's order where it does not.
        schedule_model(model, runtime.layers)
    logger.info("themis_compile: %d MoE layers sharded over %d ranks (policy %s)", len(infos), world_size,
                config.policy)
    return model


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _report_unsharded(model: nn.Module, found: list[MoELayerInfo], rejected: list[tuple[str, str]], *,
                      strict: bool, world_size: int, config: ThemisConfig) -> None:
    """Warn (or raise with ``strict``) about what ``optimize`` will not shard: no MoE layer at all, or
    MoE-like modules that failed a check — one line each, with the reason."""
    if found and not rejected:
        return
    what = (f"found no MoE layer in {type(model).__name__} (searched for {SEARCHED})" if not found
            else f"{len(rejected)} MoE-like module(s) not sharded")
    lines = [f"  {name}: {_one_line(why)}" for name, why in rejected]
    if strict:
        raise ValueError("\n".join([f"themis_compile.optimize(strict=True): {what}"] + lines))
    parallel = f"data-parallel through {config.dense_parallel} over {world_size} ranks"
    if not found:
        fate = f"the whole model is {parallel}" if world_size > 1 else "the model runs as it is (world size 1)"
    else:
        fate = "their experts stay dense parameters" + (f", {parallel}" if world_size > 1 else " (world size 1)")
    warnings.warn("\n".join([f"themis_compile.optimize: {what}; {fate}"] + lines), UserWarning, stacklevel=3)


def _make_dense_data_parallel(model: nn.Module, sharded: list[nn.Module], group, config: ThemisConfig, *,
                              conditional: list[tuple[str, str]] = (), mesh=None) -> None:
    """Everything but the sharded experts: torch's DDP (composable ``replicate``) or FSDP2 (``fully_shard``).

    ``mesh``: a 2-D ``(replicate, shard)`` DeviceMesh for FSDP2's HSDP (dense parameters sharded along its
    second dimension, replicated along its first); by default FSDP2 shards over a 1-D mesh of all ranks.
    DDP replicates over all ranks either way.

    Any dense parameter may go without a gradient on some ranks in a step: the experts of a rejected
    MoE-like module (``conditional`` names those) or of one detection did not recognise at all get none on a
    rank that routed no token to them. Both wrappers are always told
    so, or ranks would reduce different sets of gradients and the job would die in a mismatched collective:
    FSDP2 reduce-scatters a zero gradient for them (``set_reduce_scatter_unused_params``; free where every
    parameter has a gradient), DDP finds them in each backward (``find_unused_parameters``: one traversal of
    the autograd graph per backward, the price of never entering a mismatched all-reduce).
    """
    if config.dense_parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(dist.get_world_size())):
            raise ValueError("dense_parallel='fsdp2' needs the default group's ranks in order")
        if mesh is None:
            mesh = init_device_mesh(collective_device(group).type, (len(ranks),))
        # The owned experts only: parameters every expert of a layer uses (a shared norm) are dense.
        expert_params = {p for m in sharded for p in m.expert_parameters()}
        if conditional and not _fsdp2_reduces_unused_params():
            names = ", ".join(name for name, _ in conditional)
            raise ValueError(f"dense_parallel='fsdp2' cannot make the unsharded MoE-like modules {names} data-parallel "
                             f"on torch {torch.__version__} (no FSDPModule.set_reduce_scatter_unused_params: ranks "
                             f"that routed no token to an expert would reduce different gradients); use "
                             f"ThemisConfig(dense_parallel='ddp') or a newer torch")
        fully_shard(model, mesh=mesh, ignored_params=expert_params)
        if _fsdp2_reduces_unused_params():
            model.set_reduce_scatter_unused_params(True)
        if conditional:
            # A zero gradient where no rank used a parameter would still move it under AdamW, where one
            # process leaves it without one (runtime/unused.py).
            modules = [model if name == "<root>" else model.get_submodule(name) for name, _ in conditional]
            UnusedGradients(model, modules, group, config.collective_timeout_s)
    else:
        from torch.distributed._composable.replicate import replicate

        # The owned experts' modules, not the sharded layers: a layer's shared parameters are DDP's.
        owned = [m.expert(e) for m in sharded for e in m.owned_experts()]
        owned += [rows for m in sharded if (rows := zero_rows_of(m)) is not None]   # held by one rank each, too
        replicate(model, ignored_modules=owned, process_group=group, find_unused_parameters=True)
        # Per-rank gradient scaling (torch's clip_grad_norm_ sees one rank's experts) would make the
        # replicas drift apart silently: the model checks them (runtime/replicas.py).
        install_replica_check(model, sharded, group, config.check_replicas, config.collective_timeout_s)
    model._ddp_params_and_buffers_to_ignore = RefuseDDPWrap(config.dense_parallel)
    model.register_forward_pre_hook(_refuse_second_fully_shard(model, config.dense_parallel), prepend=True)


def _refuse_second_fully_shard(model: nn.Module, dense_parallel: str):
    """A forward pre-hook that raises, on every rank before any collective of that forward, once a
    ``fully_shard`` other than ``optimize``'s own root one was applied to the model or a module in it.

    Such a call (Lightning's or torchtitan's FSDP, accelerate's FSDP2 plugin, a user's per-block
    ``fully_shard``) would cut every rank's own experts into shards as if they were replicas; torch raises
    only in some of these cases (a second root call, a block of DTensors), so the model checks itself.
    """
    from torch.distributed.fsdp import FSDPModule

    def check(module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            return
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule) and not (m is model and dense_parallel == "fsdp2"):
                raise RuntimeError(ddp_wrap_message(dense_parallel, f"fully_shard (on {name or 'the model'})"))

    return check


class RefuseDDPWrap:
    """What ``optimize`` sets as the model's ``_ddp_params_and_buffers_to_ignore`` (the attribute
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` writes and DDP's constructor
    reads first): reading it raises, so that a ``DistributedDataParallel(model)`` — accelerate's
    ``prepare``, HF Trainer, Lightning's DDP strategy — stops on every rank, before its first collective,
    with what to do instead.

    The model is already data-parallel, and a wrapping DDP cannot be made harmless: its construction would
    broadcast rank 0's experts over every other rank's (each rank holds different experts), its reducer
    would average gradients of different experts, under FSDP2 it cannot take the DTensor parameters at all,
    and the frameworks that wrap also clip with ``torch.nn.utils.clip_grad_norm_``, which sees one rank's
    experts only (``themis_compile.clip_grad_norm_``). Ignoring every parameter is no way out either: DDP
    refuses a module without parameters to reduce. The integrations in ``themis_compile.integrations``
    keep the model unwrapped instead.
    """

    def __init__(self, dense_parallel: str) -> None:
        self.dense_parallel = dense_parallel

    def __iter__(self):
        raise RuntimeError(ddp_wrap_message(self.dense_parallel))


def ddp_wrap_message(dense_parallel: str, wrapper: str = "DistributedDataParallel") -> str:
    """The error for a wrapper that would make an optimized model data-parallel a second time."""
    return (f"themis_compile: this model was optimized by themis_compile.optimize, which already made it "
            f"data-parallel (each expert on one rank, the other parameters through {dense_parallel}); "
            f"{wrapper} must not make it data-parallel again: each rank holds different experts, which the wrapper "
            f"would take for replicas (DistributedDataParallel overwrites them with rank 0's, fully_shard cuts them "
            f"into shards) and average gradients of different experts. Use the model as optimize returned it: under HF Trainer "
            f"themis_compile.integrations.transformers.ThemisTrainer, under accelerate "
            f"themis_compile.integrations.accelerate.ThemisAccelerator, under Lightning "
            f"ModelParallelStrategy(parallelize_fn=themis_compile.integrations.lightning.parallelize); in a loop "
            f"of your own no wrapper at all, and themis_compile.clip_grad_norm_ for clipping.")


def _fsdp2_reduces_unused_params() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def _fssdp_state(config: ThemisConfig, group, rank: int, world_size: int):
    topology = Topology.from_env(world_size, config.devices_per_node, intra_node_bw=config.intra_node_bw,
                                 inter_node_bw=config.inter_node_bw)
    # The sparse collectives get a group of their own so that their point-to-point traffic never
    # interleaves with the all-to-all of the token exchange.
    comm_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
    # Its first operation involves every rank: on NCCL, batched point-to-point operations may involve a
    # subset of the group's ranks only once the communicator exists (torch's batch_isend_irecv contract).
    deadline.all_reduce(torch.zeros(1, device=collective_device(comm_group)), group=comm_group,
                        timeout_s=deadline.setup_timeout(config.collective_timeout_s),
                        purpose="sparse-collective group set-up")
    return FSSDPState(rank=rank, world_size=world_size, group=group, comm_group=comm_group, topology=topology,
                      rematerialize=config.rematerialize, calibrate=config.calibrate,
                      timeout_s=config.collective_timeout_s, check_plans=config.check_plans,
                      cost_benefit=config.cost_benefit)


def _fssdp_experts(bank, experts, shard, state, index: int, info: MoELayerInfo, config: ThemisConfig):
    if config.policy == "uniform":
        t, m = 0, 0          # an even assignment needs no replica
    else:
        t, m = default_budgets(bank.num_experts, state.world_size, config.overlap_degree,
                               config.materialization_budget)
    # Forward FLOPs of one token through one expert at a nominal 1e10 FLOP/s until a profile exists.
    flops = 2 * sum(torch.Size(shape).numel() for shape, _ in bank.spec)
    cost = PlanCost(time_per_token_s=flops / 1e10, expert_bytes=float(bank.chunk_bytes), topology=state.topology)
    return FSSDPExperts(bank, experts, shard, state=state, layer_index=index, overlap_degree=t,
                        materialization_budget=m, cost=cost, predictor_window=config.predictor_window,
                        layer=info.name, skips_empty_experts=info.skips_empty_experts)


def _make_count_reducer(group, layer: str = "", timeout_s: float = deadline.DEFAULT_TIMEOUT_S):
    group_name = (group if group is not None else dist.group.WORLD).group_name

    def global_tokens_per_expert(counts_E: torch.Tensor) -> torch.Tensor:
        return deadline.all_reduce_counts(counts_E, group=group, group_name=group_name, layer=layer,
                                          timeout_s=timeout_s)

    return global_tokens_per_expert


def _make_uniform_route(route, num_experts: int):
    """The reference gate of the paper's "Uniform": pairs spread round-robin over the experts (top-k
    distinct per token), gate weights and gradients from the user's router. Benchmarking only."""

    def uniform_route(x_TH: torch.Tensor):
        weights_TK, ids_TK, probs_TE = route(x_TH)
        T, K = ids_TK.shape
        return weights_TK, uniform_ids(ids_TK, num_experts), probs_TE

    return uniform_route


def explain(model: nn.Module, verbose: bool = False, *, example_inputs: tuple | dict | None = None) -> str:
    """A report of the MoE layers ``optimize`` would shard (router kind, experts form, top-k, activation,
    shared experts) and of MoE-like modules it rejected, with the reason; ``verbose`` adds the router
    path, score function, auxiliary outputs and how the experts are called. ``example_inputs`` as for
    :func:`optimize`: what a candidate that does not run on hidden states alone is probed with.

    On a model ``optimize`` already prepared: the layers it sharded (policy, experts, the experts this
    rank owns, top-k, experts form) and what it left data-parallel, with the reason for each MoE-like
    module it did not shard.
    """
    runtime = getattr(model, "_themis_runtime", None)
    if runtime is not None:
        return _explain_optimized(runtime, verbose)
    if verbose:
        return explain_moe_layers(model, example_inputs)
    infos, rejected = find_moe_layers(model, example_inputs)
    lines = [f"{len(infos)} MoE layer(s) found"]
    lines += [f"  {info.name}: {describe_layer(info)}{_shared_note(info)}" for info in infos]
    lines += [f"  rejected {name}: {why}" for name, why in rejected]
    return "\n".join(lines)


def _shared_note(info: MoELayerInfo) -> str:
    """What explain adds for a layer whose stacked experts hold parameters every expert uses."""
    shared = shared_parameter_names(info)
    return f"; parameters every expert uses (dense, data-parallel): {', '.join(shared)}" if shared else ""


def _explain_optimized(runtime: ThemisRuntime, verbose: bool) -> str:
    policy = runtime.config.policy
    lines = [f"optimized by themis_compile (policy {policy}, rank {runtime.rank} of {runtime.world_size}): "
             f"{len(runtime.layers)} MoE layer(s) sharded"]
    for name, experts in runtime.layers.items():
        info = runtime.layer_infos.get(name)
        text = f"  {name}: {policy}, {experts.num_experts} experts"
        if info is not None:
            text += f" ({info.experts_form}, '{info.experts_attr}'), top-{info.top_k}"
        if hasattr(experts, "owned_experts"):
            owned = experts.owned_experts()
            text += f"; this rank owns {len(owned)}: {owned}"
        if info is not None and info.zero_experts:
            rows = zero_rows_of(experts)
            E = experts.num_experts
            held = f"rows {E + rows.span[0]}..{E + rows.span[1] - 1}" if rows is not None else "none"
            text += (f"; {info.zero_experts} zero (identity) experts served by the block (their rows of the stacked "
                     f"weights, never read, held split over the ranks; here: {held})")
        shared = getattr(getattr(experts, "bank", None), "shared_names", ())
        if shared:
            text += f"; parameters every expert uses (dense, data-parallel): {', '.join(shared)}"
        lines.append(text)
        if verbose and info is not None:
            lines.append(f"    {describe_layer(info)}")
    if runtime.dense_parallel is None:
        lines.append("not sharded (world size 1, no data parallelism needed): every other parameter")
    else:
        lines.append(f"data-parallel through {runtime.dense_parallel} over {runtime.world_size} ranks: every "
                     f"other parameter")
    if runtime.unsharded:
        lines.append(f"  including the experts of {len(runtime.unsharded)} MoE-like module(s) not sharded:")
        lines += [f"    {name}: {why}" for name, why in runtime.unsharded]
    return "\n".join(lines)
