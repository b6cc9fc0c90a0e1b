"""`python -m themis_compile.bench collectives [--quick] [...]`: sparse collectives on gloo ranks (§3.3).

Launches its own gloo ranks on loopback through the multi-rank harness and prints one JSON document:

- ``link``: measured bandwidth of this group: one pair alone (``pair_bw``) and every rank sending to the
  next at once (``ring_bw``, the per-device bandwidth when all devices communicate — the regime a sparse
  collective runs in, and the ``bw`` of the §3.3 bound below);
- ``spag`` / ``sprs``: for placements of growing |ΔP| (random replicas over a contiguous shard placement),
  the achieved completion time (max over ranks, median over repeats) and the §3.3 lower bound
  ``max per-device volume / bw`` (`cost_model.volume.lower_bound_time`); ``bound_ratio = bound / time``
  (1.0 = at the bound; the target on gloo is ≥ 0.8 for chunks ≥ 1 MiB); as references, the same plan with
  64-byte chunks (``latency_floor_s``) and raw gloo moving the plan's bytes between the same pairs in the
  same stages, one message per pair and stage (``raw_pattern_time_s``, ``raw_pattern_bound_ratio``,
  ``over_raw_pattern`` = our time over it);
- ``vs_naive``: placements where several replicas of one expert cross the same node boundary, timed
  against the paper's prototype (one owner-to-replica transfer per pair of ΔP, all issued at once);
  ``speedup = naive / ours`` (target ≥ 1.5), plus ``modeled_speedup``: both message plans replayed on a
  link model whose node boundary is ``--inter-ratio`` times slower than the measured pair bandwidth;
- ``dense_reference``: SpAG toward the full placement (every expert everywhere) against gloo's own
  ``all_gather`` of the same bytes — the best the library does for that pattern;
- ``emulated``: the ``vs_naive`` comparison again, measured on real node boundaries: every node is a
  network namespace whose link to the others is shaped to ``--inter-node-bw`` bytes/s each way
  (`themis_compile.testing.netns.EmulatedNodes`; with ``--network emulated`` or ``auto``; needs root —
  otherwise the section says why it is missing). ``speedup`` there is measured, not modeled, and
  ``bound_ratio`` uses the §3.3 bound with the intra-node and node-boundary bandwidths measured on the
  emulated network (``link``).

The ranks' C allocator keeps freed memory (``allocator``), as the caching allocator does on GPUs, so that
fresh receive buffers do not pay page faults. Without ``emulated``, the "nodes" on one machine are
declared, not physical: loopback links all share the
same CPUs, so those figures show the effect of fewer bytes per device, not of a slower node boundary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from themis_compile.cost_model.volume import chunk_bytes, lower_bound_time, sparse_all_gather_volume
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology
from themis_compile.runtime.collectives import (
    ChunkLayout,
    CommPlan,
    Transfer,
    plan_sparse_all_gather,
    plan_sparse_reduce_scatter,
    sparse_all_gather,
    sparse_reduce_scatter,
)

MiB = 1 << 20


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m themis_compile.bench collectives", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small chunks, few placements (a smoke test)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--devices-per-node", type=int, default=2)
    p.add_argument("--chunk-mib", type=float, nargs="+", default=None, help="chunk sizes Ψ in MiB")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inter-ratio", type=float, default=4.0,
                   help="device link / node boundary bandwidth ratio for the modeled comparison")
    p.add_argument("--network", choices=("declared", "emulated", "auto"), default="declared",
                   help="declared: loopback only; emulated: also measure on network namespaces with shaped "
                        "node boundaries (needs root; changes this host's network while it runs); auto: "
                        "emulated when possible")
    p.add_argument("--inter-node-bw", type=float, default=200e6,
                   help="bytes/s of every emulated node boundary, each way (default 200 MB/s)")
    return p.parse_args(argv)


# ============================================================================ per-rank measurements
def _keep_freed_memory() -> str:
    """Make this process's C allocator keep freed memory for reuse instead of returning it to the OS.

    On GPUs the caching allocator hands a collective's receive buffers out again without cost. On the
    CPU, glibc returns large freed blocks to the OS, and every fresh receive buffer then pays a page fault
    per 4 KiB on first touch: several milliseconds per collective here, which would measure the C
    library rather than the transfer. Returns what was done, for the JSON.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unchanged (no glibc mallopt)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_trim_threshold, 1 << 30) == 1 and mallopt(m_mmap_threshold, 1 << 30) == 1
    return "glibc keeps freed memory (mallopt: trim and mmap thresholds 1 GiB)" if ok else "unchanged (mallopt refused)"


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn, repeats: int) -> float:
    """Median over repeats of the slowest rank's time of ``fn()`` (after a barrier, one warm-up)."""
    return _interleaved(fn, repeats=repeats)[0]


