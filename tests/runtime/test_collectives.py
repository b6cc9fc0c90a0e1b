"""SparseAllGather / SparseReduceScatter (§3.2-§3.3) on gloo ranks (their message plans: test_comm_plan.py).

Multi-rank checks are combined into few spawned runs (4 ranks on one node; 8 ranks as 2 nodes × 4;
one run for the timeout). Every rank rebuilds the same seeded placements and chunk contents, so each one
can check what it received against what the owner must have sent.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from themis_compile.cost_model.volume import sparse_all_gather_volume, sparse_reduce_scatter_volume
from themis_compile.planner import Placement, Topology
from themis_compile.runtime.collectives import ChunkLayout, sparse_all_gather, sparse_reduce_scatter
from themis_compile.testing import run_multirank
from tests.runtime.test_comm_plan import SPECS, seeded_placements

GATHER_ONLY_SPEC = [((5,), torch.bool), ((9,), torch.uint8), ((2, 3), torch.int8), ((4,), torch.float32)]


# ============================================================================ shared helpers (per rank)
def _chunk(seed: int, e: int, spec, holder: int = -1) -> list[torch.Tensor]:
    """Deterministic tensors of expert e (holder >= 0: that holder's integer-valued gradient)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + e * 101 + holder + 7)
    out = []
    for shape, dtype in spec:
        if holder >= 0 or not dtype.is_floating_point:
            t = torch.randint(-4, 5, shape, generator=gen).to(dtype) if dtype != torch.bool else \
                torch.randint(0, 2, shape, generator=gen).bool()
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        out.append(t)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_exact(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
        assert torch.equal(_bits(g), _bits(w)), what


def _check_case(rank: int, world: int, topology: Topology, seed: int, num_experts: int, spec_name: str,
                density: float, store_key: str, flat_owned: bool = False, group=None) -> dict:
    """One SpAG + re-materialization SpAG + SpRS round trip; returns this rank's byte counts.
    ``flat_owned``: odd ranks hold their chunks as views into one buffer (`ChunkLayout.empty`), even ranks
    as separate tensors, so senders and receivers differ in which runs they can use without a copy."""
    spec = SPECS[spec_name] if spec_name in SPECS else GATHER_ONLY_SPEC
    shard, placement = seeded_placements(seed, num_experts, world, density)
    layer = f"{store_key}/{spec_name}"
    owned = {int(e): _chunk(seed, int(e), spec) for e in shard.experts_on(rank)}
    if flat_owned and rank % 2:
        for e, ts in owned.items():
            owned[e] = ChunkLayout.from_spec(spec).empty()
            for a, t in zip(owned[e], ts):
                a.copy_(t)
    delta = placement.delta(shard)
    want_E = {int(e) for e in delta.experts_on(rank)}
    psi = ChunkLayout.from_spec(spec).nbytes

    # SpAG: exactly ΔP on this rank, bit-exact.
    handle = sparse_all_gather(owned, shard, placement, topology, group, spec=spec, layer=layer, timeout_s=30)
    got = handle.wait()
    assert set(got) == want_E, (rank, sorted(got), sorted(want_E))
    for e in want_E:
        _assert_bit_exact(got[e], _chunk(seed, e, spec), f"SpAG expert {e} on rank {rank}")
    model = sparse_all_gather_volume(shard, placement, psi, topology)
    plan_vol = handle.volume
    assert plan_vol.recv_bytes_D == model.recv_bytes_D
    assert plan_vol.total_bytes == model.total_bytes == len(delta) * psi
    assert plan_vol.inter_node_bytes == model.inter_node_bytes
    assert plan_vol.node_ingress_bytes_N == model.node_ingress_bytes_N
    assert all(s >= m for s, m in zip(plan_vol.send_bytes_D, model.send_bytes_D))
    assert handle.sent_bytes == plan_vol.send_bytes_D[rank]
    assert handle.recv_bytes == plan_vol.recv_bytes_D[rank] == len(want_E) * psi
    stats = {"spag_sent": handle.sent_bytes, "spag_recv": handle.recv_bytes,
             "spag_inter": handle.inter_node_sent_bytes, "spag_model_inter": model.inter_node_bytes,
             "spag_model_total": model.total_bytes}

    # Re-materialization: the replicas were freed; gather again toward the same P' into reused buffers.
    del got
    reused = {e: [torch.zeros(s, dtype=dt) for s, dt in spec] for e in want_E}
    again = sparse_all_gather(owned, shard, placement, topology, group, spec=spec, layer=layer + "/rm",
                              out=reused, timeout_s=30).wait()
    for e in want_E:
        assert all(a is b for a, b in zip(again[e], reused[e]))
        _assert_bit_exact(again[e], _chunk(seed, e, spec), f"re-materialized expert {e} on rank {rank}")
    if spec_name not in SPECS:
        return stats

    # SpRS: every owner gets the exact sum over all holders (integer-valued grads sum exactly).
    grads = {int(e): _chunk(seed, int(e), spec, holder=rank) for e in placement.experts_on(rank)}
    handle = sparse_reduce_scatter(grads, placement, shard, topology, group, spec=spec, layer=layer, timeout_s=30)
    summed = handle.wait()
    assert set(summed) == set(owned), (rank, sorted(summed), sorted(owned))
    for e in owned:
        want = [sum(ts) for ts in zip(*(_chunk(seed, e, spec, holder=int(d)) for d in placement.holders(e)))]
        want = [w.to(dt) if isinstance(w, torch.Tensor) else torch.zeros(s, dtype=dt)
                for w, (s, dt) in zip(want, spec)]
        _assert_bit_exact(summed[e], want, f"SpRS expert {e} on rank {rank}")
    rs_model = sparse_reduce_scatter_volume(placement, shard, psi, topology)
    assert handle.volume.send_bytes_D == rs_model.send_bytes_D
    assert handle.volume.total_bytes == rs_model.total_bytes == stats["spag_model_total"]
    assert handle.volume.inter_node_bytes == rs_model.inter_node_bytes
    assert handle.volume.node_egress_bytes_N == rs_model.node_egress_bytes_N
    assert handle.sent_bytes == rs_model.send_bytes_D[rank]
    assert handle.recv_bytes == handle.volume.recv_bytes_D[rank]
    stats.update(sprs_sent=handle.sent_bytes, sprs_inter=handle.inter_node_sent_bytes)
    return stats


def _check_float_sums(rank: int, world: int, topology: Topology) -> list[int]:
    """Random fp32 gradients: the sum matches an fp64 reference within the documented bound and is
    bitwise identical when repeated."""
    spec = SPECS["swiglu"]
    shard, placement = seeded_placements(99, 5, world, 0.6)
    grads = {}
    for e in placement.experts_on(rank):
        gen = torch.Generator().manual_seed(1000 * int(e) + rank)
        grads[int(e)] = [torch.randn(s, generator=gen) for s, _ in spec]
    first = sparse_reduce_scatter(grads, placement, shard, topology, layer="fp32").wait()
    second = sparse_reduce_scatter(grads, placement, shard, topology, layer="fp32").wait()
    for e, tensors in first.items():
        holders = [int(d) for d in placement.holders(e)]
        refs, absums = [], []
        for i, (s, _) in enumerate(spec):
            parts = []
            for d in holders:
                gen = torch.Generator().manual_seed(1000 * e + d)
                parts.append([torch.randn(s2, generator=gen) for s2, _ in spec][i].double())
            refs.append(sum(parts))
            absums.append(sum(p.abs() for p in parts))
        eps = torch.finfo(torch.float32).eps
        for t, ref, absum in zip(tensors, refs, absums):
            bound = (len(holders) - 1) * eps * absum + 1e-30
            assert ((t.double() - ref).abs() <= bound).all(), f"expert {e}"
        for a, b in zip(tensors, second[e]):
            assert torch.equal(_bits(a), _bits(b)), "SpRS must be bitwise reproducible"
    # scale: applied once to the owner's sum (a power of two: exactly the scaled sum), new tensors also for
    # experts without replicas, the given gradients untouched.
    before = {e: [g.clone() for g in gs] for e, gs in grads.items()}
    scaled = sparse_reduce_scatter(grads, placement, shard, topology, layer="fp32", scale=0.25).wait()
    assert sorted(scaled) == sorted(first)
    for e, tensors in first.items():
        for a, b, g in zip(tensors, scaled[e], grads[e]):
            assert b is not g
            assert torch.equal(_bits(a * 0.25), _bits(b)), f"scaled SpRS of expert {e}"
    assert all(torch.equal(_bits(a), _bits(b)) for e in grads for a, b in zip(grads[e], before[e]))
    return sorted(first)


def _check_overlap(rank: int, world: int, topology: Topology) -> dict:
    """Rank 1 starts a SpAG whose source (rank 0) joins only after rank 1 has finished compute issued
    after start(): start() cannot have waited for the transfer, and the transfer then completes in the
    background without any further call on rank 1 until its final wait()."""
    store = dist.distributed_c10d._get_default_store()
    spec = [((64, 64), torch.float32)]
    owners = [0, 1, 2, 3][:world]
    shard = Placement.from_owners(owners, world)
    mask = shard.mask.copy()
    mask[0, 1] = True
    placement = Placement(mask)
    owned = {rank: _chunk(5, rank, spec)}
    out = {}
    if rank == 0:
        store.wait(["overlap/computed"])
    handle = sparse_all_gather(owned, shard, placement, topology, spec=spec, layer="overlap")
    if rank == 1:
        started_incomplete = not handle.is_completed()
        x = torch.randn(128, 128)
        for _ in range(20):                          # compute issued between start and wait
            x = torch.tanh(x @ x) * 0.5
        out["started_incomplete"] = started_incomplete
        out["incomplete_after_compute"] = not handle.is_completed()
        out["compute_finite"] = bool(torch.isfinite(x).all())
        store.set("overlap/computed", "1")
        deadline = time.monotonic() + 30
        while not handle.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        out["completed_without_wait"] = handle.is_completed()
        got = handle.wait()
        _assert_bit_exact(got[0], _chunk(5, 0, spec), "overlap expert 0")
    else:
        handle.wait()
    return out


def _run_single_node(rank: int, world: int) -> dict:
    topology = Topology.from_env(world)
    out = {"overlap": _check_overlap(rank, world, topology), "cases": []}
    for seed, E, spec_name, density in [(1, 8, "swiglu", 0.35), (2, 5, "mixed", 0.5), (3, 6, "empty", 0.5),
                                        (4, 7, "gather_only", 0.4), (5, 4, "swiglu", 0.0), (6, 5, "large", 0.5)]:
        out["cases"].append(_check_case(rank, world, topology, seed, E, spec_name, density, f"n1s{seed}"))
    out["float_experts"] = _check_float_sums(rank, world, topology)
    return out


def _run_two_nodes(rank: int, world: int) -> list[dict]:
    topology = Topology.from_env(world)          # LOCAL_WORLD_SIZE=4: 2 nodes × 4
    assert topology.devices_per_node == (4, 4)
    cases = []
    for seed, E, spec_name, density in [(11, 12, "swiglu", 0.3), (12, 6, "mixed", 0.6), (13, 8, "empty", 0.3),
                                        (14, 3, "swiglu", 1.0)]:
        cases.append(_check_case(rank, world, topology, seed, E, spec_name, density, f"n2s{seed}"))
    return cases


def _run_sliced(rank: int, world: int) -> list[dict]:
    """Tiny thresholds: relayed pieces go in several pipeline slices and most segments without copies."""
    from themis_compile.runtime import collectives, comm_plan

    comm_plan._SLICE_BYTES = 16
    comm_plan._ZERO_COPY_BYTES = 24
    comm_plan._BUCKET_BYTES = 100                     # pieces of 720-byte chunks: bucketed and alone
    topology = Topology.from_env(world)
    cases = []
    for seed, E, spec_name, density in [(21, 6, "swiglu", 0.6), (22, 5, "mixed", 0.7), (23, 3, "swiglu", 1.0)]:
        cases.append(_check_case(rank, world, topology, seed, E, spec_name, density, f"sl{seed}",
                                 flat_owned=True))
    shard, placement = seeded_placements(21, 6, world, 0.6)
    plan = collectives.plan_sparse_all_gather(shard, placement, topology, ChunkLayout.from_spec(SPECS["swiglu"]))
    cases.append({"num_slices": plan.num_slices})
    return cases


def _count_temp_receive_buffers(rank: int, world: int, out_separate: bool) -> int:
    """SpAG of one expert to every other rank; returns how many receive runs went through a buffer.
    Its chunk is two tensors and the three pieces are 80 kB each, so the middle piece spans both."""
    from themis_compile.runtime import collectives

    spec = [((100, 300), torch.float32), ((300, 100), torch.float32)]
    shard = Placement.contiguous(world, world)
    everywhere = np.zeros((world, world), dtype=bool)
    everywhere[0] = True
    placement = shard.union(Placement(everywhere))                                 # expert 0 everywhere
    owned = {int(e): _chunk(41, int(e), spec) for e in shard.experts_on(rank)}
    out = {0: [torch.zeros(s, dtype=dt) for s, dt in spec]} if out_separate and rank != 0 else None
    count = 0
    complete = collectives.SparseCollectiveHandle._complete

    def counting(self, posted, *args):
        nonlocal count
        count += len(posted[1])
        return complete(self, posted, *args)

    collectives.SparseCollectiveHandle._complete = counting
    try:
        got = sparse_all_gather(owned, shard, placement, Topology.from_env(world), spec=spec, layer="in-place",
                                out=out, timeout_s=30).wait()
    finally:
        collectives.SparseCollectiveHandle._complete = complete
    if rank != 0:
        _assert_bit_exact(got[0], _chunk(41, 0, spec), f"in-place expert 0 on rank {rank}")
    return count


def _run_subgroup_and_in_place(rank: int, world: int) -> dict:
    """Collectives on a sub-group (ranks 1..3 of 4, group-local ranks, two nodes), and whether receives
    land in place."""
    group = dist.new_group([1, 2, 3])
    out = {"flat": _count_temp_receive_buffers(rank, world, False),
           "separate": _count_temp_receive_buffers(rank, world, True)}
    if rank != 0:
        out["sub"] = _check_case(dist.get_rank(group), 3, Topology([2, 1]), 31, 5, "swiglu", 0.6, "sub",
                                 group=group)
    return out


def _run_batched(rank: int, world: int) -> list[dict]:
    """The path CUDA tensors take (NCCL): each (stage, slice) posted as one `batch_isend_irecv`, run at
    once on the calling thread, waits without a deadline. Driven here on gloo with CPU tensors."""
    from themis_compile.runtime import collectives, comm_plan

    def launch_batched(handle, group, body, device) -> None:
        handle._nccl = True
        handle._run(body)

    collectives._launch = launch_batched
    comm_plan._SLICE_BYTES = 16                         # relayed pieces in slices, as at scale
    topology = Topology.from_env(world)
    return [_check_case(rank, world, topology, seed, E, spec_name, density, f"b{seed}")
            for seed, E, spec_name, density in [(51, 6, "swiglu", 0.6), (52, 5, "mixed", 0.7), (53, 3, "large", 1.0)]]


def _run_missing_rank(rank: int, world: int) -> str:
    """Rank 3 owns an expert everyone needs; it stays alive but never calls the collective. Every other
    rank owns one too, so the waiting ranks also exchange with healthy peers in the same stage (and, the
    owners alike, each gets a piece of rank 3's expert straight from it)."""
    store = dist.distributed_c10d._get_default_store()
    spec = [((4,), torch.float32)]
    shard = Placement.from_owners([3, 0, 1, 2], world)
    placement = Placement.full(4, world)
    if rank == 3:
        store.wait([f"timeout/{r}" for r in range(3)])
        return "absent"
    chunks = {rank + 1: [torch.ones(4)]}
    try:
        sparse_all_gather(chunks, shard, placement, spec=spec, layer="blocks.7.moe", timeout_s=2.0).wait()
        msg = "no error"
    except TimeoutError as exc:
        msg = str(exc)
    store.set(f"timeout/{rank}", "1")
    return msg


# ============================================================================ multi-rank tests
def test_four_ranks_one_node_gather_reduce_overlap() -> None:
    results = run_multirank(_run_single_node, 4, timeout_s=60)
    overlap = results[1]["overlap"]
    assert overlap == {"started_incomplete": True, "incomplete_after_compute": True, "compute_finite": True,
                       "completed_without_wait": True}
    for case in range(6):
        per_rank = [r["cases"][case] for r in results]
        assert sum(s["spag_recv"] for s in per_rank) == per_rank[0]["spag_model_total"]
        assert sum(s["spag_sent"] for s in per_rank) == per_rank[0]["spag_model_total"]
        assert sum(s["spag_inter"] for s in per_rank) == 0
    assert results[0]["cases"][4]["spag_model_total"] == 0          # ΔP = ∅ moves nothing
    assert all(r["cases"][4]["spag_sent"] == r["cases"][4]["spag_recv"] == 0 for r in results)
    owned = sorted(e for r in results for e in r["float_experts"])
    assert owned == list(range(5))


def test_eight_ranks_two_nodes_topology_aware() -> None:
    results = run_multirank(_run_two_nodes, 8, devices_per_node=4, timeout_s=60)
    for case in range(4):
        per_rank = [r[case] for r in results]
        model_inter = per_rank[0]["spag_model_inter"]
        assert sum(s["spag_inter"] for s in per_rank) == model_inter       # Ψ per newly reached node
        assert sum(s["spag_recv"] for s in per_rank) == per_rank[0]["spag_model_total"]
        if "sprs_inter" in per_rank[0]:
            assert sum(s["sprs_inter"] for s in per_rank) == model_inter
    assert results[0][0]["spag_model_inter"] > 0
    # Every expert replicated everywhere: 3 experts enter the other node once each (swiglu Ψ = 720 B).
    assert results[0][3]["spag_model_inter"] == 3 * 720


def test_pipeline_slices_and_zero_copy_runs_stay_exact() -> None:
    results = run_multirank(_run_sliced, 4, devices_per_node=2, timeout_s=60)
    assert results[0][-1]["num_slices"] == 4               # relayed pieces really went in slices
    for case in range(3):
        per_rank = [r[case] for r in results]
        assert sum(s["spag_recv"] for s in per_rank) == per_rank[0]["spag_model_total"]
        assert sum(s["spag_inter"] for s in per_rank) == per_rank[0]["spag_model_inter"]
        assert sum(s["sprs_inter"] for s in per_rank) == per_rank[0]["spag_model_inter"]


def test_batched_posting_of_the_nccl_path_is_exact_on_gloo() -> None:
    results = run_multirank(_run_batched, 4, devices_per_node=2, timeout_s=60)
    for case in range(3):
        per_rank = [r[case] for r in results]
        assert sum(s["spag_recv"] for s in per_rank) == per_rank[0]["spag_model_total"] > 0
        assert sum(s["sprs_inter"] for s in per_rank) == per_rank[0]["spag_model_inter"] > 0


def test_sub_group_and_receives_in_place() -> None:
    results = run_multirank(_run_subgroup_and_in_place, 4, timeout_s=60)
    # Replicas are allocated flat: every piece, also one spanning two tensors, is received in place.
    assert all(r["flat"] == 0 for r in results)
    # Into separate `out` tensors the spanning piece needs a buffer (on each of the three receivers).
    assert sum(r["separate"] for r in results) >= 3
    per_rank = [r["sub"] for r in results[1:]]
    assert sum(s["spag_recv"] for s in per_rank) == per_rank[0]["spag_model_total"] > 0
    assert sum(s["spag_inter"] for s in per_rank) == per_rank[0]["spag_model_inter"] > 0


def test_missing_rank_times_out_naming_collective_and_layer() -> None:
    results = run_multirank(_run_missing_rank, 4, timeout_s=8)
    assert results[3] == "absent"
    for msg in results[:3]:
        assert "SparseAllGather" in msg and "blocks.7.moe" in msg and "timed out" in msg, msg
        assert "with ranks [3" in msg, msg                      # the absent rank first, not the waiting ones


def test_world_size_one_without_process_group() -> None:
    assert not dist.is_initialized()
    spec = SPECS["swiglu"]
    shard = Placement.from_owners([0, 0], 1)
    owned = {0: _chunk(1, 0, spec), 1: _chunk(1, 1, spec)}
    handle = sparse_all_gather(owned, shard, shard, spec=spec, layer="solo")
    assert handle.is_completed() and handle.wait() == {} and handle.sent_bytes == 0
    grads = {0: _chunk(1, 0, spec, holder=0), 1: _chunk(1, 1, spec, holder=0)}
    summed = sparse_reduce_scatter(grads, shard, shard, layer="solo").wait()
    for e in (0, 1):
        assert all(a is b for a, b in zip(summed[e], grads[e]))


def test_bad_input_raises_value_error() -> None:
    with pytest.raises(ValueError, match="shard placement"):
        sparse_all_gather({}, Placement.full(2, 2), Placement.full(2, 2))
    shard = Placement.from_owners([0, 0], 1)
    with pytest.raises(ValueError, match="does not own"):
        sparse_all_gather({5: [torch.zeros(2)]}, shard, shard)
    with pytest.raises(ValueError, match="2 devices but the group has 1"):
        sparse_all_gather({}, Placement.from_owners([0, 1], 2), Placement.full(2, 2))


def test_benchmark_quick_smoke(capsys) -> None:
    from themis_compile.bench import collectives as bench

    out = bench.main(["--quick", "--network", "declared"])
    assert capsys.readouterr().out.strip().startswith("{")
    assert out["link"]["pair_bw"] > 0 and out["link"]["ring_bw"] > 0
    assert "emulated" not in out
    moving = [r for r in out["spag"] + out["sprs"] if r["delta_pairs"] > 0]
    assert moving and all(r["time_s"] > 0 and r["bound_s"] > 0 and r["ring_time_s"] > 0 and r["latency_floor_s"] > 0
                          for r in moving)
    # Raw gloo running the same messages: its own time, its bound ratio, and ours over it, all consistent.
    for r in moving:
        assert r["raw_pattern_time_s"] > 0
        assert abs(r["over_raw_pattern"] - r["time_s"] / r["raw_pattern_time_s"]) < 1e-9
        assert abs(r["raw_pattern_bound_ratio"] - r["bound_s"] / r["raw_pattern_time_s"]) < 1e-9
    assert out["summary"]["median_over_raw_pattern_chunks_ge_1MiB"] is None      # --quick: no chunk >= 1 MiB
    assert out["allocator"].startswith(("glibc keeps", "unchanged"))
    assert all(r["chunk_bytes"] >= 0.0625 * (1 << 20) for r in moving)      # Ψ never below the requested size
    for r in out["vs_naive"]:
        assert r["inter_node_bytes"] * 2 == r["naive_inter_node_bytes"]   # Ψ once per node, not per replica
        assert r["modeled_speedup"] > 1.5


def test_flat_chunks_make_a_run_one_span_without_copy() -> None:
    from themis_compile.runtime.collectives import _span

    layout = ChunkLayout.from_spec(SPECS["swiglu"])
    flat = layout.empty()                                    # offsets suit the dtypes: one buffer
    base = flat[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in flat)
    assert [tuple(t.shape) for t in flat] == list(layout.shapes) and all(t.is_contiguous() for t in flat)
    views = [t.reshape(-1).view(torch.uint8) for t in flat]
    for v in views:
        v.zero_()
    run = [(views[i], lo, hi) for i, lo, hi in layout.segments(100, 500)]     # [100, 240) + 240 + [0, 20)
    assert len(run) == 3
    span = _span(run)
    assert span is not None and span.numel() == 400 and span.data_ptr() == flat[0].data_ptr() + 100
    span.fill_(7)                                            # the span is the chunk's own memory
    assert (views[0][:100] == 0).all() and (views[0][100:] == 7).all() and (views[1] == 7).all()
    assert (views[2][:20] == 7).all() and (views[2][20:] == 0).all()
    assert _span(run[:1]).data_ptr() == views[0].data_ptr() + 100
    # Separate tensors, or a layout whose offsets do not suit its dtypes, need a copy.
    apart = [torch.empty(s, dtype=dt).reshape(-1).view(torch.uint8) for s, dt in SPECS["swiglu"]]
    assert _span([(apart[i], lo, hi) for i, lo, hi in layout.segments(100, 500)]) is None
    mixed = ChunkLayout.from_spec(SPECS["mixed"])
    tensors = mixed.empty()
    assert len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) > 1
    assert [(tuple(t.shape), t.dtype) for t in tensors] == list(zip(mixed.shapes, mixed.dtypes))


def test_collective_device_follows_the_backend_for_cuda(monkeypatch) -> None:
    from themis_compile.runtime import collectives

    assert collectives.collective_device() == torch.device("cpu")          # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for config, device in [("cuda:nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3"), ("cpu:gloo,cuda:gloo", "cpu")]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, c=config: c)
        assert collectives.collective_device() == torch.device(device), config


def test_worker_thread_stops_with_its_group_and_at_shutdown() -> None:
    """The gloo jobs' thread belongs to its process group: destroying the group stops it; so does
    `shutdown_workers` for the live ones."""
    import gc

    from themis_compile.runtime import collectives

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ran = []
        world = collectives._worker_for(dist.group.WORLD)
        world.submit(lambda: ran.append("world"))
        sub_group = dist.new_group([0])
        sub = collectives._worker_for(sub_group)
        assert sub is not world and collectives._worker_for(sub_group) is sub
        assert collectives.shutdown_workers(timeout_s=10.0)
        assert not world.alive and not sub.alive and ran == ["world"]
        fresh = collectives._worker_for(dist.group.WORLD)            # a later collective gets a new thread
        assert fresh is not world and fresh.alive
    finally:
        dist.destroy_process_group()
    del sub_group
    gc.collect()
    deadline = time.monotonic() + 10.0
    while fresh.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not fresh.alive and len(collectives._WORKERS) == 0
