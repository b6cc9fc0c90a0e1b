"""SparseAllGather and SparseReduceScatter (§3.2), asynchronous and topology-aware (§3.3).

``sparse_all_gather(chunks, P, P', topology)`` delivers exactly ΔP = P' \\ P: every device receives a
bit-exact copy of each expert chunk that P' adds to it. ``sparse_reduce_scatter(grads, P', P, topology)``
is its mirror image: every owner receives the sum of its expert's gradient over all devices holding the
expert in P'. Both return a handle at once; ``handle.wait()`` returns the result.

The message plan — which bytes of which expert move from which device to which, in two stages, Ψ
entering each node once (§3.3) — is pure and lives in `runtime/comm_plan.py`, computed identically on
every rank from (P, P', topology, chunk layouts). This module executes it: it posts every stage's
messages, runs them on a background thread per process group (gloo) or on the communicator's stream
(NCCL), sends and receives runs that lie back to back in memory without a copy (`_span`; replicas and
partial sums are allocated as views into one flat buffer per expert, `ChunkLayout.empty`), applies the
deadline, and hands back the results.

Asynchrony: on gloo the stages run on one background thread per process group (FIFO, so collectives
execute in issue order on every rank; ``Work.wait`` releases the GIL, so compute on the main thread
proceeds meanwhile). On NCCL the stages are enqueued at once on the communicator's stream (host
non-blocking; the handle then reports completion as soon as everything is enqueued, and consumers are
ordered after the transfers by the stream, as with any NCCL collective). The p2p messages use a private tag; other collectives on the same group do not interfere,
but a dedicated group (``dist.new_group()``) is the safest choice.

Chunk layout. A chunk is an expert's list of parameter tensors (any dtype/shape mix, zero-size allowed),
e.g. SwiGLU ``[w1, w2, w3]``. Receivers must know it: pass ``spec=[(shape, dtype), ...]`` (the same for
every expert of the layer, or a mapping expert -> spec); when omitted it is derived from a local chunk
(SpAG: an owned chunk; SpRS: any local gradient), which requires that all experts of the layer share one
spec and that a receiving rank holds at least one chunk.

Numerics of SpRS: the owner's result is ``own + Σ_n partial_n`` (then times ``scale``, once) with each
node's partial sum formed in a fixed order (ascending device id) — bitwise reproducible across runs for a
fixed plan. Against a sum in another order it differs by rounding only: |result - exact| ≤
(k-1)·eps·Σ_i |g_i| elementwise for k holders (standard recursive-summation bound; fp32 eps = 2^-23);
integer-valued fp32 gradients sum exactly. A power-of-two ``scale`` (1/W for W = 2, 4, ...) is exact, so
scaling the sum equals summing the scaled copies bit for bit (barring subnormals).

Legend: E experts, D devices (ranks of the group), N nodes.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from themis_compile.cost_model.volume import SPAG, SPRS, CollectiveVolume
from themis_compile.planner.placement import Placement, run_starts
from themis_compile.planner.topology import Topology
from themis_compile.runtime.comm_plan import (
    DIRECT, BoundedCache, ChunkLayout, ChunkSpec, CommPlan, RankPlan, RankSchedule, Run, Segment, Transfer,
    check_placements, layout_of, plan_sparse_all_gather, plan_sparse_reduce_scatter, rank_plan, require_placements,
)

logger = logging.getLogger(__name__)

# The plan's names are re-exported: callers of the collectives build layouts and inspect plans.
__all__ = [
    "ChunkLayout",
    "Transfer",
    "CommPlan",
    "SparseCollectiveHandle",
    "SpAGHandle",
    "SpRSHandle",
    "collective_device",
    "plan_sparse_all_gather",
    "plan_sparse_reduce_scatter",
    "sparse_all_gather",
    "sparse_reduce_scatter",
    "shutdown_workers",
]

_P2P_TAG = 0x7E4D  # private tag of sparse-collective messages (gloo matches p2p by (peer, tag))
DEFAULT_TIMEOUT_S = 300.0


# ============================================================================================ execution
def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (a copy first when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copied when its offset is not aligned)."""
    if buf.storage_offset() % dtype.itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def _span(run: list[Segment]) -> torch.Tensor | None:
    """The run's bytes as one uint8 tensor when they lie back to back in one storage (sent from, or
    received into, without a copy); None when they do not."""
    view, lo, hi = run[0]
    if len(run) == 1:
        return view[lo:hi]
    storage = view.untyped_storage().data_ptr()
    end = view.storage_offset() + hi
    for v, a, b in run[1:]:
        if v.untyped_storage().data_ptr() != storage or v.storage_offset() + a != end:
            return None
        end = v.storage_offset() + b
    start = view.storage_offset() + lo
    return view.as_strided((end - start,), (1,), start)