def _pair(rank: int, peer: int, nbytes: int) -> Callable[[], None]:
    """Rank 0 sends ``nbytes`` to ``peer``; everyone else idles."""
    buf_send = torch.ones(nbytes, dtype=torch.uint8)
    buf_recv = torch.empty(nbytes, dtype=torch.uint8)

    def run() -> None:
        if rank == 0:
            dist.isend(buf_send, dst=peer).wait()
        elif rank == peer:
            dist.irecv(buf_recv, src=0).wait()
    return run


def _link_bandwidth(rank: int, world: int, nbytes: int, repeats: int) -> dict[str, float]:
    return {"bytes": nbytes, "pair_bw": nbytes / _timed(_pair(rank, 1, nbytes), repeats),
            "ring_bw": nbytes / _timed(_ring(rank, world, nbytes), repeats)}


def _chunks(rank: int, chunk_mib: float) -> tuple[list, int, dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """(spec, Ψ, this rank's owned chunk, a gradient-like chunk) for SwiGLU chunks of ``chunk_mib``."""
    spec = _swiglu_spec(int(chunk_mib * MiB))
    psi = chunk_bytes(spec)
    return spec, psi, {rank: [torch.randn(s).to(dt) for s, dt in spec]}, [torch.randn(s).to(dt) for s, dt in spec]


def _gather_and_reduce(rank: int, chunks: dict[int, list[torch.Tensor]], grads_like: list[torch.Tensor],
                       shard: Placement, placement: Placement, topology: Topology, spec: list
                       ) -> tuple[Callable[[], None], Callable[[], None]]:
    """SpAG(shard, placement) and SpRS(placement, shard) of these chunks, as two timed functions."""
    grads = {int(e): grads_like for e in placement.experts_on(rank)}

    def spag() -> None:
        sparse_all_gather(chunks, shard, placement, topology, spec=spec, layer="bench").wait()

    def sprs() -> None:
        sparse_reduce_scatter(grads, placement, shard, topology, spec=spec, layer="bench").wait()
    return spag, sprs


def _ours_and_naive(rank: int, chunks: dict[int, list[torch.Tensor]], shard: Placement, placement: Placement,
                    topology: Topology, spec: list) -> tuple[Callable[[], None], Callable[[], None]]:
    """Our SpAG and the prototype's transfers for one placement, as two timed functions."""
    def ours() -> None:
        sparse_all_gather(chunks, shard, placement, topology, spec=spec, layer="bench").wait()

    def naive() -> None:
        _naive_all_gather(chunks, spec, shard, placement, rank)
    return ours, naive


def _ring(rank: int, world: int, nbytes: int) -> Callable[[], None]:
    """Every rank sends ``nbytes`` to the next and receives as many from the previous, at once."""
    buf_send = torch.ones(nbytes, dtype=torch.uint8)
    buf_recv = torch.empty(nbytes, dtype=torch.uint8)

    def run() -> None:
        works = [dist.irecv(buf_recv, src=(rank - 1) % world), dist.isend(buf_send, dst=(rank + 1) % world)]
        for w in works:
            w.wait()
    return run


def _raw_pattern(plan: CommPlan, rank: int) -> Callable[[], None]:
    """Raw gloo moving ``plan``'s bytes with no library around it: per stage, one preallocated message per
    (src, dst) pair (no slices, copies or sums), all posted at once, all waited for before the next stage.
    A reference for what the plan's message pattern costs on this machine: ``our time / this`` is the
    library's own cost, plus in SpRS the sums, minus what pipelining wins."""
    stages = []
    for stage in range(len(plan.stages)):
        recvs, sends = [], []
        for (src, dst), transfers in sorted(plan.messages(stage).items()):
            nbytes = sum(t.nbytes for t in transfers)
            if dst == rank:
                recvs.append((src, torch.empty(nbytes, dtype=torch.uint8)))
            elif src == rank:
                sends.append((dst, torch.zeros(nbytes, dtype=torch.uint8)))
        stages.append((recvs, sends))

    def run() -> None:
        for recvs, sends in stages:
            works = [dist.irecv(buf, src=peer) for peer, buf in recvs] + \
                [dist.isend(buf, dst=peer) for peer, buf in sends]
            for w in works:
                w.wait()
    return run


def _naive_all_gather(chunks: dict[int, list[torch.Tensor]], spec: list[tuple[tuple[int, ...], torch.dtype]],
                      shard: Placement, placement: Placement, rank: int) -> dict[int, list[torch.Tensor]]:
    """The paper's prototype: the owner sends the whole chunk to every added replica (one per ΔP pair)."""
    delta = placement.mask & ~shard.mask
    owners = shard.owners()
    works, out = [], {}
    for e in range(shard.num_experts):
        for d in np.flatnonzero(delta[e]):
            if int(d) == rank:
                out[e] = [torch.empty(shape, dtype=dtype) for shape, dtype in spec]
                works += [dist.irecv(t, src=int(owners[e])) for t in out[e]]
            elif owners[e] == rank:
                works += [dist.isend(t, dst=int(d)) for t in chunks[e]]
    for w in works:
        w.wait()
    return out


def _swiglu_spec(psi_bytes: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Three fp32 matrices (w1, w2, w3) of about ``psi_bytes`` together."""
    hidden = 64
    ffn = max(1, -(-psi_bytes // (3 * hidden * 4)))     # rounded up: Ψ >= the requested size
    return [((hidden, ffn), torch.float32), ((ffn, hidden), torch.float32), ((hidden, ffn), torch.float32)]


def _placements(world: int, seed: int, quick: bool) -> list[tuple[str, Placement, Placement]]:
    """Contiguous shards (one expert per rank) and P' of growing |ΔP|."""
    shard = Placement.contiguous(world, world)
    rng = np.random.default_rng(seed)
    out = []
    sizes = [1, world // 2, world, 2 * world, world * (world - 1)]
    for size in (sizes[::2] if quick else sizes):
        free = np.argwhere(~shard.mask)
        pick = free[rng.choice(len(free), size=min(size, len(free)), replace=False)]
        mask = shard.mask.copy()
        mask[pick[:, 0], pick[:, 1]] = True
        out.append((f"|dP|={len(pick)}", shard, Placement(mask)))
    return out


def _cross_node_placements(topology: Topology) -> list[tuple[str, Placement, Placement]]:
    """Each expert replicated on every device of the other node (several replicas cross one boundary)."""
    world = topology.num_devices
    shard = Placement.contiguous(world, world)
    out = []
    for name, experts in (("one expert to the other node", [0]),
                          ("every expert to the other node", list(range(world)))):
        mask = shard.mask.copy()
        for e in experts:
            node = topology.node_of(e)
            for n in range(topology.num_nodes):
                if n != node:
                    mask[e, list(topology.devices_of_node(n))] = True
        out.append((name, shard, Placement(mask)))
    return out


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    allocator = _keep_freed_memory()
    torch.manual_seed(cfg["seed"] + rank)
    topology = Topology.from_env(world)
    repeats = cfg["repeats"]
    link = _link_bandwidth(rank, world, cfg["link_bytes"], repeats)
    bw = link["ring_bw"]
    result: dict[str, Any] = {"world_size": world, "topology": list(topology.devices_per_node), "link": link,
                              "allocator": allocator,
                              "spag": [], "sprs": [], "vs_naive": [], "dense_reference": []}
    for chunk_mib in cfg["chunk_mib"]:
        spec, psi, chunks, grads_like = _chunks(rank, chunk_mib)
        for name, shard, placement in _placements(world, cfg["seed"], cfg["quick"]):
            spag, sprs = _gather_and_reduce(rank, chunks, grads_like, shard, placement, topology, spec)
            vol = sparse_all_gather_volume(shard, placement, psi, topology)
            per_device = max(max(r, s) for r, s in zip(vol.recv_bytes_D, vol.send_bytes_D))
            ring = _ring(rank, world, per_device)
            bound_link = lower_bound_time(shard, placement, psi, topology, device_bw=bw, inter_node_bw=bw)
            tiny = [torch.zeros(16)]
            spag_tiny, sprs_tiny = _gather_and_reduce(rank, {rank: tiny}, tiny, shard, placement, topology,
                                                      [((16,), torch.float32)])

            layout = ChunkLayout.from_spec(spec)
            raw = {"spag": _raw_pattern(plan_sparse_all_gather(shard, placement, topology, layout), rank),
                   "sprs": _raw_pattern(plan_sparse_reduce_scatter(placement, shard, topology, layout), rank)}
            for key, fn, tiny in (("spag", spag, spag_tiny), ("sprs", sprs, sprs_tiny)):
                t, t_ring, t_tiny, t_raw = _interleaved(fn, ring, tiny, raw[key], repeats=repeats)
                # The link bandwidth of this moment: a ring moving the same per-device volume, timed in
                # the same repeats (this machine's loopback speed drifts with its other load).
                bw_now = per_device / t_ring if t_ring else bw
                bound = lower_bound_time(shard, placement, psi, topology, device_bw=bw_now, inter_node_bw=bw_now)
                result[key].append({"chunk_bytes": psi, "placement": name, "delta_pairs": vol.total_bytes // psi,
                                    "max_device_bytes": per_device, "time_s": t, "ring_time_s": t_ring,
                                    "bound_s": bound, "bound_ratio": bound / t if t else None,
                                    "bound_ratio_link_bw": bound_link / t if t else None,
                                    # The same message plan with 64-byte chunks: its per-message latency.
                                    "latency_floor_s": t_tiny,
                                    # Raw gloo sending the plan's messages: the pattern's own cost here.
                                    "raw_pattern_time_s": t_raw,
                                    "raw_pattern_bound_ratio": bound / t_raw if t_raw else None,
                                    "over_raw_pattern": t / t_raw if t_raw else None})
        # Reference: SpAG toward the full placement is a dense all-gather; time gloo's own.
        flat = torch.randn(psi // 4)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        full = Placement.full(world, world)
        shard_c = Placement.contiguous(world, world)
        t_dense = _timed(lambda: dist.all_gather(gathered, flat), repeats)
        t_full = _timed(lambda: sparse_all_gather(chunks, shard_c, full, topology, spec=spec, layer="bench").wait(),
                        repeats)
        result["dense_reference"].append({"chunk_bytes": psi, "gloo_all_gather_time_s": t_dense,
                                          "spag_full_placement_time_s": t_full,
                                          "spag_over_all_gather": t_full / t_dense})
        for name, shard, placement in _cross_node_placements(topology):
            t_ours, t_naive = _interleaved(*_ours_and_naive(rank, chunks, shard, placement, topology, spec),
                                           repeats=repeats)
            vol = sparse_all_gather_volume(shard, placement, psi, topology)
            # Link model with a node boundary `inter_ratio` times slower than a device link (what loopback
            # cannot show): the measured pair bandwidth inside nodes.
            ours_plan = plan_sparse_all_gather(shard, placement, topology, ChunkLayout.from_spec(spec))
            naive_plan = _naive_plan(shard, placement, psi, topology)
            inter_bw = link["pair_bw"] / cfg["inter_ratio"]
            m_ours = modeled_time(ours_plan, link["pair_bw"], inter_bw)
            m_naive = modeled_time(naive_plan, link["pair_bw"], inter_bw)
            result["vs_naive"].append({"chunk_bytes": psi, "placement": name,
                                       "delta_pairs": vol.total_bytes // psi,
                                       "inter_node_bytes": vol.inter_node_bytes,
                                       "naive_inter_node_bytes": _naive_inter_node_bytes(shard, placement, psi,
                                                                                         topology),
                                       "time_s": t_ours, "naive_time_s": t_naive, "speedup": t_naive / t_ours,
                                       "modeled_inter_node_bw": inter_bw, "modeled_time_s": m_ours,
                                       "modeled_naive_time_s": m_naive, "modeled_speedup": m_naive / m_ours})
    return result if rank == 0 else None


def _bench_emulated_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Ours against the prototype across real (shaped) node boundaries; see the module docstring."""
    _keep_freed_memory()
    topology = Topology.from_env(world)
    repeats, k, nbytes = cfg["repeats"], topology.devices_per_node[0], cfg["link_bytes"]
    intra_bw = nbytes / _timed(_pair(rank, 1, nbytes), repeats)
    inter_bw = nbytes / _timed(_pair(rank, k, nbytes), repeats)
    result: dict[str, Any] = {"inter_node_bw": cfg["inter_node_bw"], "topology": list(topology.devices_per_node),
                              "link": {"intra_pair_bw": intra_bw, "inter_pair_bw": inter_bw},
                              "spag": [], "sprs": [], "vs_naive": []}
    for chunk_mib in cfg["chunk_mib"]:
        spec, psi, chunks, grads_like = _chunks(rank, chunk_mib)
        # The random placements of the loopback sweep, now with a real node boundary: the §3.3 bound
        # with the measured intra-node and node-boundary bandwidths.
        for name, shard, placement in _placements(world, cfg["seed"], cfg["quick"]):
            spag, sprs = _gather_and_reduce(rank, chunks, grads_like, shard, placement, topology, spec)
            bound = lower_bound_time(shard, placement, psi, topology, device_bw=intra_bw, inter_node_bw=inter_bw)
            vol = sparse_all_gather_volume(shard, placement, psi, topology)
            for key, t in zip(("spag", "sprs"), _interleaved(spag, sprs, repeats=repeats)):
                result[key].append({"chunk_bytes": psi, "placement": name, "delta_pairs": vol.total_bytes // psi,
                                    "inter_node_bytes": vol.inter_node_bytes, "time_s": t, "bound_s": bound,
                                    "bound_ratio": bound / t if t else None})
        for name, shard, placement in _cross_node_placements(topology):
            t_ours, t_naive = _interleaved(*_ours_and_naive(rank, chunks, shard, placement, topology, spec),
                                           repeats=repeats)
            # As in the sweep above: the bandwidths measured on this network, not the configured shaping.
            bound = lower_bound_time(shard, placement, psi, topology, device_bw=intra_bw, inter_node_bw=inter_bw)
            result["vs_naive"].append({
                "chunk_bytes": psi, "placement": name,
                "inter_node_bytes": sparse_all_gather_volume(shard, placement, psi, topology).inter_node_bytes,
                "naive_inter_node_bytes": _naive_inter_node_bytes(shard, placement, psi, topology),
                "time_s": t_ours, "naive_time_s": t_naive, "speedup": t_naive / t_ours,
                "bound_s": bound, "bound_ratio": bound / t_ours})
    return result if rank == 0 else None


def _interleaved(*fns: Callable[[], None], repeats: int) -> list[float]:
    """`_timed` of several functions, alternating them repeat by repeat (machine noise hits all alike)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append(_max_over_ranks(time.perf_counter() - t0))
    return [statistics.median(t) for t in times]


def _emulated(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    from themis_compile.testing import run_multirank
    from themis_compile.testing.netns import EmulatedNodes

    reason = EmulatedNodes.unavailable_reason()
    if reason is not None:
        if args.network == "emulated":
            raise SystemExit(f"--network emulated: {reason}")
        return {"skipped": reason}
    try:
        with EmulatedNodes(args.world_size // args.devices_per_node, args.inter_node_bw) as net:
            return run_multirank(_bench_emulated_rank, args.world_size, args=(cfg,),
                                 devices_per_node=args.devices_per_node, timeout_s=120.0, network=net)[0]
    except RuntimeError as exc:
        if args.network == "emulated":
            raise
        return {"skipped": str(exc)}


def _naive_plan(shard: Placement, placement: Placement, psi: int, topology: Topology) -> CommPlan:
    """The prototype's transfers as a one-stage plan: owner -> every added replica, whole chunks."""
    owners = shard.owners()
    transfers = tuple(sorted(Transfer(int(owners[e]), int(d), int(e), 0, psi)
                             for e, d in np.argwhere(placement.mask & ~shard.mask)))
    return CommPlan("naive", (transfers,) if transfers else (), tuple(int(n) for n in topology.node_ids),
                    topology.num_nodes)


def modeled_time(plan: CommPlan, device_bw: float, inter_node_bw: float) -> float:
    """Link-model time of a staged plan: per stage, the slowest device link (send or receive at
    ``device_bw``) or node boundary (ingress or egress at ``inter_node_bw``); stages add up."""
    total = 0.0
    for stage in plan.stages:
        sent = [0] * plan.num_devices
        recv = [0] * plan.num_devices
        ingress = [0] * plan.num_nodes
        egress = [0] * plan.num_nodes
        for t in stage:
            sent[t.src] += t.nbytes
            recv[t.dst] += t.nbytes
            a, b = plan.node_ids[t.src], plan.node_ids[t.dst]
            if a != b:
                egress[a] += t.nbytes
                ingress[b] += t.nbytes
        total += max(max(sent + recv) / device_bw, max(ingress + egress) / inter_node_bw)
    return total


def _naive_inter_node_bytes(shard: Placement, placement: Placement, psi: int, topology: Topology) -> int:
    delta = placement.mask & ~shard.mask
    owners = shard.owners()
    ids = topology.node_ids
    return int(sum(psi for e, d in np.argwhere(delta) if ids[owners[e]] != ids[d]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark on its own gloo ranks; print and return the JSON result."""
    from themis_compile.testing import run_multirank

    args = _parse(argv)
    if args.world_size < 2 or args.world_size % args.devices_per_node:
        raise SystemExit("--world-size must be >= 2 and a multiple of --devices-per-node")
    cfg = {
        "quick": args.quick,
        "seed": args.seed,
        "inter_ratio": args.inter_ratio,
        "chunk_mib": args.chunk_mib or ([0.0625] if args.quick else [1.0, 4.0]),
        "repeats": args.repeats or (2 if args.quick else 5),
        "link_bytes": (256 << 10) if args.quick else 4 * MiB,
        "inter_node_bw": args.inter_node_bw,
    }
    t0 = time.perf_counter()
    results = run_multirank(_bench_rank, args.world_size, args=(cfg,), devices_per_node=args.devices_per_node,
                            timeout_s=120.0)
    out = results[0]
    if args.network != "declared":
        out["emulated"] = _emulated(args, cfg) if args.world_size > args.devices_per_node else \
            {"skipped": "one node: no node boundary to emulate"}
    big = [r for r in out["spag"] + out["sprs"] if r["chunk_bytes"] >= MiB and r["delta_pairs"] > 0]
    out["summary"] = {
        "min_bound_ratio_chunks_ge_1MiB": min((r["bound_ratio"] for r in big), default=None),
        "median_bound_ratio_chunks_ge_1MiB": statistics.median([r["bound_ratio"] for r in big]) if big else None,
        # The same figures for raw gloo sending the plans' messages (no library), and our time over it.
        "min_raw_pattern_bound_ratio_chunks_ge_1MiB": min((r["raw_pattern_bound_ratio"] for r in big), default=None),
        "median_raw_pattern_bound_ratio_chunks_ge_1MiB":
            statistics.median([r["raw_pattern_bound_ratio"] for r in big]) if big else None,
        "median_over_raw_pattern_chunks_ge_1MiB":
            statistics.median([r["over_raw_pattern"] for r in big]) if big else None,
        "min_speedup_vs_naive": min((r["speedup"] for r in out["vs_naive"]), default=None),
        "min_modeled_speedup_vs_naive": min((r["modeled_speedup"] for r in out["vs_naive"]), default=None),
        "min_emulated_bound_ratio_chunks_ge_1MiB": min(
            (r["bound_ratio"] for r in out.get("emulated", {}).get("spag", []) + out.get("emulated", {}).get("sprs", [])
             if r["chunk_bytes"] >= MiB and r["delta_pairs"] > 0), default=None),
        "min_emulated_speedup_vs_naive": min((r["speedup"] for r in out.get("emulated", {}).get("vs_naive", [])),
                                             default=None),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
