"""`make demo`: train a tiny GPT-MoE on the Python standard library's own sources, policies side by side.

A program built on the library, outside its package and its import graph (nothing in ``themis_compile``
imports it); run from the repository root:

    python -m demo [--steps 100] [--policies ep,fsdp2,themis] [--out runs/demo] [--nproc 2] [--profile-steps 3]
                                  [--seq-len 128] [--batch 16] [--d-ffn 1024] [--router-skew 2.0]

What happens:

1. A byte-level corpus (vocab 256) is built from the ``.py`` files of the running interpreter's standard
   library (``themis_compile.models.data.build_corpus``: sorted paths, ``site-packages`` and test suites
   left out) and saved as ``corpus.bin`` under the output folder. It exists offline on every machine.
2. ``torchrun --standalone --nproc-per-node N`` (``python -m torch.distributed.run``) starts N gloo ranks
   on CPU, one thread each, running this module with ``--worker``. Every policy in ``--policies`` trains
   the same model from the same seed on the same global batches for ``--steps`` AdamW steps, the
   policies' steps interleaved (step i of every policy before step i + 1 of any), then
   ``--profile-steps`` more under ``torch.profiler`` for the per-phase breakdown (not timed). Rank 0
   shows a progress bar (loss, tokens/s, per-layer load imbalance) and writes, per policy, a routing
   trace ``trace_<policy>.jsonl`` and the per-step metrics ``metrics_<policy>.json``.
3. The launcher reads those files back and writes ``summary.json``, the PNG plots (``loss.png``,
   ``imbalance.png``, ``delta_p.png``, ``breakdown.png``) and prints a short text summary.

Routing trace format (the simulator reads it, ``themis_compile.sim.traces``): a header line
``{"header": {"num_experts": E, "top_k": k, "world_size": D, "model": name, "policy": p}}``, then one
line per step and MoE layer ``{"step", "layer", "tokens_per_expert": [E ints], "tokens_per_device_expert":
[[E ints] x D]}`` where row d counts the (token, k) pairs that originate on rank d, plus ``"delta_p"``
(the number of replicas |ΔP| of the realized placement, §3.1) when the runtime reports one.

Two imbalance figures are reported per MoE layer, both as max/mean:
- *expert imbalance*: over experts, of the global tokens per expert (the router's skew; the same for
  every policy, since routing is the model's own);
- *device imbalance*: over ranks, of the tokens each rank's experts process (what a policy changes:
  EP sends all of an expert's tokens to its owner; Themis spreads hot experts over replicas).

Shape suffixes: B batch, S sequence, E experts, D devices (ranks), L MoE layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from themis_compile.models.data import build_corpus, sample_batch, stdlib_sources
from themis_compile.runtime.profiling import (BACKWARD_RANGE, FORWARD_RANGE, OPTIMIZER_RANGE, OTHER_PHASE,
                                              step_phases)

logger = logging.getLogger(__name__)

__all__ = ["build_corpus", "format_summary", "imbalance", "launch", "main", "max_relative_difference",
           "sample_batch", "stdlib_sources", "summarize", "worker_main"]

DEFAULT_OUT = "runs/demo"
DEFAULT_POLICIES = ("ep", "fsdp2", "themis")
# Peers that are not ThemisConfig policies: the unmodified model under plain FSDP2 (every rank gathers
# every expert; `themis_compile.bench.step` runs the same peer).
PEERS = ("fsdp2",)
# Loss curves of two policies "coincide" when every step's loss agrees to this relative tolerance. The
# equivalence tests hold policies to 1e-5 over 20 steps; fp32 reduction-order differences grow slowly over
# the demo's longer run, so the demo allows a little more.
LOSS_COINCIDE_RTOL = 1e-4
# Policies that train exactly the model's own numerics (the paper's claim for Themis, §3).
EXACT_POLICIES = ("ep", "fsdp2", "themis", "themis-rm")
# ------------------------------------------------------------------------------------------- statistics
def imbalance(load: Sequence[float] | np.ndarray) -> float:
    """max / mean of a load vector (1.0 is perfect balance; 0 load counts as balanced)."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean() if load.size else 0.0
    return float(load.max() / mean) if mean > 0 else 1.0