class _GroupWorker:
    """The thread that runs one process group's CPU (gloo) collective jobs, in issue order.

    Lifetime: it stops when its group is garbage collected (after ``dist.destroy_process_group``, or
    when the last reference to a sub-group goes), at `shutdown_workers`, and at interpreter exit; a job
    already queued runs to completion (or to its collective timeout) first. The thread is a daemon only
    so that a job stuck past its timeout cannot hang the interpreter's exit.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:                    # stop(): every job queued before it has run
                return
            job()
            job = None                         # hold no finished job (and its group) while waiting

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask the thread to finish after the jobs already queued; with ``timeout_s``, wait that long for
        it. Returns whether the thread has ended."""
        self._jobs.put(None)
        if timeout_s is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


# Weakly keyed by the group object itself: a destroyed group's entry goes with it (its finalizer stops
# the thread), and a new group can never inherit an old group's worker through a reused id().
_WORKERS: weakref.WeakKeyDictionary[Any, _GroupWorker] = weakref.WeakKeyDictionary()
_WORKERS_LOCK = threading.Lock()
_AT_EXIT_REGISTERED = False


def _worker_for(group: Any) -> _GroupWorker:
    global _AT_EXIT_REGISTERED
    with _WORKERS_LOCK:
        worker = _WORKERS.get(group)
        if worker is None or not worker.alive:
            worker = _WORKERS[group] = _GroupWorker(f"themis-sparse-collectives-{id(group):x}")
            weakref.finalize(group, worker.stop)
            if not _AT_EXIT_REGISTERED:
                atexit.register(shutdown_workers)
                _AT_EXIT_REGISTERED = True
        return worker


def shutdown_workers(timeout_s: float = 5.0) -> bool:
    """Stop the background threads of every process group's CPU collectives and wait up to
    ``timeout_s`` seconds for each (the jobs already issued run first). Returns whether all ended.

    Called at interpreter exit; a later CPU collective starts a fresh thread for its group.
    """
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    deadline = time.monotonic() + timeout_s
    return all([w.stop(max(0.0, deadline - time.monotonic())) for w in workers])


