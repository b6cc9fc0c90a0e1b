"""Training-step benchmark: the same model and data under ep, themis, themis-rm, uniform and plain FSDP2.

    torchrun --nproc-per-node 2 -m themis_compile.bench step [--model tiny-moe|hf-mixtral]
        [--skew paper|extreme|trace[:PATH]|R | --workload NAME | --workloads all|NAME,...] [--trace DIR]
    python -m themis_compile.bench step ...                 # without torchrun: it relaunches itself
    python -m themis_compile.bench step --network emulated [--inter-node-bw B]   # 2 emulated nodes x 2 ranks

``--network emulated`` (no torchrun) runs the same comparison on nodes joined by a shaped boundary, with its
own model and batch defaults (docs/bench_step_network.md; `_main_emulated`).

Every policy trains an identical model (same seed, same batches) for ``--warmup`` + ``--steps`` steps,
the policies interleaved step by step so that a shared, noisy machine loads them alike. ``fsdp2`` is the
peer a user would try first: the unmodified model under plain FSDP2 (``fully_shard`` on every block and
the root, no expert parallelism: every rank gathers every expert); the reference model's MoE blocks
all-reduce their token counts there like the other policies' do, so that all of them train the same
global-batch objective (its aux loss on the global counts).

With ``--model hf-mixtral`` the peers include ``hf-ep``, what an HF user would pick instead: transformers'
own expert parallelism, the same weights loaded with ``from_pretrained(dir, distributed_config=
DistributedConfig(ep_size=D, fsdp_size=D, ep_implementation="all_to_all"))`` (experts split contiguously
over the ranks, all-to-all dispatch, the rest FSDP2), its routers biased like the others'.

``--model`` picks what trains: ``tiny-moe`` (the default) is the reference model
(`themis_compile.models.GPTMoE`, with its load-balancing aux loss); ``hf-mixtral`` is transformers'
``MixtralForCausalLM`` built from a random-init ``MixtralConfig`` of the same sizes (hidden ``--d-model``,
intermediate ``--d-ffn``, ``--experts``, ``--top-k``, ``--layers``, 4 attention and 2 key-value heads,
vocabulary 256), trained on the language-model loss alone (``output_router_logits`` off: no aux loss). Both
are driven through `themis_compile.bench.models`: the reference model's routers have a ``router_bias``
buffer; each HF ``MixtralTopKRouter`` gets one through a forward hook that recomputes its softmax, top-k and
renormalization from the biased logits (transformers is not edited; ``optimize`` detects and shards the
blocks as usual), so that every ``--skew`` below works alike for both.

``--skew`` sets the model's router bias (``router_skew``): ``paper`` calibrates it on the first
global batch so that the Std over experts of the load shares (tokens per expert / all assignments, the
shares summing to 1) is 0.04, the paper's measured range being 0.034-0.046; ``extreme`` is 4.0 (the
hottest expert receives nearly every token); a number is used as it is. ``trace[:PATH]`` replays a
recorded routing trace (the JSONL ``make demo`` writes, default ``runs/demo/trace_ep.jsonl``; format in
``themis_compile.sim.traces``): bench step s reproduces the loads of the trace's s-th step (cyclically),
every MoE block's ``router_bias`` being fitted before its forward so that its top-k assigns this rank's
tokens in the trace's proportions (`themis_compile.bench.replay`); the fitting is the harness's work, the
same for every policy, and is left out of the step times; every policy reports how closely its realized
global loads followed the trace (``trace_replay``: max |share deviation|, correlation). The realized
Std of the timed steps is reported.

``--workload NAME`` replaces ``--skew`` with a named load (`themis_compile.bench.workloads`: balanced,
paper, trace, zipf, hot-expert, hot-rank, drift, shift; ``--seed`` picks the synthetic ones' draw); the
routers are fitted to it step by step as for a trace. ``--workloads all`` (or a list) runs every policy
under each in turn in one launch and reports ``{"workloads": {NAME: {...}}}``, each entry as the single
report below plus ``fraction_of_balanced`` (uniform / themis step time), ``themis_speedup_over`` every
peer, ``fastest_policy`` and ``ideal_is_fastest`` (uniform within 2 % of the fastest; if not,
``ideal_note`` says by how much it lost: then it is no lower bound there).

The JSON reports per policy the median step time, tokens/s, load imbalance (max/mean rows computed per
rank), |ΔP| per layer, the global loss of every step, and per rank the bytes of parameters, gradients,
optimizer state and replica (themis) or unsharded-block (fsdp2) buffers; then the ratios: every policy's
speed-up over ep and over fsdp2, themis / uniform and ep / uniform, and the model-state memory (max rank)
of themis, themis-rm over ep and of themis, themis-rm, ep over fsdp2. ``--trace DIR`` then profiles
``--trace-steps`` more steps of each policy, writes one chrome trace per policy and rank, and adds the mean
milliseconds per step of every ``themis::`` profiler range (and FSDP2's ``FSDP::`` ones; rank 0) as
``phase_ms_per_step``: ranges nest (``themis::spag_start`` holds ``themis::plan``), so they do not add up
to ``bench::step``; ``phases_ms_per_step`` groups them into the phases of a step (plan + SpAG, routing,
dispatch, experts, combine, all-to-all backward, SpRS, re-shard, dense FSDP2, the rest), each range counted
once, where it is outermost, so that those do add up (`runtime.profiling.phase_breakdown`). A table of
the results goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger(__name__)

POLICIES = ("ep", "themis", "themis-rm", "uniform", "fsdp2")
HF_POLICIES = ("hf-ep",)        # --model hf-mixtral only: transformers' own expert parallelism (+ FSDP2)
WORKLOADS = ("balanced", "paper", "trace", "zipf", "hot-expert", "hot-rank", "drift", "shift")   # bench.workloads
NOISE = 0.02        # step-time ratios within 2 % count as equal ("the ideal is the fastest")
MODELS = ("tiny-moe", "hf-mixtral")     # bench.models.MODELS (imported there with torch)
# Named router skews; "paper" is calibrated to this Std of the expert load shares (paper §5.4: 0.034-0.046).
SKEWS = {"extreme": 4.0}
PAPER_LOAD_SHARE_STD = 0.04


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m themis_compile.bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=None,
                   help=f"comma-separated, default {','.join(POLICIES)} (and {','.join(HF_POLICIES)} with --model "
                        f"hf-mixtral)")
    p.add_argument("--model", choices=MODELS, default="tiny-moe",
                   help="tiny-moe: the reference model; hf-mixtral: transformers' MixtralForCausalLM of the same "
                        "sizes (random init, no auxiliary loss)")
    p.add_argument("--nproc", type=int, default=2, help="ranks when launched without torchrun")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=6,
                   help="untimed steps; they include the cost-model profiling (1 + 3 steps)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--skew", default="extreme",
                   help="paper (Std of expert load shares 0.04), extreme (router_skew 4.0), trace[:PATH] "
                        "(replay a recorded routing trace, default runs/demo/trace_ep.jsonl) or a router_skew")
    p.add_argument("--workload", default=None, choices=WORKLOADS,
                   help="a named routing workload (bench/workloads.py) instead of --skew: " + ", ".join(WORKLOADS))
    p.add_argument("--workloads", default=None, metavar="all|NAME,...",
                   help="run every policy under each of these workloads in turn; JSON {'workloads': {NAME: ...}}")
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="after timing, profile each policy and write chrome traces + a per-phase breakdown")
    p.add_argument("--trace-steps", type=int, default=2, help="profiled steps per policy with --trace")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--out", default=None, help="also write the JSON here (rank 0)")
    _add_network_args(p)
    args = p.parse_args(argv)
    _network_defaults(p, args, argv)
    if args.quick:
        args.steps, args.warmup, args.d_model, args.d_ffn, args.batch, args.seq_len = 2, 1, 32, 64, 2, 16
    args.workload_list, args.skipped_workloads = None, {}
    if args.workloads is not None:
        if args.workload is not None:
            p.error("--workload and --workloads exclude each other")
        names = list(WORKLOADS) if args.workloads == "all" else [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = sorted(set(names) - set(WORKLOADS))
        if unknown or not names:
            p.error(f"--workloads: unknown {unknown}; choose from all or {', '.join(WORKLOADS)}")
        from themis_compile.bench.replay import DEFAULT_TRACE

        if "trace" in names and not os.path.isfile(DEFAULT_TRACE):
            if args.workloads != "all":
                p.error(f"--workloads trace: no routing trace at {DEFAULT_TRACE!r} (`make demo` writes it)")
            names.remove("trace")
            args.skipped_workloads["trace"] = f"no routing trace at {DEFAULT_TRACE} (`make demo` writes it)"
        args.workload_list = names
    if args.policies is None:
        args.policies = ",".join(POLICIES + (HF_POLICIES if args.model == "hf-mixtral" else ()))
    if args.model != "hf-mixtral" and set(args.policies.split(",")) & set(HF_POLICIES):
        p.error(f"--policies {','.join(HF_POLICIES)}: transformers' expert parallelism needs --model hf-mixtral")
    _apply_workload(p, args, args.workload)
    return args


def _apply_workload(p: argparse.ArgumentParser | None, args: argparse.Namespace, workload: str | None) -> None:
    """Set the skew options of ``workload`` (None: ``--skew`` as given)."""
    from themis_compile.bench.workloads import SYNTHETIC

    def fail(message: str) -> None:
        if p is None:
            raise SystemExit(message)
        p.error(message)

    args.workload, args.skew_workload = workload, None
    if workload == "paper":
        args.skew = "paper"
    elif workload == "trace":
        args.skew = "trace"
    elif workload in SYNTHETIC:
        args.skew, args.skew_workload = "0", workload
    args.skew_trace = None
    if args.skew == "trace" or args.skew.startswith("trace:"):
        from themis_compile.bench.replay import DEFAULT_TRACE

        args.skew_trace = args.skew.partition(":")[2] or DEFAULT_TRACE
        if not os.path.isfile(args.skew_trace):
            fail(f"--skew {args.skew}: no routing trace at {args.skew_trace!r} (`make demo` writes "
                 f"{DEFAULT_TRACE}; or pass trace:PATH)")
    elif args.skew not in SKEWS and args.skew != "paper":
        try:
            float(args.skew)
        except ValueError:
            fail(f"--skew must be paper, {', '.join(SKEWS)}, trace[:PATH] or a number, got {args.skew!r}")


def _build_model(args: argparse.Namespace, router_skew: float):
    """The ``--model`` benchmark model (`bench.models.BenchModel`), seeded: the same on every rank and for
    every policy."""
    from themis_compile.bench.models import build_bench_model

    return build_bench_model(args.model, d_model=args.d_model, d_ffn=args.d_ffn, num_experts=args.experts,
                             top_k=args.top_k, n_layers=args.layers, seq_len=args.seq_len,
                             router_skew=router_skew, seed=0)


def _batch_generator():
    import torch

    return torch.Generator().manual_seed(1)


def _global_batch(args: argparse.Namespace, world: int, gen):
    import torch

    return torch.randint(0, 256, (args.batch * world, args.seq_len), generator=gen)


def load_share_std(counts_E) -> float:
    """Std over experts of the load shares counts_e / Σ counts (shares summing to 1); 0 for no tokens.
    (the same convention as ``sim.traces.load_skew``)."""
    import torch

    counts_E = torch.as_tensor(counts_E, dtype=torch.float64)
    total = float(counts_E.sum())
    return 0.0 if total <= 0 else float((counts_E / total).std(unbiased=False))


def calibrate_router_skew(args: argparse.Namespace, world: int, target_std: float, rounds: int = 2) -> float:
    """The router_skew at which the first global batch's mean (over MoE layers) load-share Std is
    ``target_std``.

    Pseudo-code:
        s = 1
        repeat ``rounds`` times:
            run the model with router_skew s, keeping each MoE block's input x_TH
            bisect s so that mean_l Std(shares of top-k(gate_l(x_l) + s * b_l)) = target_std
    (b_l is the block's seeded bias direction, ``router_bias`` at s = 1.) A later block's input depends on
    s through the earlier blocks, hence the second round; the realized Std is measured in the run anyway.
    """
    import torch

    bench = _build_model(args, 1.0)
    model = bench.model.eval()
    routers = bench.routers
    unit = [r.router_bias.clone() for r in routers]         # b_l: router_bias at router_skew 1
    tokens = _global_batch(args, world, _batch_generator())
    inputs: dict[int, torch.Tensor] = {}

    def set_skew(s: float) -> None:
        for r, b_E in zip(routers, unit):
            r.router_bias.copy_(s * b_E)

    def realized(s: float) -> float:
        set_skew(s)
        stds = []
        with torch.no_grad():
            for i, r in enumerate(routers):
                ids_TK = r.route(inputs[i].reshape(-1, inputs[i].shape[-1]))
                stds.append(load_share_std(torch.bincount(ids_TK.reshape(-1), minlength=r.num_experts)))
        return statistics.mean(stds)

    skew = 1.0
    for _ in range(rounds):
        set_skew(skew)
        hooks = [r.block.register_forward_pre_hook(lambda mod, a, i=i: inputs.__setitem__(i, a[0].detach()))
                 for i, r in enumerate(routers)]
        with torch.no_grad():
            bench.loss(tokens)
        for h in hooks:
            h.remove()
        if realized(0.0) >= target_std:
            logger.warning("bench step: the unbiased router already has load-share Std %.4f >= %.4f; "
                           "using router_skew 0", realized(0.0), target_std)
            return 0.0
        lo, hi = 0.0, 1.0
        while realized(hi) < target_std and hi < 64.0:
            lo, hi = hi, 2.0 * hi
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if realized(mid) < target_std else (lo, mid)
        skew = 0.5 * (lo + hi)
    return skew


def _resolve_skew(args: argparse.Namespace, world: int) -> float:
    if args.skew == "paper":
        import torch.distributed as dist

        value = [calibrate_router_skew(args, world, PAPER_LOAD_SHARE_STD) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(value, src=0)
        return float(value[0])
    if args.skew_trace is not None:
        return 0.0      # the replay sets every router's bias, step by step
    return float(SKEWS.get(args.skew, args.skew))


def _local_bytes(tensors) -> int:
    """Bytes held by this rank (a DTensor counts its local shard)."""
    return _tensor_bytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None)


def _count_reducer(group=None):
    def global_tokens_per_expert(counts_E):
        import torch.distributed as dist

        counts_E = counts_E.clone()
        dist.all_reduce(counts_E, group=group)
        return counts_E

    return global_tokens_per_expert


def _plain_fsdp2(model, blocks, moe_blocks):
    """The unmodified ``model`` under FSDP2: ``fully_shard`` on every one of ``blocks``, then the root
    (torchtitan's recipe without expert parallelism); ``moe_blocks`` that count their tokens through
    ``global_tokens_per_expert`` (the reference model's) get a count all-reduce, so that the aux loss is the
    global batch's as under the other policies. Returns the model and the bytes FSDP2 holds unsharded at its
    peak (modeled): the root's own parameters (kept through forward and backward) and two blocks (the
    running one and the prefetched next). `make demo` runs its plain-FSDP2 peer through this too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in moe_blocks:
        if hasattr(block, "global_tokens_per_expert"):
            # The same global-batch objective as the other policies: aux loss on the global counts.
            block.global_tokens_per_expert = _count_reducer()
    block_bytes = [_tensor_bytes(b.parameters()) for b in blocks]
    unsharded_peak = _tensor_bytes(model.parameters()) - sum(block_bytes) + 2 * max(block_bytes)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, unsharded_peak


def _hf_expert_parallel(bench, world: int):
    """``bench``'s HF Mixtral as a user of transformers' own expert parallelism loads it:
    ``from_pretrained(dir, distributed_config=DistributedConfig(ep_size=D, fsdp_size=D,
    ep_implementation="all_to_all"))`` of the same weights (written by rank 0 to a temporary directory),
    experts split over the ranks by all-to-all, the rest FSDP2; its routers biased as the others'."""
    import shutil

    import torch
    import torch.distributed as dist
    from transformers import DistributedConfig, MixtralForCausalLM

    from themis_compile.bench.models import BenchModel, BiasedTopKRouter
    from themis_compile.models import lm_loss

    path = [tempfile.mkdtemp(prefix="themis-hf-ep-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        bench.model.save_pretrained(path[0])
    dist.barrier()
    model = MixtralForCausalLM.from_pretrained(path[0], dtype=torch.float32, distributed_config=DistributedConfig(
        ep_size=world, fsdp_size=world, ep_implementation="all_to_all"))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    routers = [BiasedTopKRouter(layer.mlp) for layer in model.model.layers]
    for old, new in zip(bench.routers, routers):
        new.router_bias.copy_(old.router_bias)
    return BenchModel(bench.kind, model, routers, list(model.model.layers),
                      lambda tokens_BS: lm_loss(model(input_ids=tokens_BS).logits, tokens_BS))


def _uniform_counts(tokens: int, top_k: int, num_experts: int, world: int):
    """[E] global tokens per expert under the uniform policy: every rank's ``tokens`` x ``top_k`` pairs
    spread round-robin over the experts (`runtime.ep.uniform_ids`)."""
    import torch

    from themis_compile.runtime.ep import uniform_ids

    ids_TK = uniform_ids(torch.zeros(tokens, top_k, dtype=torch.int64), num_experts)
    return world * torch.bincount(ids_TK.reshape(-1), minlength=num_experts)


def _tensor_bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


class _PolicyRun:
    """One policy's model, optimizer and measurements; steps of all policies are interleaved so that a
    shared, noisy machine loads them alike."""

    def __init__(self, policy: str, args: argparse.Namespace, rank: int, world: int) -> None:
        import torch

        import themis_compile
        from themis_compile.api import runtime_of

        self.policy, self.args, self.rank, self.world = policy, args, rank, world
        self.bench = _build_model(args, args.router_skew)
        self.unsharded_bytes = 0
        if policy == "fsdp2":
            self.model, self.unsharded_bytes = _plain_fsdp2(self.bench.model, self.bench.blocks,
                                                            [r.block for r in self.bench.routers])
            self.runtime = None
        elif policy == "hf-ep":
            self.bench = _hf_expert_parallel(self.bench, world)
            self.model, self.runtime = self.bench.model, None
        else:
            self.model = themis_compile.optimize(self.bench.model, themis_compile.ThemisConfig(
                policy=policy, **getattr(args, "themis_config", {})))
            self.runtime = runtime_of(self.model)
            if len(self.runtime.layers) != len(self.bench.routers):
                raise RuntimeError(f"bench step --model {args.model}: {policy} sharded "
                                   f"{len(self.runtime.layers)} of {len(self.bench.routers)} MoE layers")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.replay = None
        if args.skew_trace is not None:
            from themis_compile.bench.replay import TraceReplay

            self.replay = TraceReplay.load(args.skew_trace, args.experts, args.top_k, rank, world)
            self.replay.install(self.bench.routers)
        elif args.skew_workload is not None:
            from themis_compile.bench.workloads import WorkloadReplay

            self.replay = WorkloadReplay(args.skew_workload, args.experts, args.top_k, rank, world, seed=args.seed,
                                         total_steps=args.warmup + args.steps)
            self.replay.install(self.bench.routers)
        self.replay_shares: list[tuple] = []     # (realized, trace) global shares per timed step and layer
        self.gen = _batch_generator()
        self.losses: list = []
        self.share_std: list[float] = []
        self.times: list[float] = []
        self.imbalance: list[float] = []
        self.delta: list[int] = []
        self.counts: list = []      # [E] global tokens per expert of every MoE layer, the last timed step
        self.replica_bytes = 0

    def step(self, step: int, timed: bool) -> None:
        import torch
        import torch.distributed as dist

        from themis_compile.runtime.profiling import BACKWARD_RANGE, FORWARD_RANGE, OPTIMIZER_RANGE

        args, rank, world = self.args, self.rank, self.world
        tokens = _global_batch(args, world, self.gen)[rank::world]
        fit_s = 0.0
        if self.replay is not None:
            self.replay.set_step(step)
            fit_s = self.replay.fit_seconds
        dist.barrier()
        t0 = time.perf_counter()
        with torch.profiler.record_function("bench::step"):
            with torch.profiler.record_function(FORWARD_RANGE):
                loss = self.bench.loss(tokens)
            with torch.profiler.record_function(BACKWARD_RANGE):
                loss.backward()
            with torch.profiler.record_function(OPTIMIZER_RANGE):
                self.opt.step()
                self.opt.zero_grad()
        dist.barrier()
        if not timed and step >= args.warmup:
            return      # a profiled step (--trace): the measurements are complete
        self.losses.append(loss.detach())
        if timed:
            # The replay's bias fitting is the harness's work (the same for every policy): not timed.
            fit_s = 0.0 if self.replay is None else self.replay.fit_seconds - fit_s
            self.times.append(time.perf_counter() - t0 - fit_s)
            if self.policy == "uniform":
                # uniform replaces the router's choice in the experts' dispatch: its loads are flat by design.
                self.counts = [_uniform_counts(tokens.numel(), r.top_k, r.num_experts, world)
                               for r in self.bench.routers]
            else:
                self.counts = [r.last_global_counts() for r in self.bench.routers]
                self.share_std.append(statistics.mean(load_share_std(c) for c in self.counts))
                if self.replay is not None:
                    for layer, counts_E in enumerate(self.counts):
                        counts_E = counts_E.to(torch.float64)
                        self.replay_shares.append(((counts_E / counts_E.sum()).tolist(),
                                                   self.replay.target_shares(step, layer, local=False).tolist()))
            for s in (self.runtime.stats if self.runtime is not None else ()):
                if s.iteration == step:
                    self.delta.append(s.delta_p)
                    self.imbalance.append(s.imbalance)
                    held = s.held_on(rank)
                    layer = self.runtime.layers[s.layer]
                    self.replica_bytes = max(self.replica_bytes, (held - len(layer.owned_experts())) * layer.bank.chunk_bytes)

    def close(self) -> None:
        """Remove the replay's router hooks (the next workload builds its own models)."""
        if self.replay is not None:
            self.replay.remove()

    def result(self) -> dict:
        import torch

        args, world = self.args, self.world
        imbalance = list(self.imbalance)
        if self.policy == "hf-ep":
            # transformers' EP: rank r holds experts [r·E/D, (r+1)·E/D) and computes every token routed there.
            imbalance = []
            for counts_E in self.counts:
                owner_E = torch.arange(counts_E.numel()) * world // counts_E.numel()
                per_rank = torch.zeros(world, dtype=torch.int64).index_add_(0, owner_E, counts_E)
                imbalance.append(float(per_rank.max()) / max(float(per_rank.float().mean()), 1.0))
        elif self.runtime is None:
            # Plain FSDP2: every rank serves its own batch's T·K pairs with every expert gathered.
            imbalance = [1.0]
        if not imbalance:   # EP / uniform: rows per rank follow the owners
            for layer, counts_E in zip(self.runtime.layers.values(), self.counts):
                per_rank = torch.zeros(world, dtype=torch.int64).index_add_(0, layer.owner_E, counts_E)
                imbalance.append(float(per_rank.max()) / max(float(per_rank.float().mean()), 1.0))
        params = list(self.model.parameters())
        state = [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        replica_bytes = self.replica_bytes
        if self.runtime is not None and self.runtime.fssdp is not None and not self.runtime.config.rematerialize:
            # Themis keeps every layer's replicas alive until that layer's backward: all layers at once.
            replica_bytes *= len(self.runtime.layers)
        med = statistics.median(self.times)
        replay = None
        if self.replay_shares:
            got_N = torch.tensor([g for g, _ in self.replay_shares], dtype=torch.float64).flatten()
            want_N = torch.tensor([w for _, w in self.replay_shares], dtype=torch.float64).flatten()
            replay = {"max_share_deviation": float((got_N - want_N).abs().max()),
                      "share_correlation": float(torch.corrcoef(torch.stack([got_N, want_N]))[0, 1])}
        return {
            "budgets": self.budgets(),
            "trace_replay": replay,
            "step_time_s": med,
            "tokens_per_s": args.batch * world * args.seq_len / med,
            "imbalance_max_over_mean": statistics.mean(imbalance) if imbalance else 1.0,
            "mean_delta_p_per_layer": statistics.mean(self.delta) if self.delta else 0.0,
            "load_share_std": statistics.mean(self.share_std) if self.share_std else None,
            "memory_bytes": {
                "parameters": _local_bytes(params),
                "gradients": _local_bytes(params),     # one gradient per parameter (freed after the step)
                "optimizer_state": _local_bytes(state),
                "replica_buffers_peak": replica_bytes,
                # FSDP2's all-gathered parameters at their peak (modeled, see _plain_fsdp2).
                "unsharded_buffers_peak": self.unsharded_bytes,
            },
        }

    def budgets(self) -> dict[str, list[int]] | None:
        """The overlap degree t and materialization budget m of every FSSDP layer at the end (§4.2: t =
        floor(T_attn·bw/Ψ), bw the node boundary's on several nodes); None for the other policies."""
        layers = [] if self.runtime is None or self.runtime.fssdp is None else list(self.runtime.layers.values())
        if not layers:
            return None
        return {"overlap_degree": [int(layer.overlap_degree) for layer in layers],
                "materialization_budget": [int(layer.materialization_budget) for layer in layers]}

    def profile(self, first_step: int, trace_dir: str) -> tuple[dict[str, float], dict[str, float]]:
        """Profile ``--trace-steps`` more steps; write the chrome trace, return ms per step per range and
        per phase (`runtime.profiling.phase_breakdown`: each range counted once, the phases adding up to
        the step)."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        from themis_compile.bench.overlap import CollectiveClock
        from themis_compile.runtime.profiling import annotate_step, step_breakdown

        n = self.args.trace_steps
        blocks = [r.block for r in self.bench.routers]
        experts = [b.experts for b in blocks if isinstance(getattr(b, "experts", None), torch.nn.Module)]
        handles = annotate_step(self.model, blocks, experts)
        clock = CollectiveClock()
        try:
            clock.enabled = True
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(n):
                    self.step(first_step + i, timed=False)
        finally:
            clock.restore()
            for h in handles:
                h.remove()
        suffix = f"_{self.args.workload}" if getattr(self.args, "workload_list", None) else ""
        prof.export_chrome_trace(os.path.join(trace_dir, f"step_{self.policy}{suffix}_rank{self.rank}.json"))
        torch.distributed.barrier()
        self.overlap = clock.per_step(n)
        # Our ranges, and FSDP2's own per-phase ranges (not their per-module copies "FSDP::x (blocks.0)").
        ranges = {e.key: e.cpu_time_total / 1e3 / n for e in prof.key_averages()
                  if e.key.startswith(("themis::", "bench::"))
                  or (e.key.startswith("FSDP::") and "(" not in e.key and " for " not in e.key)}
        return ranges, step_breakdown(prof.events(), n, "bench::step")


def _worker(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    own_group = not dist.is_initialized()     # --network emulated: the harness made the group
    if own_group:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES) - set(HF_POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {list(POLICIES + HF_POLICIES)}")
    if args.workload_list is None:
        out = _one_workload(args, policies, rank, world)
    else:
        out = {"benchmark": "step", "world_size": world, "config": _config(args), "workloads": {},
               "skipped_workloads": dict(args.skipped_workloads)}
        for name in args.workload_list:
            _apply_workload(None, args, name)
            if rank == 0:
                sys.stderr.write(f"bench step: workload {name} ({args.workload_list.index(name) + 1} of "
                                 f"{len(args.workload_list)})\n")
            result = _one_workload(args, policies, rank, world)
            if rank == 0:
                out["workloads"][name] = {k: v for k, v in result.items() if k not in ("benchmark", "world_size")}
    if own_group:
        dist.destroy_process_group()
    return out if rank == 0 else None


def _config(args: argparse.Namespace) -> dict:
    return dict(vars(args))


def _one_workload(args: argparse.Namespace, policies: list[str], rank: int, world: int) -> dict | None:
    """Every policy on the current workload, interleaved step by step; rank 0 gets the report."""
    import torch
    import torch.distributed as dist

    from themis_compile.runtime.profiling import OTHER_PHASE

    args.router_skew = _resolve_skew(args, world)
    runs = [_PolicyRun(policy, args, rank, world) for policy in policies]
    for step in range(args.warmup + args.steps):
        for run in runs:
            run.step(step, timed=step >= args.warmup)
    results = {run.policy: run.result() for run in runs}
    for run in runs:
        losses = torch.stack(run.losses).to(torch.float64)
        dist.all_reduce(losses)
        results[run.policy]["loss_per_step"] = (losses / world).tolist()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for run in runs:
            ranges, phases = run.profile(args.warmup + args.steps, args.trace)
            results[run.policy]["phase_ms_per_step"] = ranges
            results[run.policy]["phases_ms_per_step"] = phases
            results[run.policy]["rest_fraction"] = phases[OTHER_PHASE] / max(sum(phases.values()), 1e-12)
            # SpAG / SpRS beside the step: how long they were in flight (ms per step) and how much of that
            # the training thread waited (the "exposed (wait)" phases), the rest hidden behind compute.
            results[run.policy]["collectives_ms_per_step"] = run.overlap
    for run in runs:
        run.close()
    results = {"policies": results, "peak_rss_bytes": _peak_rss_bytes()}
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, results)
    if rank != 0:
        return None
    out = {"benchmark": "step", "world_size": world, "config": _config(args), "workload": args.workload,
           "router_skew": args.router_skew, "policies": {},
           # One process runs every policy: its peak RSS bounds all of them together, not one policy.
           "process_peak_rss_bytes_per_rank": [pr["peak_rss_bytes"] for pr in per_rank]}
    per_rank = [pr["policies"] for pr in per_rank]
    for policy in results["policies"]:
        r0 = per_rank[0][policy]
        mem = [pr[policy]["memory_bytes"] for pr in per_rank]
        out["policies"][policy] = {
            "step_time_s": max(pr[policy]["step_time_s"] for pr in per_rank),
            "tokens_per_s": r0["tokens_per_s"],
            "imbalance_max_over_mean": r0["imbalance_max_over_mean"],
            "mean_delta_p_per_layer": r0["mean_delta_p_per_layer"],
            "load_share_std": r0["load_share_std"],
            "trace_replay": r0["trace_replay"],
            "budgets": r0["budgets"],
            "loss_per_step": r0["loss_per_step"],
            "memory_bytes_per_rank": mem,
            "model_state_bytes_max_rank": max(m["parameters"] + m["gradients"] + m["optimizer_state"]
                                              + m["replica_buffers_peak"] + m["unsharded_buffers_peak"]
                                              for m in mem),
            "replica_bytes_max_rank": max(m["replica_buffers_peak"] for m in mem),
        }
        for key in ("phase_ms_per_step", "phases_ms_per_step", "rest_fraction", "collectives_ms_per_step"):
            if key in r0:
                out["policies"][policy][key] = r0[key]
    pol = out["policies"]
    stds = [v["load_share_std"] for v in pol.values() if v["load_share_std"] is not None]
    out["load_share_std"] = statistics.mean(stds) if stds else None
    out["ratios"] = {}
    if "fsdp2" in pol:
        out["ratios"].update({f"{p}_speedup_over_fsdp2": pol["fsdp2"]["step_time_s"] / v["step_time_s"]
                              for p, v in pol.items() if p != "fsdp2"})
        for p in ("themis", "themis-rm", "ep"):
            if p in pol:
                out["ratios"][f"{p}_memory_over_fsdp2"] = (pol[p]["model_state_bytes_max_rank"]
                                                           / pol["fsdp2"]["model_state_bytes_max_rank"])
    if "ep" in pol:
        ep = pol["ep"]
        out["ratios"].update({
            f"{p}_speedup_over_ep": ep["step_time_s"] / v["step_time_s"] for p, v in pol.items() if p != "ep"})
        if "uniform" in pol:
            out["ratios"]["ep_over_uniform"] = ep["step_time_s"] / pol["uniform"]["step_time_s"]
        for p in ("themis", "themis-rm"):
            if p in pol:
                out["ratios"][f"{p}_memory_over_ep"] = (pol[p]["model_state_bytes_max_rank"]
                                                        / ep["model_state_bytes_max_rank"])
    if "uniform" in pol:
        for p in ("themis", "themis-rm"):
            if p in pol:
                out["ratios"][f"{p}_over_uniform"] = pol[p]["step_time_s"] / pol["uniform"]["step_time_s"]
    out.update(_against_the_ideal(pol))
    if args.trace and any(v.get("phases_ms_per_step") for v in pol.values()):
        name = f"breakdown_{args.workload}.png" if args.workload_list else "breakdown.png"
        out["breakdown_plot"] = plot_breakdown(pol, os.path.join(args.trace, name),
                                               f"Where a step goes: workload {args.workload or args.skew}")
    return out


def plot_breakdown(pol: dict, path: str, title: str) -> str | None:
    """A horizontal stacked bar per policy of its ``phases_ms_per_step`` (`runtime.profiling.step_phases`
    order, one colour per phase, the rest grey), SpAG / SpRS hidden behind compute noted per policy;
    written to ``path`` (PNG). None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import numpy as np

    from themis_compile.runtime.profiling import OTHER_PHASE, step_phases

    profiled = {p: v["phases_ms_per_step"] for p, v in pol.items() if v.get("phases_ms_per_step")}
    order = step_phases()
    phases = [name for name in order if any(name in b for b in profiled.values())]
    labels = []
    for p, v in pol.items():
        if p not in profiled:
            continue
        hidden = {k: c["hidden"] for k, c in (v.get("collectives_ms_per_step") or {}).items() if c["count"]}
        note = ", ".join(f"{k} hidden {ms:.1f} ms" for k, ms in hidden.items())
        labels.append(f"{p} (rest {v['rest_fraction']:.0%}" + (f"; {note})" if note else ")"))
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.6 * len(profiled)))
    cmap = plt.get_cmap("tab20")
    left = np.zeros(len(profiled))
    for phase in phases:
        ms = np.array([b.get(phase, 0.0) for b in profiled.values()])
        color = "lightgray" if phase == OTHER_PHASE else cmap(order.index(phase) % 20)
        ax.barh(labels, ms, left=left, label=phase, color=color)
        left += ms
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (rank 0, profiled steps)", title=title)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _against_the_ideal(pol: dict) -> dict:
    """``fraction_of_balanced`` (uniform / themis step time: 1.0 is the force-balanced ideal), themis'
    speed-up over each peer, the fastest policy, and whether the ideal is the fastest within NOISE (if
    not, which policy beat it and by how much: the ideal is then no lower bound on this workload)."""
    out: dict = {}
    times = {p: v["step_time_s"] for p, v in pol.items()}
    if not times:
        return out
    fastest = min(times, key=times.get)
    out["fastest_policy"] = fastest
    if "themis" in times:
        out["themis_speedup_over"] = {p: t / times["themis"] for p, t in times.items() if p != "themis"}
        if "uniform" in times:
            out["fraction_of_balanced"] = times["uniform"] / times["themis"]
    if "uniform" in times:
        ideal = times["uniform"] <= times[fastest] * (1 + NOISE)
        out["ideal_is_fastest"] = ideal
        if not ideal:
            out["ideal_note"] = (f"uniform ({times['uniform']:.4f} s) is slower than {fastest} "
                                 f"({times[fastest]:.4f} s) by {times['uniform'] / times[fastest] - 1:.1%}: not a lower "
                                 f"bound on this workload")
    return out


def _peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024     # Linux: KiB


def _replay_lines(out: dict) -> list[str]:
    """With --skew trace: how closely each policy's realized global loads followed the replayed trace."""
    path = out["config"].get("skew_trace")
    if path is None:
        return []
    cells = [f"{p} max |Δshare| {v['trace_replay']['max_share_deviation']:.4f}, "
             f"corr {v['trace_replay']['share_correlation']:.4f}"
             for p, v in out["policies"].items() if v.get("trace_replay")]
    return [f"replayed trace {path}: " + "; ".join(cells), ""]


def format_table(out: dict) -> str:
    """The results as Markdown: one table per workload with ``--workloads``."""
    if "workloads" not in out:
        return _format_one(out)
    parts = []
    for name, result in out["workloads"].items():
        summary = [f"fraction_of_balanced {result['fraction_of_balanced']:.3f}"] if "fraction_of_balanced" in result \
            else []
        summary.append(f"fastest {result.get('fastest_policy')}")
        if "ideal_note" in result:
            summary.append(result["ideal_note"])
        parts.append(f"### workload {name}: " + "; ".join(summary) + "\n\n" + _format_one(result))
    for name, why in out.get("skipped_workloads", {}).items():
        parts.append(f"### workload {name}: skipped ({why})")
    return "\n\n".join(parts)


def _format_one(out: dict) -> str:
    """The results as a Markdown table (policies, then ratios and, with --trace, the phase breakdown)."""
    pol = out["policies"]
    std = out["load_share_std"]
    lines = [f"model {out['config'].get('model', 'tiny-moe')}, "
             f"router_skew {out['router_skew']:.3f} (--skew {out['config']['skew']}), load-share Std "
             + ("n/a" if std is None else f"{std:.4f}"), "",
             *_replay_lines(out),
             "| policy | step s | tokens/s | imbalance | ΔP/layer | model state MiB (max rank) | loss step 0 |",
             "|---|---|---|---|---|---|---|"]
    for p, v in pol.items():
        lines.append(f"| {p} | {v['step_time_s']:.3f} | {v['tokens_per_s']:.0f} | "
                     f"{v['imbalance_max_over_mean']:.2f} | {v['mean_delta_p_per_layer']:.1f} | "
                     f"{v['model_state_bytes_max_rank'] / 2**20:.1f} | {v['loss_per_step'][0]:.6f} |")
    if out["ratios"]:
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in out["ratios"].items()]
    breakdowns = {p: v["phases_ms_per_step"] for p, v in pol.items() if v.get("phases_ms_per_step")}
    if breakdowns:
        from themis_compile.runtime.profiling import step_phases

        names = list(breakdowns)
        lines += ["", "| phase (ms/step, rank 0) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for phase in step_phases() + ["step"]:
            cells = [sum(b.values()) if phase == "step" else b.get(phase) for b in breakdowns.values()]
            if any(c is not None for c in cells):
                lines.append(f"| {phase} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
        lines.append("| rest / step | " + " | ".join(f"{pol[p]['rest_fraction']:.1%}" for p in names) + " |")
        for kind in ("SpAG", "SpRS"):
            cells = [pol[p].get("collectives_ms_per_step", {}).get(kind) for p in names]
            if any(c and c["count"] for c in cells):
                shown = ["" if not c or not c["count"] else f"{c['in_flight']:.1f} / {c['hidden']:.1f}" for c in cells]
                lines.append(f"| {kind} in flight / hidden | " + " | ".join(shown) + " |")
    phases = sorted({k for v in pol.values() for k in v.get("phase_ms_per_step", {})})
    if phases:
        names = list(pol)
        lines += ["", "| range (ms/step, rank 0) | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for k in phases:
            cells = [pol[p].get("phase_ms_per_step", {}).get(k) for p in names]
            lines.append(f"| {k} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


# ==================================================================== across a node boundary (--network emulated)
# The node boundary of --network emulated, bytes/s each way per node: the token exchange then takes over a
# third of a balanced (uniform) step here, as the all-to-all leads EP's step in the paper (Fig. 11), and a
# replica still crosses within an attention window (t >= 1); docs/bench_step_network.md.
EMULATED_INTER_NODE_BW = 25e6
# The model and batch of --network emulated, where not given: 2 nodes x 2 ranks x 8 sequences is the
# loopback default's global batch (2 ranks x 16); d_ffn / d_model = 0.5 (the paper's models: 0.29-4) puts
# token rows, expert bytes and attention windows in proportions like the paper's (docs/bench_step_network.md).
EMULATED_DEFAULTS = {"batch": 8, "d_model": 256, "d_ffn": 128}
# The process group's collective deadline of the emulated ranks (the whole run gets 60 s more).
_EMULATED_TIMEOUT_S = 1800.0


def _add_network_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network")
    g.add_argument("--network", choices=("loopback", "emulated"), default="loopback",
                   help="loopback: the ranks of one machine (torchrun, --nproc); emulated: --nodes x "
                        "--devices-per-node ranks in Linux network namespaces whose node boundary is shaped to "
                        "--inter-node-bw (needs root; changes this host's network while it runs; without the "
                        "privileges it prints why and exits 0)")
    g.add_argument("--inter-node-bw", type=float, default=EMULATED_INTER_NODE_BW,
                   help=f"--network emulated: bytes/s of every node boundary, each way "
                        f"(default {EMULATED_INTER_NODE_BW / 1e6:g} MB/s)")
    g.add_argument("--nodes", type=int, default=2, help="--network emulated: nodes (>= 2)")
    g.add_argument("--devices-per-node", type=int, default=2, help="--network emulated: ranks per node")


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _network_defaults(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> None:
    """Check the network options; under --network emulated the world is --nodes x --devices-per-node and
    `EMULATED_DEFAULTS` replace the loopback defaults of the options not given (not with --quick)."""
    if args.network != "emulated":
        return
    if args.nodes < 2 or args.devices_per_node < 1:
        p.error(f"--network emulated needs --nodes >= 2 and --devices-per-node >= 1 (a node boundary), got "
                f"{args.nodes} and {args.devices_per_node}")
    if not args.inter_node_bw > 0:
        p.error(f"--inter-node-bw must be > 0 bytes/s, got {args.inter_node_bw}")
    argv = sys.argv[1:] if argv is None else argv
    for name, value in ({} if args.quick else EMULATED_DEFAULTS).items():
        if not _given(argv, "--" + name.replace("_", "-")):
            setattr(args, name, value)
    args.nproc = args.nodes * args.devices_per_node


def _emulated_rank(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """One rank of ``--network emulated`` (inside its node's namespace, group made by the harness).

    Pseudo-code:
        bw = ping-pong bandwidth of one intra-node pair and one pair across the boundary (every rank the same)
        the planner's topology takes bw (what a user states for the cluster, ThemisConfig.*_node_bw)
        run every policy as on loopback (_worker); rank 0 adds the network settings to the JSON
    """
    from themis_compile.planner.topology import Topology
    from themis_compile.runtime.profiling import measure_bandwidth

    topology = Topology.from_env(world)
    bw = measure_bandwidth(topology=topology, nbytes=4 << 20, iters=3)
    args.themis_config = {"intra_node_bw": bw["intra"], "inter_node_bw": bw["inter"]}
    out = _worker(args)
    if out is not None:
        out["network"] = _network_settings(args, measured=bw)
    return out


def _network_settings(args: argparse.Namespace, measured: dict[str, float] | None = None) -> dict:
    settings = {"mode": "emulated", "nodes": args.nodes, "devices_per_node": args.devices_per_node,
                "inter_node_bw": args.inter_node_bw, "measured_intra_pair_bw": None,
                "measured_inter_pair_bw": None, "intra_over_inter": None}
    if measured:
        settings.update(measured_intra_pair_bw=measured["intra"], measured_inter_pair_bw=measured["inter"],
                        intra_over_inter=measured["intra"] / measured["inter"])
    return settings


def format_network(out: dict) -> str:
    """One line on the emulated network of a ``--network emulated`` result."""
    net = out["network"]
    line = (f"network: emulated, {net['nodes']} nodes x {net['devices_per_node']} ranks, node boundary "
            f"{net['inter_node_bw'] / 1e6:g} MB/s each way")
    if out.get("unavailable"):
        return line + f": not run: {out['unavailable']}"
    return line + (f" (measured pairs: intra-node {net['measured_intra_pair_bw'] / 1e6:.0f} MB/s, across the "
                   f"boundary {net['measured_inter_pair_bw'] / 1e6:.1f} MB/s, ratio {net['intra_over_inter']:.1f})")


def _main_emulated(args: argparse.Namespace) -> dict:
    """``bench step --network emulated``: every policy side by side on emulated nodes.

    Contract:
        - the ranks are this process's own (`run_multirank`), ``args.nproc`` = nodes x devices per node,
          each node's ranks in a network namespace (`EmulatedNodes`) whose boundary carries
          ``--inter-node-bw`` bytes/s each way; inside a node they talk over its own loopback;
        - the JSON is the loopback one (same keys, same table) plus ``network`` (the settings and the
          measured pair bandwidths); the cost-model profile is measured on this network (a fresh cache);
        - where namespaces cannot be built here (`EmulatedNodes.unavailable_reason`), nothing runs: the
          JSON has ``unavailable`` (the reason), empty ``policies``/``ratios``, and this returns normally
          (exit code 0); a failure after building started raises.
    """
    from themis_compile.testing import run_multirank
    from themis_compile.testing.netns import EmulatedNodes

    if "RANK" in os.environ:
        raise SystemExit("bench step --network emulated launches its own ranks inside network namespaces: "
                         "run it without torchrun")
    reason = EmulatedNodes.unavailable_reason()
    if reason is not None:
        out = {"benchmark": "step", "world_size": args.nproc, "config": dict(vars(args)),
               "network": _network_settings(args), "unavailable": reason, "policies": {}, "ratios": {}}
        sys.stderr.write(format_network(out) + "\n")
    else:
        with tempfile.TemporaryDirectory(prefix="themis-step-") as cache, \
                EmulatedNodes(args.nodes, args.inter_node_bw) as net:
            out = run_multirank(_emulated_rank, args.nproc, args=(args,), devices_per_node=args.devices_per_node,
                                network=net, timeout_s=_EMULATED_TIMEOUT_S, env={"THEMIS_CACHE_DIR": cache})[0]
        sys.stderr.write(format_network(out) + "\n\n" + format_table(out) + "\n")
    text = json.dumps(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return out


def main(argv: list[str] | None = None) -> dict | None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.network == "emulated":
        return _main_emulated(args)
    if "RANK" not in os.environ:
        # Not under torchrun: launch ourselves with it and relay rank 0's JSON.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "themis_compile.bench", "step", *(sys.argv[1:] if argv is None else argv)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark ranks failed:\n{proc.stderr[-4000:]}")
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
        out = json.loads(line)
        sys.stderr.write(format_table(out) + "\n")
        print(line)
        return out
    out = _worker(args)
    if out is not None:
        text = json.dumps(out)
        sys.stderr.write(format_table(out) + "\n")
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return out


if __name__ == "__main__":
    main()
