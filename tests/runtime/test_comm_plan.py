"""The message plans of SparseAllGather / SparseReduceScatter (`runtime/comm_plan.py`): pure, no processes.

The plan's volume equals the closed-form §3.3 model, pieces cover every chunk once at element
boundaries, relays stay inside nodes, and plans and per-rank schedules are cached by content and by the
cutting constants. `test_collectives.py` runs the plans on gloo ranks.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from themis_compile.cost_model.volume import sparse_all_gather_volume, sparse_reduce_scatter_volume
from themis_compile.planner import Placement, Topology
from themis_compile.runtime import comm_plan
from themis_compile.runtime.comm_plan import ChunkLayout, plan_sparse_all_gather, plan_sparse_reduce_scatter

# Chunk specs: SwiGLU experts (three matrices), a dtype/shape mix with zero-size and 0-dim tensors, and
# experts whose chunks are empty.
SPECS = {
    "swiglu": [((6, 10), torch.float32), ((10, 6), torch.float32), ((6, 10), torch.float32)],
    "mixed": [((3, 5), torch.bfloat16), ((7,), torch.float32), ((0, 4), torch.float32), ((), torch.float64),
              ((5,), torch.int64), ((3,), torch.float16)],
    "empty": [((0, 3), torch.float32), ((0,), torch.int64)],
    # Tensors over 1 MiB travel as their own messages, without copies; the small ones between them are
    # bucketed (runtime.comm_plan._runs).
    "large": [((300, 1000), torch.float32), ((7,), torch.bfloat16), ((3,), torch.float32), ((1, 270_000), torch.float32)],
}


def seeded_placements(seed: int, num_experts: int, num_devices: int, density: float) -> tuple[Placement, Placement]:
    """(P, P' ⊇ P): random owners, then each (expert, device) pair added with probability ``density``."""
    rng = np.random.default_rng(seed)
    shard = Placement.from_owners(rng.integers(0, num_devices, size=num_experts), num_devices)
    extra_ED = rng.random((num_experts, num_devices)) < density
    return shard, shard.union(Placement(extra_ED))


@st.composite
def _cases(draw):
    dpn = draw(st.sampled_from([(1,), (4,), (2, 2), (4, 4), (3, 2, 1)]))
    D = sum(dpn)
    E = draw(st.integers(1, 10))
    owners = draw(st.lists(st.integers(0, D - 1), min_size=E, max_size=E))
    extra = draw(st.lists(st.booleans(), min_size=E * D, max_size=E * D))
    spec = draw(st.sampled_from(list(SPECS.values())))
    shard = Placement.from_owners(owners, D)
    placement = shard.union(Placement(np.array(extra).reshape(E, D)))
    return Topology(dpn), shard, placement, spec


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_plan_matches_volume_model(case) -> None:
    topology, shard, placement, spec = case
    layout = ChunkLayout.from_spec(spec)
    plan = plan_sparse_all_gather(shard, placement, topology, layout)
    vol, model = plan.volume(), sparse_all_gather_volume(shard, placement, layout.nbytes, topology)
    assert vol.recv_bytes_D == model.recv_bytes_D
    assert vol.total_bytes == model.total_bytes
    assert vol.inter_node_bytes == model.inter_node_bytes
    assert vol.node_ingress_bytes_N == model.node_ingress_bytes_N
    assert all(a >= b for a, b in zip(vol.send_bytes_D, model.send_bytes_D))
    assert all(a >= b for a, b in zip(vol.node_egress_bytes_N, model.node_egress_bytes_N))
    assert len(plan.stages) <= 2
    # Every received chunk is covered exactly once, by element-aligned pieces.
    cover: dict[tuple[int, int], list[tuple[int, int]]] = {}
    owners = shard.owners()
    holders_after_stage0 = set()
    for s, stage in enumerate(plan.stages):
        for t in stage:
            assert t.nbytes > 0 and t.src != t.dst
            assert layout.snap(t.start) == t.start and layout.snap(t.stop) == t.stop
            if s == 0:
                assert t.src == owners[t.expert]
                holders_after_stage0.add((t.expert, t.dst, t.start))
            else:
                assert (t.expert, t.src, t.start) in holders_after_stage0      # relays what it got
                assert topology.node_of(t.src) == topology.node_of(t.dst)      # fan-out inside the node
            cover.setdefault((t.expert, t.dst), []).append((t.start, t.stop))
    for (e, d), ranges in cover.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.nbytes
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    rs = plan_sparse_reduce_scatter(placement, shard, topology, layout).volume()
    rs_model = sparse_reduce_scatter_volume(placement, shard, layout.nbytes, topology)
    assert rs.send_bytes_D == rs_model.send_bytes_D and rs.inter_node_bytes == rs_model.inter_node_bytes
    assert rs.node_egress_bytes_N == rs_model.node_egress_bytes_N


def test_plan_balances_relay_load() -> None:
    # Device 0 owns three experts replicated on devices 1..3 and also receives expert 3 from device 1.
    shard = Placement.from_owners([0, 0, 0, 1], 4)
    placement = Placement.full(4, 4)
    layout = ChunkLayout.from_spec([((1000,), torch.float32)])
    vol = plan_sparse_all_gather(shard, placement, Topology.single_node(4), layout).volume()
    # Device 0 must send each of its three chunks once (3Ψ); piece sizes keep it from relaying more.
    assert vol.send_bytes_D[0] == 3 * 4000
    assert max(vol.send_bytes_D) <= 3 * 4000 + 4000
    assert vol.recv_bytes_D == (4000, 12000, 16000, 16000)


def test_empty_delta_and_zero_size_chunks_plan_nothing() -> None:
    shard = Placement.contiguous(4, 4)
    topo = Topology.uniform(2, 2)
    assert plan_sparse_all_gather(shard, shard, topo, ChunkLayout.from_spec(SPECS["swiglu"])).stages == ()
    assert plan_sparse_all_gather(shard, Placement.full(4, 4), topo,
                                  ChunkLayout.from_spec(SPECS["empty"])).stages == ()


def test_layout_snaps_to_element_boundaries() -> None:
    layout = ChunkLayout.from_spec(SPECS["mixed"])
    assert layout.offsets[:3] == (0, 30, 58)
    assert layout.snap(31) == 30 and layout.snap(33) == 34 and layout.snap(1) == 0
    assert layout.segments(28, 62) == [(0, 28, 30), (1, 0, 28), (3, 0, 4)]


def test_schedule_cache_follows_the_cutting_constants(monkeypatch) -> None:
    layout = ChunkLayout.from_spec(SPECS["swiglu"])
    shard = Placement.contiguous(4, 4)
    plan = plan_sparse_all_gather(shard, Placement.full(4, 4), Topology([2, 2]), layout)

    def runs() -> int:
        return sum(len(r) for recv, send in comm_plan.rank_schedule(plan, layout, 0).posts.values()
                   for _, r, *_ in (*recv, *send))
    bucketed = runs()
    monkeypatch.setattr(comm_plan, "_BUCKET_BYTES", 1)        # every transfer its own runs
    apart = runs()
    monkeypatch.setattr(comm_plan, "_ZERO_COPY_BYTES", 1)     # every segment alone
    alone = runs()
    assert bucketed < apart < alone
    assert comm_plan.rank_schedule(plan, layout, 0) is comm_plan.rank_schedule(plan, layout, 0)


def test_runs_cut_at_large_transfers_and_segments_and_bucket_small_transfers() -> None:
    big, mid = comm_plan._ZERO_COPY_BYTES, comm_plan._BUCKET_BYTES
    message = [[("a", 0, 10)], [("b", 0, 20), ("c", 0, 5)],          # small transfers share one run
               [("d", 0, mid), ("e", 0, 8)],                          # a transfer of its own
               [("f", 0, 3)],
               [("g", 0, 10), ("h", 0, big), ("i", 0, 7)],           # its large segment travels alone
               [("j", 1, 2)]]
    assert [[s[0] for s in run] for run in comm_plan._runs(message)] == \
        [["a", "b", "c"], ["d", "e"], ["f"], ["g"], ["h"], ["i"], ["j"]]
    assert comm_plan._runs([]) == []
    # The "large" spec of the exactness cases really has segments above the threshold.
    layout = ChunkLayout.from_spec(SPECS["large"])
    assert sum(hi - lo >= big for _, lo, hi in layout.segments(0, layout.nbytes)) == 2


def test_only_relayed_pieces_are_sliced_and_a_lone_new_holder_is_direct() -> None:
    topology = Topology([2, 2])
    shard = Placement.from_owners([0, 1], 4)
    mask = shard.mask.copy()
    mask[0, [2, 3]] = True          # expert 0 reaches both devices of node 1: scatter, then relay
    mask[1, 0] = True               # expert 1 reaches one device of its own node: a whole chunk
    big = ChunkLayout.from_spec([((3 * comm_plan._SLICE_BYTES // 4,), torch.float32)])   # Ψ = 3 slices' worth
    plan = plan_sparse_all_gather(shard, Placement(mask), topology, big)
    stage0, stage1 = plan.stages
    direct = [t for t in stage0 if t.slice == comm_plan.DIRECT]
    assert [(t.src, t.dst, t.expert, t.stop - t.start) for t in direct] == [(1, 0, 1, big.nbytes)]
    relayed = [t for t in stage0 if t.expert == 0]
    assert {t.slice for t in relayed} == {0} and all(t.slice >= 0 for t in stage1)   # 1.5 MiB pieces: 1 slice
    assert plan.num_slices == 1 and sum(t.nbytes for t in relayed) == big.nbytes


def test_plan_caches_are_keyed_by_content_and_bounded(monkeypatch) -> None:
    """Equal placements built afresh find the cached plans (SpAG and its SpRS mirror); other contents get
    other plans, never a stale one; the cache never holds more than its bound."""
    layout = ChunkLayout.from_spec(SPECS["swiglu"])
    topo = Topology([2, 2])

    def fresh(owners: list[int], extra: tuple[int, int]) -> tuple[Placement, Placement]:
        shard = Placement.from_owners(owners, 4)
        mask = shard.mask.copy()
        mask[extra] = True
        return shard, Placement(mask)

    spag = plan_sparse_all_gather(*fresh([0, 1, 2, 3], (0, 3)), topo, layout)
    sprs = plan_sparse_reduce_scatter(*reversed(fresh([0, 1, 2, 3], (0, 3))), topo, layout)
    assert plan_sparse_all_gather(*fresh([0, 1, 2, 3], (0, 3)), topo, layout) is spag
    assert plan_sparse_reduce_scatter(*reversed(fresh([0, 1, 2, 3], (0, 3))), topo, layout) is sprs
    other = plan_sparse_reduce_scatter(*reversed(fresh([0, 1, 2, 3], (1, 3))), topo, layout)
    # The replica of expert e on device 3 sends its gradient to e's owner e: each plan its own content.
    assert {(t.src, t.dst, t.expert) for stage in sprs.stages for t in stage} == {(3, 0, 0)}
    assert {(t.src, t.dst, t.expert) for stage in other.stages for t in stage} == {(3, 1, 1)}
    monkeypatch.setattr(comm_plan, "_PLAN_CACHE", comm_plan.BoundedCache(3))
    for d in range(4):
        plan_sparse_all_gather(*fresh([0, 1, 2, 3], (0, d)), topo, layout)
    assert len(comm_plan._PLAN_CACHE) == 3
    assert comm_plan._PLAN_CACHE.get(comm_plan._plan_key(
        "SparseAllGather", *fresh([0, 1, 2, 3], (0, 0)), topo, [layout] * 4)) is None    # the oldest went


@settings(max_examples=40, deadline=None)
@given(_cases(), st.booleans())
def test_a_ranks_own_plan_is_its_part_of_the_whole(case, per_expert_layouts) -> None:
    """`rank_plan` plans one rank's groups alone; its schedule equals that rank's cut of the whole plan,
    for SpAG and SpRS, stage count included, on every rank."""
    topology, shard, placement, spec = case
    layout = ChunkLayout.from_spec(spec)
    layouts = [ChunkLayout.from_spec(SPECS[name]) for name in ("swiglu", "mixed", "empty") * 4][:shard.num_experts] \
        if per_expert_layouts else layout
    spag = plan_sparse_all_gather(shard, placement, topology, layouts)
    sprs = plan_sparse_reduce_scatter(placement, shard, topology, layouts)
    for rank in range(shard.num_devices):
        for collective, whole in (("SparseAllGather", spag), ("SparseReduceScatter", sprs)):
            mine = comm_plan.rank_plan(collective, shard, placement, topology, layouts, rank)
            assert mine.schedule.posts == comm_plan.rank_schedule(whole, layouts, rank).posts
            assert mine.schedule.first_stage_ranges == comm_plan.rank_schedule(whole, layouts, rank).first_stage_ranges
            assert mine.num_stages == len(whole.stages)
            assert mine.whole() is whole


def test_a_ranks_own_plan_reads_no_dense_placement() -> None:
    """At 1,024 ranks the plan of one rank is made from the pairs: neither placement builds its [E, D]
    matrix, and the rank's schedule holds only its own peers."""
    D, E = 1024, 4096
    rng = np.random.default_rng(0)
    owners = rng.integers(0, D, size=E)
    shard = Placement.from_owners(owners, D)
    added = np.unique(rng.integers(0, 64, size=2 * D) * D + rng.integers(0, D, size=2 * D))
    added = added[added % D != owners[added // D]]
    placement = Placement.from_pairs(np.union1d(shard.flat_ids(), added), E, D)
    topology = Topology.uniform(D // 8, 8)
    layout = ChunkLayout.from_spec(SPECS["swiglu"])
    for collective in ("SparseAllGather", "SparseReduceScatter"):
        plan = comm_plan.rank_plan(collective, shard, placement, topology, layout, 5)
        peers = {peer for receives, sends in plan.schedule.posts.values() for peer, *_ in (*receives, *sends)}
        assert 0 < len(peers) < 64
    assert shard.is_sparse and placement.is_sparse