class SparseCollectiveHandle:
    """An in-flight sparse collective. ``wait()`` returns its result; ``is_completed()`` polls.

    Attributes:
        collective: ``"SparseAllGather"`` or ``"SparseReduceScatter"``.
        layer: the layer name given at the call (for error messages and logs).
        plan: the global `CommPlan` (the same on every rank), built on first use: the collective runs this
            rank's part (`comm_plan.rank_plan`) and never needs the whole.
        volume: the plan's global byte counts (`CollectiveVolume`): what every device sends and receives
            and what crosses node boundaries; equals ``cost_model.volume`` on the fixed side.
        sent_bytes, recv_bytes, inter_node_sent_bytes: what this rank actually put on / took off the wire
            (counted from the message buffers; final after ``wait()``).
    """

    def __init__(self, collective: str, layer: str, plan: RankPlan, rank: int, timeout_s: float,
                 layout_known: bool = True) -> None:
        self.collective = collective
        self._layout_known = layout_known
        self.layer = layer
        self._rank_plan = plan
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.sent_bytes = 0
        self.recv_bytes = 0
        self.inter_node_sent_bytes = 0
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._nccl = False            # set by `_launch`: waits must not block the host on NCCL

    @property
    def volume(self) -> CollectiveVolume:
        """The global byte counts. A rank that holds no chunk and was given no ``spec`` cannot know the
        chunk size: there this raises RuntimeError (pass ``spec=`` to get the numbers everywhere)."""
        if not self._layout_known:
            raise RuntimeError(f"{self._name()}: rank {self.rank} holds no chunk and got no spec, so it does "
                               f"not know the chunk layout; pass spec= to record global volumes here")
        return self.plan.volume()

    @property
    def plan(self) -> CommPlan:
        return self._rank_plan.whole()

    def _name(self) -> str:
        return f"{self.collective} of layer {self.layer!r}" if self.layer else f"{self.collective}"

    def is_completed(self) -> bool:
        """True once the collective has finished on this rank (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until done and return the result; raise TimeoutError/RuntimeError naming the collective
        and layer if it failed or did not finish within ``timeout_s`` (default: the call's timeout plus a
        grace period for the stage that is timing out)."""
        limit = self.timeout_s + 10.0 if timeout_s is None else float(timeout_s)
        if not self._done.wait(limit):
            raise TimeoutError(f"{self._name()} did not complete on rank {self.rank} within {limit:.1f}s")
        if self._error is not None:
            raise self._error
        return self._result

    # ---------------------------------------------------------------------------------- running
    def _run(self, body: Callable[[], Any]) -> None:
        try:
            self._result = body()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting thread
            self._error = exc
            logger.error("%s failed on rank %d: %s", self._name(), self.rank, exc)
        finally:
            self._done.set()

    def _run_stages(self, group: Any, deadline: float, device: torch.device, schedule: RankSchedule,
                    send_view: Callable[[int, Any], torch.Tensor], recv_view: Callable[[Any], torch.Tensor] | None,
                    on_recv: Callable[[Run, torch.Tensor], None]) -> None:
        """Run this rank's part of the plan.

        Order (the same on every rank, so per peer both sides post the same sequence of messages, which
        gloo matches in posting order and NCCL in issue order):

        1. stage 0 of every slice (what relays wait for goes first);
        2. every stage's direct transfers (slice ``DIRECT``: no relay depends on them);
        3. for slice i = 0, 1, ...: once this rank's stage-0 receives of slice i have arrived (and been
           unpacked), stage 1 of slice i — relaying overlaps the rest of stage 0;
        then the remaining receives, and last the sends (their buffers stay alive until then).
        """
        num_stages, num_slices = schedule.num_stages, schedule.num_slices
        pending: list[_Pending] = []

        def post(stage: int, slice_: int) -> tuple[list, list]:
            return self._post(group, stage, slice_, device, schedule, send_view, recv_view, deadline, pending)

        first = [post(0, i) for i in range(num_slices)]
        direct = [(stage, post(stage, DIRECT)) for stage in range(num_stages)]
        later = []
        for i in range(num_slices):
            self._complete(first[i], 0, deadline, on_recv)
            later += [(stage, post(stage, i)) for stage in range(1, num_stages)]
        for stage, posted in direct + later:
            self._complete(posted, stage, deadline, on_recv)
        for p in pending:
            self._wait(p.works, p.stage, deadline)

    def _post(self, group: Any, stage: int, slice_: int, device: torch.device, schedule: RankSchedule,
              send_view: Callable[[int, Any], torch.Tensor], recv_view: Callable[[Any], torch.Tensor] | None,
              deadline: float, pending: list[_Pending]) -> tuple[list[tuple[int, Any]], list]:
        """Post this rank's receives and sends of one (stage, slice) as one batch; sends go to ``pending``.

        Each (src, dst) message travels as the runs of `_runs` (both sides cut the same sizes into the
        same runs). ``send_view(stage, (expert, tensor))`` and ``recv_view((expert, tensor))`` give the
        1-D uint8 view of a tensor the bytes come from or go to (``recv_view=None``: received bytes are
        combined by ``on_recv``, never written in place). A run whose bytes lie back to back there
        travels without a copy (`_span`); others are concatenated, or received into a buffer and unpacked.
        On NCCL one `dist.batch_isend_irecv` per (stage, slice) makes the receives and sends one group, so
        two devices exchanging in both directions cannot block each other.
        Returns the receives and the buffers to unpack once they arrived.
        """
        receives, sends_ = schedule.posts.get((stage, slice_), ((), ()))
        if not receives and not sends_:
            return [], []
        sends = _Pending(stage)
        pending.append(sends)
        received: list = []
        recv_ops: list[tuple[int, torch.Tensor]] = []
        send_ops: list[tuple[int, torch.Tensor]] = []
        for src, runs in receives:
            for run in runs:
                buf = None if recv_view is None else _span([(recv_view(key), lo, hi) for key, lo, hi in run])
                if buf is None:
                    buf = torch.empty(sum(hi - lo for _, lo, hi in run), dtype=torch.uint8, device=device)
                    received.append((len(recv_ops), run, buf))     # unpacked once operation i arrived
                recv_ops.append((src, buf))
                self.recv_bytes += buf.numel()
        for dst, runs, crosses_nodes in sends_:
            for run in runs:
                segs = [(send_view(stage, key), lo, hi) for key, lo, hi in run]
                buf = _span(segs)
                if buf is None:
                    buf = torch.cat([view[lo:hi] for view, lo, hi in segs])
                sends.buffers.append(buf)
                send_ops.append((dst, buf))
                self.sent_bytes += buf.numel()
                if crosses_nodes:
                    self.inter_node_sent_bytes += buf.numel()
        try:
            if self._nccl:
                ops = [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer, tag=_P2P_TAG)
                       for peer, buf in recv_ops]
                ops += [dist.P2POp(dist.isend, buf, group=group, group_peer=peer, tag=_P2P_TAG)
                        for peer, buf in send_ops]
                works = dist.batch_isend_irecv(ops)
            else:
                # gloo has no grouping to do: post on the process group itself, which spares the
                # per-operation argument checks of the functional API (most of a small message's cost).
                pg = group if group is not None else dist.group.WORLD
                works = [pg.recv([buf], peer, _P2P_TAG) for peer, buf in recv_ops]
                works += [pg.send([buf], peer, _P2P_TAG) for peer, buf in send_ops]
        except Exception as exc:  # noqa: BLE001 - re-raised with the collective's and layer's names
            raise self._failure(exc, stage, [p for p, _ in recv_ops + send_ops], deadline) from exc
        if len(works) == len(recv_ops) + len(send_ops):   # one work per operation (gloo)
            recvs = [(peer, w) for (peer, _), w in zip(recv_ops, works)]
            sends.works = [(peer, w) for (peer, _), w in zip(send_ops, works[len(recv_ops):])]
        else:                                          # one work for the whole batch (NCCL)
            first_peer = min(p for p, _ in recv_ops + send_ops)
            recvs = [(first_peer, w) for w in works]
            sends.works = []
        return recvs, received

    def _complete(self, posted: tuple[list[tuple[int, Any]], list], stage: int, deadline: float,
                  on_recv: Callable[[Run, torch.Tensor], None]) -> None:
        """Wait for posted receives; unpack each one that did not land in place as soon as it arrived, so
        that unpacking (in SpRS: summing) overlaps the receives still in flight."""
        recvs, received = posted
        done = 0

        def unpack_through(i: int) -> None:
            nonlocal done
            while done < len(received) and received[done][0] <= i:
                _, run, buf = received[done]
                on_recv(run, buf)
                done += 1

        # On gloo a work per receive, in posting order; on NCCL the batch's works, then everything.
        self._wait(recvs, stage, deadline, None if self._nccl else unpack_through)
        unpack_through(len(received) + len(recvs))

    def _wait(self, works: list[tuple[int, Any]], stage: int, deadline: float,
              after: Callable[[int], None] | None = None) -> None:
        """Wait for ``works`` in order, calling ``after(i)`` once work i is done. On gloo each wait is
        bounded by the deadline; on NCCL ``wait()`` only orders the current stream after the transfer (a
        timeout would block the host), and the process group's own timeout applies."""
        for i, (peer, work) in enumerate(works):
            try:
                if self._nccl:
                    work.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError("the deadline passed")
                    work.wait(timeout=datetime.timedelta(seconds=remaining))
            except Exception as exc:  # noqa: BLE001 - re-raised with the collective's and layer's names
                # The peer whose transfer failed first, then those not waited for yet (gloo reports a
                # point-to-point work as incomplete until it has been waited for).
                waiting = [peer] + [p for p, _ in works[i + 1:] if p != peer]
                raise self._failure(exc, stage, waiting, deadline) from exc
            if after is not None:
                after(i)

    def _failure(self, exc: BaseException, stage: int, peers: list[int], deadline: float) -> Exception:
        """The error to raise for ``exc``: names the collective, the layer, the stage and the peers."""
        unique = list(dict.fromkeys(peers))
        timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() \
            or time.monotonic() >= deadline
        kind = TimeoutError if timed_out else RuntimeError
        what = f"timed out after {self.timeout_s:.1f}s" if timed_out else "failed"
        return kind(f"{self._name()} {what} on rank {self.rank}: stage {stage} was still exchanging "
                    f"with ranks {unique} ({exc}); after a timeout the process group is unusable "
                    f"(gloo closes its connections) and must be rebuilt")