def max_relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """max_i |a_i - b_i| / |b_i| over the common prefix of two loss curves."""
    n = min(len(a), len(b))
    if n == 0:
        return float("nan")
    a_N, b_N = np.asarray(a[:n], dtype=np.float64), np.asarray(b[:n], dtype=np.float64)
    return float(np.max(np.abs(a_N - b_N) / np.maximum(np.abs(b_N), 1e-12)))


@dataclass(frozen=True)
class LayerStep:
    """What one MoE layer did in one step, as every rank agrees on it."""

    tokens_per_expert: list[int]                 # E, global
    tokens_per_device_expert: list[list[int]]    # D x E, by originating rank
    tokens_per_device: list[int]                 # D, processed by each rank's experts (and replicas)
    delta_p: int | None                          # |ΔP| of the realized placement, if reported

    def to_trace(self, step: int, layer: int) -> dict[str, Any]:
        line = {"step": step, "layer": layer, "tokens_per_expert": self.tokens_per_expert,
                "tokens_per_device_expert": self.tokens_per_device_expert}
        if self.delta_p is not None:
            line["delta_p"] = self.delta_p
        return line


def runtime_stats_of_step(runtime: Any, step: int) -> dict[str, Any]:
    """The FSSDP runtime's load statistics of iteration ``step``, by layer name.

    ``runtime.stats`` (``themis_compile.api.ThemisRuntime``) lists one ``LayerStats`` per layer and
    iteration (global tokens per expert and per originating device, rows computed per device under the
    realized plan, |ΔP|, the realized placement P'); it is empty for static policies.
    """
    found: dict[str, Any] = {}
    for stats in reversed(list(getattr(runtime, "stats", None) or [])):
        if stats.iteration < step:
            break
        if stats.iteration == step:
            found.setdefault(stats.layer, stats)
    return found


def _tokens_per_device_ep(tokens_per_expert: Sequence[int], owners_E: Sequence[int], world: int) -> list[int]:
    # EP: every token of expert e is processed by its owner.
    load_D = np.zeros(world, dtype=np.int64)
    np.add.at(load_D, np.asarray(owners_E, dtype=np.int64), np.asarray(tokens_per_expert, dtype=np.int64))
    return load_D.tolist()


