"""The simulator's outputs: text tables, PNG plots (Fig. 9, 11 and 12 shapes) and a chrome trace of one
iteration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from themis_compile.sim.engine import CATEGORIES, SimResult

__all__ = ["agg_pyplot", "chrome_trace", "write_plots", "format_tables"]


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """A chrome://tracing / Perfetto JSON object of the kept iteration: one process per policy, one
    thread per stream (compute, sparse collectives, data-parallel AllReduce)."""
    events: list[dict[str, Any]] = []
    tids = {"compute": 0, "comm": 1, "dp": 2}
    labels = {"compute": "compute (critical path)", "comm": "sparse collectives", "dp": "data-parallel AllReduce"}
    for pid, (name, res) in enumerate(result.policies.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for stream, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": labels[stream]}})
        for ev in res.events:
            events.append({"name": ev["name"], "cat": ev["cat"], "ph": "X", "pid": pid,
                           "tid": tids[ev["stream"]], "ts": round(ev["start"] * 1e6, 3),
                           "dur": round(ev["dur"] * 1e6, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": result.setup.model.name, "cluster": result.setup.cluster.name,
                          "num_devices": result.setup.num_devices, "iteration": result.trace_iteration}}


def agg_pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (PNG files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: SimResult, out_dir: str | Path) -> list[Path]:
    """PNG plots: throughput relative to EP (Fig. 9 shape), critical-path breakdown (Fig. 11) and
    model-state memory (Fig. 12). Returns the written paths."""
    plt = agg_pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(result.policies)
    title = f"{result.setup.model.name}, cluster {result.setup.cluster.name}, {result.setup.num_devices} GPUs"
    paths = []
    if "ep" in result.policies:
        speed = result.speedup_over("ep")
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, [speed[n] for n in names], color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("throughput relative to EP")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / "throughput.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = np.zeros(len(names))
    for cat in CATEGORIES:
        vals = np.array([result.policies[n].breakdown_s[cat] * 1e3 for n in names])
        ax.bar(names, vals, bottom=bottom, label=cat)
        bottom += vals
    ax.set_ylabel("critical path per iteration (ms)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = np.zeros(len(names))
    for kind in ("Opt", "Grad", "Param"):
        vals = np.array([result.policies[n].memory_bytes[kind] / 1e9 for n in names])
        ax.bar(names, vals, bottom=bottom, label=kind)
        bottom += vals
    ax.set_ylabel("model-state memory per device (GB)")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def format_tables(result: SimResult) -> str:
    """The three text tables: throughput vs EP, critical-path breakdown, memory."""
    s = result.setup
    lines = [f"model {s.model.name} | cluster {s.cluster.name} ({s.cluster.gpu}) | {s.cluster.num_nodes} nodes x "
             f"{s.cluster.devices_per_node} GPUs | E={s.num_experts} top-{s.model.top_k} L={s.num_layers} "
             f"batch={s.batch}x{s.model.seq_len} | t={s.overlap_degree} m={s.materialization_budget} "
             f"m_rm={s.materialization_budget_rm} | skew={result.trace_skew:.4f} | "
             f"{result.iterations - result.warmup} measured iterations", ""]
    speed = result.speedup_over("ep") if "ep" in result.policies else {}
    head = f"{'policy':<11}{'iter ms':>10}{'vs EP':>8}" + "".join(f"{c:>11}" for c in CATEGORIES)
    lines += ["critical path per iteration (ms) and throughput relative to EP", head]
    for n, r in result.policies.items():
        row = f"{n:<11}{r.mean_iteration_s * 1e3:>10.2f}{speed.get(n, math.nan):>8.2f}"
        lines.append(row + "".join(f"{r.breakdown_s[c] * 1e3:>11.2f}" for c in CATEGORIES))
    lines += ["", "model-state memory per device (GB)",
              f"{'policy':<11}{'Param':>9}{'Grad':>9}{'Opt':>9}{'Total':>9}{'vs EP':>8}"]
    ep_total = result.policies["ep"].memory_bytes["Total"] if "ep" in result.policies else math.nan
    for n, r in result.policies.items():
        m = r.memory_bytes
        lines.append(f"{n:<11}{m['Param'] / 1e9:>9.2f}{m['Grad'] / 1e9:>9.2f}{m['Opt'] / 1e9:>9.2f}"
                     f"{m['Total'] / 1e9:>9.2f}{m['Total'] / ep_total:>8.3f}")
    return "\n".join(lines)