@dataclass
class _Pending:
    """Sends of one stage still in flight, and the buffers they read."""

    stage: int
    works: list[tuple[int, Any]] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)


def _group_rank_and_size(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: Any = None) -> torch.device:
    """The device a group's collectives take their tensors on: the current CUDA device where the group
    runs NCCL for CUDA tensors (``init_process_group("nccl")``, ``"cpu:gloo,cuda:nccl"``, or no backend
    named on a CUDA machine), else the CPU."""
    if not dist.is_available() or not dist.is_initialized():
        return torch.device("cpu")
    try:
        config = str(dist.get_backend_config(group))    # e.g. "cuda:nccl" or "cpu:gloo,cuda:nccl"
    except Exception:  # noqa: BLE001 - older or custom groups: the backend's name
        config = str(dist.get_backend(group))
    if "nccl" in config.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_device(group: Any, local: Mapping[int, Sequence[torch.Tensor]]) -> torch.device:
    for ts in local.values():
        for t in ts:
            return t.device
    return collective_device(group)


def _resolve_layouts(spec: ChunkSpec | Mapping[int, ChunkSpec] | None, num_experts: int,
                     local: Mapping[int, Sequence[torch.Tensor]], needed: bool, what: str
                     ) -> ChunkLayout | list[ChunkLayout] | None:
    if spec is None:
        if not local:
            if needed:
                raise ValueError(f"{what}: this rank holds no chunk to derive the chunk layout from; "
                                 f"pass spec=[(shape, dtype), ...]")
            return None
        return ChunkLayout.of(local[min(local)])
    if isinstance(spec, Mapping):
        missing = [e for e in range(num_experts) if e not in spec]
        if missing:
            raise ValueError(f"{what}: spec mapping lacks experts {missing}")
        return [ChunkLayout.from_spec(spec[e]) for e in range(num_experts)]
    return ChunkLayout.from_spec(spec)


