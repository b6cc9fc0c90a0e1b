"""``themis-compile simulate``: the simulator's command line (see ``--help`` and docs/simulator.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from themis_compile.cost_model.cluster import get_cluster
from themis_compile.sim.engine import DEFAULT_POLICIES, simulate
from themis_compile.sim.paper import format_paper_report, format_weak_scaling, paper_report, weak_scaling
from themis_compile.sim.report import chrome_trace, format_tables, write_plots
from themis_compile.sim.setup import MAX_SIM_BYTES, build_setup, read_profile, resolve_model_config
from themis_compile.sim.traces import model_cv, read_jsonl, synthetic_trace

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="themis-compile simulate",
                                description="Simulate Themis and the baselines on a cluster (paper §5).")
    p.add_argument("--model", default=None,
                   help="preset name or package.module:factory (default phi-3.5-moe; --weak-scaling: deepseek-v3)")
    p.add_argument("--cluster", default="A", help="A, B, or a .toml/.json cluster file")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the cluster's, 4)")
    p.add_argument("--devices-per-node", type=int, default=None, help="override GPUs per node")
    p.add_argument("--policy", default=",".join(DEFAULT_POLICIES), help="comma-separated policies")
    p.add_argument("--trace", default=None, help="routing trace JSONL (default: synthetic)")
    p.add_argument("--iterations", type=int, default=None, help="iterations (default 30; --paper: 20)")
    p.add_argument("--batch", type=int, default=None, help="sequences per device")
    p.add_argument("--seq-len", type=int, default=None, help="override the sequence length")
    p.add_argument("--top-k", type=int, default=None, help="override top-k")
    p.add_argument("--cv", type=float, default=None,
                   help="synthetic skew: coefficient of variation of the expert shares (default: the model's, "
                        "traces.model_cv)")
    p.add_argument("--drift", type=float, default=None, help="synthetic per-step drift of the loads")
    p.add_argument("--jitter", type=float, default=None, help="synthetic per-step noise of the loads")
    p.add_argument("--attention-efficiency", type=float, default=None,
                   help="fraction of peak FLOP/s attention achieves (default: calibrated from Fig. 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-budget-gb", type=float, default=None, help="spare memory for replicas per device")
    p.add_argument("--overlap-degree", type=int, default=None, help="override t")
    p.add_argument("--materialization-budget", type=int, default=None, help="override m")
    p.add_argument("--reshard-interval", type=int, default=100)
    p.add_argument("--compute-efficiency", type=float, default=None)
    p.add_argument("--comm-efficiency", type=float, default=None)
    p.add_argument("--profile", default=None, help="profile JSON with measured T_attn / bandwidths / psi")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--trace-out", default=None, help="write a chrome trace of one iteration here")
    p.add_argument("--write-trace", default=None, help="save the synthetic routing trace as JSONL")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--paper", action="store_true", help="the reproduction report against the paper's figures")
    p.add_argument("--quick", action="store_true", help="with --paper: two models only")
    p.add_argument("--weak-scaling", default=None, metavar="D,D,...",
                   help="Fig. 13b past the paper's scale: --model (default deepseek-v3; E grows with the devices) "
                        "on Cluster A at these device counts (e.g. 32,256,1024,4096; default 12 iterations)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="refuse sizes whose simulation would need more memory (GiB; default "
                        f"{MAX_SIM_BYTES / 2 ** 30:.0f})")
    return p


def main(argv: list[str] | None = None) -> None:
    """``themis-compile simulate ...`` (see ``--help``)."""
    args = _parser().parse_args(argv)
    progress = not args.no_progress
    max_memory = None if args.max_memory_gb is None else args.max_memory_gb * 2 ** 30
    if args.weak_scaling is not None:
        try:
            sizes = [int(x) for x in args.weak_scaling.split(",") if x.strip()]
            rows = weak_scaling(sizes, iterations=args.iterations or 12, model=args.model or "deepseek-v3",
                                progress=progress, max_memory_bytes=max_memory)
        except ValueError as exc:
            raise SystemExit(f"themis-compile simulate: --weak-scaling: {exc}") from exc
        print(json.dumps(rows, indent=2) if args.json else format_weak_scaling(rows))
        return
    if args.paper:
        report = paper_report(iterations=args.iterations or 20, progress=progress, quick=args.quick)
        if args.json:
            print(json.dumps({"rows": report["rows"], "fig9": report["fig9"]}, indent=2))
        else:
            print(format_paper_report(report))
        return
    try:
        cluster = get_cluster(args.cluster, args.nodes)
        changes: dict[str, Any] = {}
        if args.devices_per_node is not None:
            changes["devices_per_node"] = args.devices_per_node
        if args.compute_efficiency is not None:
            changes["compute_efficiency"] = args.compute_efficiency
        if args.comm_efficiency is not None:
            changes["comm_efficiency"] = args.comm_efficiency
        cluster = cluster.replace(**changes) if changes else cluster
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        if "ep" not in policies:
            policies.insert(0, "ep")        # the reference of every relative figure
        cfg = resolve_model_config(args.model or "phi-3.5-moe", devices=cluster.num_devices, cluster=cluster.name,
                                   seq_len=args.seq_len)
        if args.top_k is not None:
            cfg = cfg.replace(top_k=args.top_k)
        setup = build_setup(cfg, cluster, batch=args.batch,
                            memory_budget_bytes=None if args.memory_budget_gb is None else args.memory_budget_gb * 1e9,
                            overlap_degree=args.overlap_degree, materialization_budget=args.materialization_budget,
                            reshard_interval=args.reshard_interval, attention_efficiency=args.attention_efficiency,
                            profile=read_profile(args.profile) if args.profile else None,
                            max_memory_bytes=max_memory)
        if args.trace:
            trace = read_jsonl(args.trace)
            iterations = args.iterations or len(trace.steps)
        else:
            iterations = args.iterations or 30
            cv = model_cv(cfg.experts_per_device, cfg.num_experts, cluster.num_devices) if args.cv is None else args.cv
            trace = synthetic_trace(cfg.n_layers, cfg.num_experts, cluster.num_devices, setup.tokens_per_device,
                                    cfg.top_k, iterations, cv=cv, drift=args.drift, jitter=args.jitter,
                                    seed=args.seed, model=cfg.name)
            if args.write_trace:
                trace.write_jsonl(args.write_trace)
        result = simulate(setup, trace, policies, iterations=iterations, progress=progress)
    except ValueError as exc:
        raise SystemExit(f"themis-compile simulate: {exc}") from exc
    if args.trace_out:
        Path(args.trace_out).write_text(json.dumps(chrome_trace(result)))
    plots = [str(p) for p in write_plots(result, args.plot_dir)] if args.plot_dir else []
    if args.json:
        out = result.as_dict()
        out["plots"] = plots
        print(json.dumps(out, indent=2, default=float))
    else:
        print(format_tables(result))
        if plots:
            print("\nplots: " + ", ".join(plots))
        if args.trace_out:
            print(f"chrome trace: {args.trace_out}")