# ------------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m demo",
        description="Train a tiny GPT-MoE on the Python stdlib sources on N CPU ranks, policies side by side.",
    )
    p.add_argument("--steps", type=int, default=100, help="AdamW steps per policy (default 100)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps per policy after the timed ones, run under torch.profiler for the per-phase "
                        "breakdown (not in the timings or loss curves; default 3, 0: none)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated ThemisConfig policies or fsdp2 (plain FSDP2), trained side by side, "
                        f"their steps interleaved (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node, default 2)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step (default 16)")
    p.add_argument("--model", default="tiny-moe", help="model preset (default tiny-moe)")
    p.add_argument("--d-ffn", type=int, default=1024,
                   help="expert hidden size: large enough that expert compute, which the policies balance, "
                        "dominates a step (default 1024)")
    p.add_argument("--router-skew", type=float, default=2.0,
                   help="router bias towards a seeded expert order, p_e ~ (rank+1)^-skew (default 2.0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--corpus-bytes", type=int, default=4 << 20, help="corpus size cap (default 4 MiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before a hanging collective (or the whole torchrun) fails (default 120)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _policies(text: str) -> list[str]:
    from themis_compile.config import ThemisConfig

    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policies names no policy")
    if len(set(policies)) != len(policies):
        raise ValueError(f"--policies names a policy twice: {text!r}")
    for p in policies:
        if p not in PEERS:
            ThemisConfig(policy=p)   # raises ValueError naming the valid policies
    return policies


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "nproc", "seq_len", "batch", "corpus_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile_steps < 0:
        raise ValueError(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.seq_len < 2:
        raise ValueError("--seq-len must be >= 2 (next-byte prediction needs two tokens)")
    if args.timeout <= 0:
        raise ValueError("--timeout must be > 0")


# ----------------------------------------------------------------------------------------------- worker
def _local_counts_recorder(block: Any) -> dict[str, Any]:
    """Record the (token, k) pairs per expert that this rank's router produced in the last forward.

    Wraps the block's ``tokens_per_expert`` (the model's own counting) on the instance; the runtime's
    hooks (``global_tokens_per_expert``) are left as they are.
    """
    record: dict[str, Any] = {"counts_E": None}
    original = block.tokens_per_expert

    def tokens_per_expert(ids_TK):
        counts_E = original(ids_TK)
        record["counts_E"] = counts_E.detach()
        return counts_E

    block.tokens_per_expert = tokens_per_expert
    return record


STEP_RANGE = "demo::step"


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: the profiler's C++ side prints a line at every start and stop."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _Skip(Exception):
    """This policy cannot run on the current runtime; the message says why."""


def _train_policy(policy: str, args: argparse.Namespace, corpus: np.ndarray, rank: int, world: int,
                  out: Path, position: int = 0):
    """A generator training ``policy``: it yields once when the model is built (raising `_Skip` instead
    when the policy cannot run), then after every step; its return value is the policy's metrics. The
    worker advances every policy's generator in turn, so that the policies' steps interleave."""
    import torch
    import torch.distributed as dist

    import themis_compile
    from themis_compile.api import runtime_of
    from themis_compile.models import build_model, lm_loss
    from themis_compile.runtime.ep import ShardedExperts
    from themis_compile.runtime.profiling import annotate_step, step_breakdown

    torch.manual_seed(args.seed)
    model = build_model(args.model, router_skew=args.router_skew,
                        seq_len=args.seq_len, d_ffn=args.d_ffn)
    cfg = model.config
    if cfg.vocab_size < 256:
        raise ValueError(f"model {args.model!r} has vocab {cfg.vocab_size}; the byte corpus needs 256")
    if policy == "fsdp2":
        from themis_compile.bench.step import _plain_fsdp2

        model, _ = _plain_fsdp2(model, model.blocks, model.moe_layers())
        runtime = None
        names = [f"moe{i}" for i in range(len(model.moe_layers()))]
    else:
        # full_stats: the demo plots every rank's tokens per expert (LayerStats.tokens_per_device_expert).
        config = themis_compile.ThemisConfig(policy=policy, collective_timeout_s=args.timeout, full_stats=True)
        try:
            model = themis_compile.optimize(model, config)
        except NotImplementedError as exc:
            raise _Skip(f"optimize does not implement policy {policy!r} yet: {exc}") from exc
        runtime = runtime_of(model)
        names = list(runtime.layers)
    if (policy in ("themis", "themis-rm") and world > 1
            and all(type(runtime.layers[n]) is ShardedExperts for n in names)):
        raise _Skip(f"the runtime built static EP experts for policy {policy!r}: the FSSDP runtime is not "
                    "available yet")
    blocks = model.moe_layers()
    recorders = [_local_counts_recorder(b) for b in blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if runtime is not None and hasattr(runtime, "attach_optimizer"):
        runtime.attach_optimizer(opt)

    E, L, B, S = cfg.num_experts, len(blocks), args.batch, args.seq_len
    trace_path = out / f"trace_{policy}.jsonl"
    trace = open(trace_path, "w") if rank == 0 else None
    if trace is not None:
        trace.write(json.dumps({"header": {"num_experts": E, "top_k": cfg.top_k, "world_size": world,
                                           "model": cfg.name, "policy": policy, "seq_len": S,
                                           "batch_per_rank": B}}) + "\n")
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc=f"{policy:>9}", unit="step", dynamic_ncols=True, file=sys.stderr,
                   position=position)
    metrics: dict[str, list] = {"loss": [], "lm_loss": [], "step_time_s": [], "expert_imbalance": [],
                                "device_imbalance": [], "delta_p": []}
    phases: list[dict[str, float]] = []
    tokens_per_step = B * S * world
    yield
    try:
        for step in range(args.steps + args.profile_steps):
            if world > 1:
                dist.barrier()    # the previous policy's step has ended on every rank
            tokens_BS = torch.from_numpy(sample_batch(corpus, step, B * world, S, args.seed)[rank * B:(rank + 1) * B])
            prof = None
            if step >= args.steps:
                # The breakdown's steps: after the timed ones, under the profiler (which slows them).
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                marks = annotate_step(model, blocks, [b.experts for b in blocks])
                with _quiet_stderr():
                    prof.start()
            t0 = time.perf_counter()
            with torch.profiler.record_function(STEP_RANGE):
                with torch.profiler.record_function(FORWARD_RANGE):
                    logits = model(tokens_BS)
                    lm = lm_loss(logits, tokens_BS)
                    loss = lm + model.aux_loss()
                with torch.profiler.record_function(BACKWARD_RANGE):
                    loss.backward()
                with torch.profiler.record_function(OPTIMIZER_RANGE):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if prof is not None:
                with _quiet_stderr():
                    prof.stop()
                for handle in marks:
                    handle.remove()
                phases.append(step_breakdown(prof.events(), 1, STEP_RANGE))
                yield
                continue
            # One all-gather carries both losses and this rank's per-layer routing counts.
            local_LE = torch.stack([r["counts_E"] if r["counts_E"] is not None else torch.zeros(E, dtype=torch.int64)
                                    for r in recorders]).to(torch.float64)
            packed = torch.cat([torch.stack([loss.detach(), lm.detach()]).to(torch.float64), local_LE.reshape(-1)])
            gathered_D = [torch.empty_like(packed) for _ in range(world)] if world > 1 else [packed]
            if world > 1:
                dist.all_gather(gathered_D, packed)
            step_time = time.perf_counter() - t0   # the gather ends the step on every rank: a global time
            all_D = torch.stack(gathered_D)
            losses_D2 = all_D[:, :2]
            per_device_DLE = all_D[:, 2:].round().to(torch.int64).view(world, L, E)
            layer_steps = []
            reported = runtime_stats_of_step(runtime, step) if runtime is not None else {}
            for li, name in enumerate(names):
                stats = reported.get(name)
                if runtime is None:
                    # Plain FSDP2: every rank computes its own tokens with every expert gathered.
                    tpe, tpde = per_device_DLE[:, li].sum(0).tolist(), per_device_DLE[:, li].tolist()
                    tpd, delta = per_device_DLE[:, li].sum(1).tolist(), None
                elif stats is not None:
                    # LayerStats holds numpy arrays (summaries); the trace and the metrics are JSON.
                    tpe, tpde = stats.tokens_per_expert.tolist(), [list(map(int, r)) for r in stats.tokens_per_device_expert]
                    tpd, delta = stats.device_load.tolist(), int(stats.delta_p)
                else:
                    tpe, tpde = per_device_DLE[:, li].sum(0).tolist(), per_device_DLE[:, li].tolist()
                    # No report: the layer computes where its shard placement says, and a static
                    # placement materializes nothing (P' = P, |ΔP| = 0).
                    tpd = _tokens_per_device_ep(tpe, runtime.layers[name].owner_E.tolist(), world)
                    delta = 0 if type(runtime.layers[name]) is ShardedExperts else None
                layer_steps.append(LayerStep(tpe, tpde, tpd, delta))
            mean_loss = float(losses_D2[:, 0].mean())
            metrics["loss"].append(mean_loss)
            metrics["lm_loss"].append(float(losses_D2[:, 1].mean()))
            metrics["step_time_s"].append(step_time)
            metrics["expert_imbalance"].append([imbalance(ls.tokens_per_expert) for ls in layer_steps])
            metrics["device_imbalance"].append([imbalance(ls.tokens_per_device) for ls in layer_steps])
            deltas = [ls.delta_p for ls in layer_steps]
            metrics["delta_p"].append(None if all(d is None for d in deltas) else sum(d or 0 for d in deltas))
            if trace is not None:
                for li, ls in enumerate(layer_steps):
                    trace.write(json.dumps(ls.to_trace(step, li)) + "\n")
            if bar is not None:
                postfix = {"loss": f"{mean_loss:.3f}", "tok/s": f"{tokens_per_step / step_time:,.0f}",
                           "imb": "/".join(f"{x:.2f}" for x in metrics["expert_imbalance"][-1]),
                           "dev-imb": "/".join(f"{x:.2f}" for x in metrics["device_imbalance"][-1])}
                if metrics["delta_p"][-1] is not None:
                    postfix["|dP|"] = metrics["delta_p"][-1]
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
            yield
    finally:
        if bar is not None:
            bar.close()
        if trace is not None:
            trace.close()
    # Rank 0's phases, averaged over the profiled steps.
    phase_ms = {name: float(np.mean([p.get(name, 0.0) for p in phases])) for name in dict.fromkeys(
        name for p in phases for name in p)}
    return {"policy": policy, "world_size": world, "num_layers": L, "num_experts": E, "top_k": cfg.top_k,
            "model": cfg.name, "tokens_per_step": tokens_per_step, "trace": trace_path.name,
            "phase_ms_per_step": phase_ms, **metrics}


def worker_main(args: argparse.Namespace) -> None:
    """One rank under torchrun: train every policy side by side, step i of every policy before step i + 1
    of any (so that the machine's load cannot favour one of them), rank 0 writing the per-policy files."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = Path(args.out)
        corpus = np.fromfile(out / "corpus.bin", dtype=np.uint8)
        running: dict[str, Any] = {}
        for policy in _policies(args.policies):
            run = _train_policy(policy, args, corpus, rank, world, out, position=len(running))
            try:
                next(run)               # build the model (or find that the policy cannot run)
                running[policy] = run
            except _Skip as exc:
                if rank == 0:
                    print(f"note: skipping policy {policy!r}: {exc}", file=sys.stderr, flush=True)
                    (out / f"metrics_{policy}.json").write_text(json.dumps({"policy": policy, "skipped": str(exc)}))
            dist.barrier()
        while running:
            for policy, run in list(running.items()):
                try:
                    next(run)
                except StopIteration as done:
                    del running[policy]
                    if rank == 0:
                        (out / f"metrics_{policy}.json").write_text(json.dumps(done.value))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- summary
def summarize(out: Path, policies: Sequence[str], warmup: int = 2) -> dict[str, Any]:
    """Read the per-policy metrics under ``out``; return the summary (also written as summary.json)."""
    summary: dict[str, Any] = {"policies": {}, "skipped": {}}
    runs = {}
    for policy in policies:
        path = out / f"metrics_{policy}.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: the run of policy {policy!r} did not finish")
        run = json.loads(path.read_text())
        if "skipped" in run:
            summary["skipped"][policy] = run["skipped"]
            continue
        runs[policy] = run
        times = run["step_time_s"]
        timed = times[warmup:] if len(times) > warmup else times
        step_time = float(np.mean(timed))
        exp_LS = np.asarray(run["expert_imbalance"], dtype=np.float64).T
        dev_LS = np.asarray(run["device_imbalance"], dtype=np.float64).T
        deltas = [d for d in run["delta_p"] if d is not None]
        summary["policies"][policy] = {
            "steps": len(times),
            "step_time_s": step_time,
            "tokens_per_s": run["tokens_per_step"] / step_time,
            "mean_expert_imbalance": exp_LS.mean(1).tolist(),
            "mean_device_imbalance": dev_LS.mean(1).tolist(),
            "final_loss": run["loss"][-1],
            "final_lm_loss": run["lm_loss"][-1],
            "mean_delta_p": float(np.mean(deltas)) if deltas else None,
            "trace": run["trace"],
            "phase_ms_per_step": run.get("phase_ms_per_step", {}),
        }
        summary.setdefault("world_size", run["world_size"])
        summary.setdefault("model", run["model"])
        summary.setdefault("num_experts", run["num_experts"])
        summary.setdefault("top_k", run["top_k"])
        summary.setdefault("tokens_per_step", run["tokens_per_step"])
    # "uniform" replaces the router's choices on purpose, so only the exact policies must coincide.
    names = [p for p in runs if p in EXACT_POLICIES]
    if len(names) >= 2:
        base = names[0]
        summary["loss_max_rel_diff"] = {p: max_relative_difference(runs[p]["loss"], runs[base]["loss"])
                                        for p in names[1:]}
        summary["loss_baseline"] = base
        summary["loss_coincide"] = {p: d <= LOSS_COINCIDE_RTOL for p, d in summary["loss_max_rel_diff"].items()}
    for peer in ("ep", "fsdp2"):
        if peer in summary["policies"]:
            peer_time = summary["policies"][peer]["step_time_s"]
            for stats in summary["policies"].values():
                stats[f"speedup_vs_{peer}"] = peer_time / stats["step_time_s"]
    summary["plots"] = _plot(out, runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# Later policies dashed/dotted so that coinciding curves stay visible.
_LINESTYLES = ("-", "--", ":", "-.")


def _plot(out: Path, runs: dict[str, dict]) -> list[str]:
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (policy, run) in enumerate(runs.items()):
        ax.plot(run["loss"], label=policy, linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=1.5)
    ax.set(xlabel="step", ylabel="training loss (lm + aux)", title="Loss per policy (should coincide)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    written.append("loss.png")

    L = next(iter(runs.values()))["num_layers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (policy, run) in enumerate(runs.items()):
        exp_SL = np.asarray(run["expert_imbalance"])
        dev_SL = np.asarray(run["device_imbalance"])
        style = _LINESTYLES[i % len(_LINESTYLES)]
        for li in range(L):
            axes[0].plot(exp_SL[:, li], label=f"{policy} layer {li}", linewidth=1, linestyle=style)
            axes[1].plot(dev_SL[:, li], label=f"{policy} layer {li}", linewidth=1, linestyle=style)
    axes[0].set(xlabel="step", ylabel="max / mean", title="Tokens per expert")
    axes[1].set(xlabel="step", title="Tokens processed per device")
    for ax in axes:
        ax.axhline(1.0, color="gray", linewidth=0.5)
        ax.legend(fontsize=7)
    fig.suptitle("Load imbalance per MoE layer")
    fig.tight_layout()
    fig.savefig(out / "imbalance.png", dpi=100)
    plt.close(fig)
    written.append("imbalance.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    any_delta = False
    for policy, run in runs.items():
        if any(d is not None for d in run["delta_p"]):
            any_delta = True
            ax.plot([d if d is not None else math.nan for d in run["delta_p"]], label=policy, linewidth=1.5,
                    linestyle=_LINESTYLES[list(runs).index(policy) % len(_LINESTYLES)])
        else:
            ax.plot([], [], label=f"{policy} (no placement reported)")
    ax.set(xlabel="step", ylabel="|ΔP| (replicas, all layers)", title="Replicas materialized per step")
    if not any_delta:
        ax.text(0.5, 0.5, "no policy reported a realized placement", transform=ax.transAxes, ha="center")
    ax.set_ylim(bottom=-0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "delta_p.png", dpi=100)
    plt.close(fig)
    written.append("delta_p.png")

    profiled = {policy: run["phase_ms_per_step"] for policy, run in runs.items() if run.get("phase_ms_per_step")}
    if profiled:
        phases = _phase_order(profiled.values())
        fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(profiled)))
        colors = plt.get_cmap("tab20").colors
        left = np.zeros(len(profiled))
        for phase in phases:
            ms = np.array([p.get(phase, 0.0) for p in profiled.values()])
            # A phase keeps its colour whichever phases a run has.
            color = "lightgray" if phase == OTHER_PHASE else colors[step_phases().index(phase) % len(colors)]
            ax.barh(list(profiled), ms, left=left, label=phase, color=color)
            left += ms
        ax.invert_yaxis()
        ax.set(xlabel="ms per step (rank 0, profiled steps)", title="Where a step goes, per policy")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4)
        fig.tight_layout()
        fig.savefig(out / "breakdown.png", dpi=100)
        plt.close(fig)
        written.append("breakdown.png")
    return written


def _phase_order(breakdowns) -> list[str]:
    """Every phase that any policy reports, in the order of a step (`runtime.profiling.step_phases`: the
    forward by kind, the SpAG start and wait, the backward by kind, SpRS, optimizer, re-shard, FSDP2), the
    rest of the step last."""
    seen = {name for b in breakdowns for name in b}
    return [name for name in step_phases() if name in seen and name != OTHER_PHASE] + [OTHER_PHASE]


def format_summary(summary: dict[str, Any], out: Path) -> str:
    """The text summary printed at the end of the demo."""
    lines = [f"themis_compile demo: {summary.get('model', '?')}, E={summary.get('num_experts', '?')}, "
             f"top-{summary.get('top_k', '?')}, {summary.get('world_size', '?')} ranks, "
             f"{summary.get('tokens_per_step', '?')} tokens/step"]
    header = f"{'policy':>10} {'step ms':>8} {'tokens/s':>9} {'expert imb':>14} {'device imb':>14} " \
             f"{'|dP|':>6} {'final loss':>10} {'vs ep':>6} {'vs fsdp2':>8}"
    lines.append(header)
    for policy, s in summary["policies"].items():
        exp = "/".join(f"{x:.2f}" for x in s["mean_expert_imbalance"])
        dev = "/".join(f"{x:.2f}" for x in s["mean_device_imbalance"])
        dp = "-" if s["mean_delta_p"] is None else f"{s['mean_delta_p']:.1f}"
        vs_ep, vs_fsdp2 = (f"{s[k]:.2f}x" if k in s else "-" for k in ("speedup_vs_ep", "speedup_vs_fsdp2"))
        lines.append(f"{policy:>10} {s['step_time_s'] * 1e3:8.1f} {s['tokens_per_s']:9.0f} {exp:>14} {dev:>14} "
                     f"{dp:>6} {s['final_loss']:10.4f} {vs_ep:>6} {vs_fsdp2:>8}")
    for policy, why in summary["skipped"].items():
        lines.append(f"{policy:>10} skipped: {why}")
    profiled = {p: s["phase_ms_per_step"] for p, s in summary["policies"].items() if s.get("phase_ms_per_step")}
    if profiled:
        lines.append("breakdown, ms per step (rank 0, profiled steps; breakdown.png):")
        lines.append(f"{'phase':>40} " + " ".join(f"{p:>9}" for p in profiled))
        for phase in _phase_order(profiled.values()):
            lines.append(f"{phase:>40} " + " ".join(f"{b[phase]:9.1f}" if phase in b else f"{'-':>9}"
                                                    for b in profiled.values()))
    for policy, diff in summary.get("loss_max_rel_diff", {}).items():
        verdict = "coincide" if summary["loss_coincide"][policy] else "DIFFER"
        lines.append(f"loss curves {policy} vs {summary['loss_baseline']}: max relative difference {diff:.2e} "
                     f"({verdict}, tolerance {LOSS_COINCIDE_RTOL:g})")
    lines.append("imbalance = max/mean per MoE layer (layers separated by /), averaged over steps; "
                 "expert imb = tokens per expert, device imb = tokens computed per rank")
    lines.append(f"written to {out}: summary.json, " + ", ".join(
        [s["trace"] for s in summary["policies"].values()] + summary["plots"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- launch
def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Build the corpus, run the ranks under torchrun, then summarize; returns the summary."""
    policies = _policies(args.policies)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("metrics_*.json"), *out.glob("trace_*.jsonl"), out / "summary.json"]:
        stale.unlink(missing_ok=True)
    corpus = build_corpus(args.corpus_bytes)
    if corpus.size <= args.seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the corpus ({corpus.size} bytes)")
    corpus.tofile(out / "corpus.bin")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "demo", "--worker",
           "--steps", str(args.steps), "--policies", ",".join(policies), "--out", str(out),
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--model", args.model,
           "--d-ffn", str(args.d_ffn),
           "--router-skew", str(args.router_skew), "--lr", str(args.lr), "--seed", str(args.seed),
           "--timeout", str(args.timeout)]
    if args.no_progress:
        cmd.append("--no-progress")
    # The ranks import this package from its folder's parent, wherever the launcher was started from.
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    print(f"corpus: {corpus.size:,} bytes of Python stdlib sources; launching {args.nproc} ranks "
          f"({', '.join(policies)}; {args.steps} steps each)", flush=True)
    # A hanging collective fails after --timeout inside the ranks; torchrun then stops the others.
    proc = subprocess.run(cmd, env=env)
    finished = [p for p in policies if (out / f"metrics_{p}.json").exists()]
    summary = summarize(out, finished) if finished else {}
    if finished:
        print(format_summary(summary, out), flush=True)
    if proc.returncode != 0:
        missing = [p for p in policies if p not in finished]
        raise RuntimeError(f"torchrun exited with code {proc.returncode}; policies that did not finish: "
                           f"{', '.join(missing) or 'none'}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        _policies(args.policies)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        worker_main(args)
        return
    try:
        launch(args)
    except RuntimeError as exc:
        raise SystemExit(f"demo failed: {exc}") from exc