@dataclass(frozen=True)
class _Local:
    """What a placement pair means for one rank, computed once per (P, P', topology, rank) and cached.

    Attributes:
        owners_E: [E] the owner of every expert in P.
        added_E: experts P' adds on this rank (SpAG receives them; in SpRS they are its replicas).
        replicated_E: experts this rank owns that P' replicates (SpAG sends them; SpRS sums into them).
        holds_E: experts this rank holds in P'.
    """

    owners_E: np.ndarray         # read-only (the shard placement's own array: cached entries stay small)
    added_E: tuple[int, ...]
    replicated_E: tuple[int, ...]
    holds_E: frozenset[int]


# Bounded like the plan cache, and for the same reason: one entry per placement pair and rank.
_LOCAL_CACHE = BoundedCache(256)


def _common(shard: Placement, placement: Placement, topology: Topology | None, group: Any, what: str
            ) -> tuple[Topology, int, _Local]:
    """(topology, rank, this rank's `_Local`) after checking the placements against each other and the
    group; the checks run once per placement pair (a cached pair passed them)."""
    rank, world = _group_rank_and_size(group)
    require_placements(shard, placement)
    if topology is None:
        topology = _single_node(shard.num_devices)
    # Keyed by digests, not the placements: an entry must not keep a P' mask alive (64 MB at 4,096 ranks).
    key = (shard.digest(), placement.digest(), topology.devices_per_node, rank, world)
    local = _LOCAL_CACHE.get(key)
    if local is not None:
        return topology, rank, local
    check_placements(shard, placement, topology)
    if shard.num_devices != world:
        raise ValueError(f"{what}: placements span {shard.num_devices} devices but the group has {world} ranks")
    # From the pairs: O(E + |ΔP|), no [E, D] matrix.
    D = shard.num_devices
    owners = shard.owners()
    expert_X, device_X = np.divmod(placement.added_over(shard), D)
    replicated_E = expert_X[run_starts(expert_X)]
    added_E = expert_X[device_X == rank]
    owned_E = np.flatnonzero(owners == rank)
    local = _Local(owners, tuple(added_E.tolist()),
                   tuple(replicated_E[owners[replicated_E] == rank].tolist()),
                   frozenset(owned_E.tolist()) | frozenset(added_E.tolist()))
    _LOCAL_CACHE.put(key, local)
    return topology, rank, local


@functools.lru_cache(maxsize=64)
def _single_node(num_devices: int) -> Topology:
    """The default topology (one node), made once per size."""
    return Topology.single_node(num_devices)


# ============================================================================================ SpAG
class SpAGHandle(SparseCollectiveHandle):
    """Handle of `sparse_all_gather`; ``wait()`` -> {expert: [tensors]} for ΔP on this rank."""


def sparse_all_gather(chunks: Mapping[int, Sequence[torch.Tensor]], shard: Placement, placement: Placement,
                      topology: Topology | None = None, group: Any = None, *, spec: ChunkSpec | None = None,
                      layer: str = "", out: Mapping[int, Sequence[torch.Tensor]] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> SpAGHandle:
    """Start SpAG(P=shard, P'=placement) (§3.2): materialize the replicas ΔP = P' \\ P.

    Args:
        chunks: for every expert this rank owns in ``shard`` (at least those with added replicas), its list
            of parameter tensors. They must not be modified before ``wait()`` returns.
        shard: the shard placement P (one owner per expert).
        placement: the ephemeral placement P' ⊇ P.
        topology: nodes of the group's ranks; ``None`` = one node.
        group: the process group (default: the world). Every rank of it must call this, in the same order
            as other sparse collectives on the group. On NCCL, one operation involving every rank must have
            run on the group before (e.g. an all-reduce), as torch's batched point-to-point operations need.
        spec: the chunk layout ``[(shape, dtype), ...]`` (or expert -> layout); default: derived from a local
            chunk (see module docstring).
        layer: a name for errors and logs.
        out: optional preallocated destination tensors per received expert (reused across
            re-materializations); missing experts are allocated.
        timeout_s: a rank that does not arrive makes the others raise TimeoutError after this long.

    Returns:
        A handle whose ``wait()`` returns ``{expert: [tensor, ...]}`` with bit-exact copies of every expert
        P' adds to this rank (and nothing else). Tensors allocated here are views into one buffer per expert
        (`ChunkLayout.empty`): they share a storage, and freeing one storage frees the expert's chunk.
    """
    topology, rank, local = _common(shard, placement, topology, group, SPAG)
    owners_E, receives_E, sends_E = local.owners_E, local.added_E, local.replicated_E
    missing = [e for e in sends_E if e not in chunks]
    if missing:
        raise ValueError(f"{SPAG} of layer {layer!r}: rank {rank} owns experts {missing} that P' replicates "
                         f"but `chunks` lacks them")
    not_owned = [e for e in chunks if not (0 <= int(e) < shard.num_experts) or owners_E[int(e)] != rank]
    if not_owned:
        raise ValueError(f"{SPAG} of layer {layer!r}: `chunks` holds experts {not_owned} that rank {rank} "
                         f"does not own in P")
    layouts = _resolve_layouts(spec, shard.num_experts, chunks, bool(receives_E), f"{SPAG} of layer {layer!r}")
    layout_known = layouts is not None
    if layouts is None:       # this rank neither sends nor receives: any layout gives it an empty plan
        layouts = ChunkLayout.from_spec([])
    for e in sends_E:
        layout_of(layouts, e).check(chunks[e], f"{SPAG} of layer {layer!r}: chunk of expert {e}")
    plan = rank_plan(SPAG, shard, placement, topology, layouts, rank)
    handle = SpAGHandle(SPAG, layer, plan, rank, timeout_s, layout_known)

    # Step 1: destination tensors for every expert P' adds here (allocated now: zero-size ones are done).
    result: dict[int, list[torch.Tensor]] = {}
    device = _default_device(group, chunks)
    for e in receives_E:
        layout = layout_of(layouts, e)
        if out is not None and e in out:
            dst = list(out[e])
            layout.check(dst, f"{SPAG} of layer {layer!r}: out[{e}]")
            if not all(t.is_contiguous() for t in dst):
                raise ValueError(f"{SPAG} of layer {layer!r}: out[{e}] tensors must be contiguous")
        else:
            dst = layout.empty(device)
        result[e] = dst
    schedule = plan.schedule
    if not schedule.posts:
        handle._result = result
        handle._done.set()
        return handle
    src_bytes = {e: [_flat_bytes(t) for t in chunks[e]] for e in sends_E}
    dst_bytes = {e: [t.reshape(-1).view(torch.uint8) for t in ts] for e, ts in result.items()}

    def view(key: tuple[int, int]) -> torch.Tensor:
        e, i = key
        return src_bytes[e][i] if e in src_bytes else dst_bytes[e][i]

    def on_recv(run: Run, buf: torch.Tensor) -> None:
        pos = 0
        for key, lo, hi in run:
            view(key)[lo:hi].copy_(buf[pos:pos + hi - lo])
            pos += hi - lo

    deadline = time.monotonic() + handle.timeout_s

    def body() -> dict[int, list[torch.Tensor]]:
        handle._run_stages(group, deadline, device, schedule, lambda stage, key: view(key), view, on_recv)
        return result

    _launch(handle, group, body, device)
    return handle


def _launch(handle: SparseCollectiveHandle, group: Any, body: Callable[[], Any], device: torch.device) -> None:
    """Run ``body`` (the rank's stages): on CPU tensors (gloo) on the group's background thread; on device
    tensors (NCCL) at once, batched and enqueued on the communicator's stream."""
    if logger.isEnabledFor(logging.DEBUG):
        schedule = handle._rank_plan.schedule
        logger.debug("%s: rank %d starts %d stage(s), %d message(s) of its own", handle._name(), handle.rank,
                     schedule.num_stages, sum(len(r) + len(s) for r, s in schedule.posts.values()))
    if device.type != "cpu":
        handle._nccl = True
        handle._run(body)                      # enqueued on the NCCL stream; the host does not block
    else:
        pg = group if group is not None else dist.group.WORLD
        _worker_for(pg).submit(lambda: handle._run(body))


# ============================================================================================ SpRS
class SpRSHandle(SparseCollectiveHandle):
    """Handle of `sparse_reduce_scatter`; ``wait()`` -> {owned expert: [summed gradient tensors]}."""


def sparse_reduce_scatter(grads: Mapping[int, Sequence[torch.Tensor]], placement: Placement, shard: Placement,
                          topology: Topology | None = None, group: Any = None, *, spec: ChunkSpec | None = None,
                          layer: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, scale: float = 1.0) -> SpRSHandle:
    """Start SpRS(P'=placement, P=shard) (§3.2): sum every expert's gradient into its owner.

    Args:
        grads: this rank's gradient tensors for every expert it holds in P' — the replicas ΔP on this rank
            and its own shard's experts (those with replicas at least). Not modified; must not be modified
            before ``wait()`` returns.
        placement, shard: P' ⊇ P and the shard placement P.
        topology, group, spec, layer, timeout_s: as in `sparse_all_gather` (the layout defaults to that of a
            local gradient).
        scale: every owner's result is multiplied by it, once, after the sum (the holders send their
            gradients unscaled): ``scale * (own + Σ partial sums)``, e.g. 1/world size for the gradient of a
            mean loss at the cost of one pass over the owner's sums instead of one over every copy.

    Returns:
        A handle whose ``wait()`` returns, for every expert this rank owns that appears in ``grads``, the
        sum of its gradient over all holders in P' **including the owner's own gradient**, times ``scale``
        (for replicated experts new tensors, views into one buffer per expert as in `sparse_all_gather`;
        for experts without replicas the given tensors themselves when ``scale`` is 1, else new tensors,
        ``g * scale``). Non-owners get {}.
    """
    topology, rank, local = _common(shard, placement, topology, group, SPRS)
    owners_E, holds_E, owned_rep_E, replica_E = local.owners_E, local.holds_E, local.replicated_E, local.added_E
    missing = [e for e in (*owned_rep_E, *replica_E) if e not in grads]
    if missing:
        raise ValueError(f"{SPRS} of layer {layer!r}: rank {rank} holds experts {missing} in P' "
                         f"(replicated or replicas) but `grads` lacks them")
    extra = [e for e in grads if int(e) not in holds_E]
    if extra:
        raise ValueError(f"{SPRS} of layer {layer!r}: `grads` holds experts {extra} that rank {rank} does "
                         f"not hold in P'")
    layouts = _resolve_layouts(spec, shard.num_experts, grads, bool(owned_rep_E or replica_E),
                               f"{SPRS} of layer {layer!r}")
    layout_known = layouts is not None
    if layouts is None:       # this rank holds nothing: any layout gives it an empty plan
        layouts = ChunkLayout.from_spec([])
    for e in (*owned_rep_E, *replica_E):
        layout = layout_of(layouts, e)
        layout.check(grads[e], f"{SPRS} of layer {layer!r}: gradient of expert {e}")
        if any(dt == torch.bool for dt in layout.dtypes):
            raise ValueError(f"{SPRS} of layer {layer!r}: cannot sum bool gradients of expert {e}")
    plan = rank_plan(SPRS, shard, placement, topology, layouts, rank)
    handle = SpRSHandle(SPRS, layer, plan, rank, timeout_s, layout_known)

    # Owned experts without replicas are already complete.
    result: dict[int, list[torch.Tensor]] = {int(e): [t * scale for t in g] if scale != 1.0 else list(g)
                                              for e, g in grads.items()
                                              if owners_E[int(e)] == rank and int(e) not in owned_rep_E}
    schedule = plan.schedule
    if not schedule.posts:
        for e in owned_rep_E:               # zero-size chunks: nothing to add
            result[e] = [g * scale if scale != 1.0 else g.clone() for g in grads[e]]
        handle._result = result
        handle._done.set()
        return handle

    # Step 1: accumulators: the owner's result (its own gradient, to which the others are added) and, on
    # a replica that combines a piece for its node, that piece of its own gradient (the rest of the
    # buffer is never read). They are flat (`ChunkLayout.empty`), so a partial sum spanning several
    # tensors leaves without a copy.
    # They are filled from the own gradient when the first contribution arrives (`fill`), not before
    # the first messages leave: off the path of the transfers.
    device = _default_device(group, grads)
    src_bytes = {e: [_flat_bytes(g) for g in grads[e]] for e in replica_E}
    pieces_E = {e: ranges for e, ranges in schedule.first_stage_ranges.items() if e not in owned_rep_E}
    acc = {e: layout_of(layouts, e).empty(device) for e in (*owned_rep_E, *pieces_E)}
    acc_flat = {e: [a.reshape(-1) for a in ts] for e, ts in acc.items()}
    acc_bytes = {e: [a.view(torch.uint8) for a in ts] for e, ts in acc_flat.items()}
    unfilled = set(acc)

    def fill(e: int) -> None:
        unfilled.discard(e)
        if e in pieces_E:
            for i, lo, hi in pieces_E[e]:
                acc_bytes[e][i][lo:hi].copy_(src_bytes[e][i][lo:hi])
        else:
            for a, g in zip(acc[e], grads[e]):
                a.copy_(g.detach())

    def send_view(stage: int, key: tuple[int, int]) -> torch.Tensor:
        e, i = key
        last = stage == schedule.num_stages - 1       # the gather to the owners sends partial sums
        return acc_bytes[e][i] if last and e in acc else src_bytes[e][i]

    def on_recv(run: Run, buf: torch.Tensor) -> None:
        pos = 0
        for (e, i), lo, hi in run:
            if e in unfilled:
                fill(e)
            dt = layout_of(layouts, e).dtypes[i]
            acc_flat[e][i][lo // dt.itemsize:hi // dt.itemsize].add_(_typed(buf[pos:pos + hi - lo], dt))
            pos += hi - lo

    deadline = time.monotonic() + handle.timeout_s

    def body() -> dict[int, list[torch.Tensor]]:
        handle._run_stages(group, deadline, device, schedule, send_view, None, on_recv)
        for e in list(unfilled):             # an owner that received nothing for e (zero-size pieces)
            fill(e)
        for e in owned_rep_E:
            if scale != 1.0:
                for a in acc[e]:
                    a.mul_(scale)
            result[e] = acc[e]
        return result

    _launch(handle, group, body, device)
    return handle
