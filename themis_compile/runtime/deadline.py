"""Deadlines for the library's collectives: a rank that stops participating fails the others, by name.

Every collective themis_compile issues besides the sparse collectives (which keep their own deadline,
`runtime/collectives.py`) goes through this module: the token-count exchange and the all-to-alls of the
token exchange, forward and backward (`runtime/exchange.py`), the routing and router-output flags
(`runtime/ep.py`, `runtime/fssdp.py`), the count all-reduce of a block's ``global_tokens_per_expert``
(`api.py`), plan digests, budget and profile exchanges (`runtime/budgets.py`, `runtime/profiling.py`),
the re-sharding gathers (`runtime/reshard.py`) and the DDP replica check (`runtime/replicas.py`).

Contract:
  - The normal case costs nothing: a call here is the collective torch would run, posted with
    ``async_op=True`` and waited for with a bound. No extra message, no store access; per call one
    counter increment (and, for device-async calls on NCCL, one CUDA event).
  - A collective that has not completed ``timeout_s`` after it was posted raises `CollectiveTimeoutError`
    on every rank waiting in it. The message names the collective, its purpose, the MoE layer and the
    ranks that did not participate, e.g. ``themis_compile: all_to_all (token combine, backward) of MoE
    layer 'blocks.1.moe' timed out after 5.0 s on rank 0: rank 1 did not participate (ranks [0, 2] were
    waiting in it)``. A collective that fails otherwise (a peer died) raises `CollectiveError` naming the
    same. Either way the process group is unusable afterwards (gloo has closed its connections or still
    holds the half-done operation; an NCCL communicator is stuck) and must be rebuilt.

How the missing ranks are named (the failure path only):
  1. Every rank numbers the calls of this module per process group; ranks that follow the same path give
     the same call the same number.
  2. A rank whose wait passes ``timeout_s - grace`` appends ``(its rank, call number, collective)`` to
     one key per process group in the rendezvous store (the default store, which every rank reaches).
  3. It reads the key back at ``timeout_s`` (after the grace) and raises: ranks that reported the same call
     arrived; ranks that reported another call are named with the collective they wait in instead; the
     others did not participate. [grace = min(2 s, timeout_s / 4): ranks reaching a collective further
     apart than that are named as missing.]

Where the wait happens:
  - CPU tensors (gloo): ``work.wait(timeout)``, the wait the synchronous call would do, bounded.
  - device tensors (NCCL) whose result the host reads next (counts, flags, objects): ``work.wait()``
    orders the current stream after the collective, then the host polls ``work.is_completed()`` until the
    deadline (it was about to block in ``.tolist()`` / ``.item()`` anyway).
  - device tensors consumed by device kernels only (``async_on_device=True``: the rows of the token
    exchange, a block's global counts): ``work.wait()`` orders the stream and the host does not block,
    as in the synchronous call. A CUDA event marks the call; when a later bounded wait on the same group
    times out, the error names the oldest such call that has not completed (a stuck all-to-all holds back
    every later operation of its communicator). The process group's own timeout (the NCCL watchdog)
    applies as well.

A rank that fails outside any collective (a check of its own raises, e.g. capture and replay's
``ReplayError`` on the rows of this rank's batch) will post none of the collectives the other ranks then
wait in. It says so with `report_failure` (one store append, on that path only); a rank whose host wait
in one of this module's collectives passes ``WATCH_S`` looks for such a report in the store, then again
every ``WATCH_S``, and raises `PeerFailedError` naming the failed rank and its error instead of waiting
for the deadline. A wait that completes within ``WATCH_S`` (the normal case) never reads the store. The
report holds until the failed rank's next collective of that group (it caught the error and goes on),
which withdraws it first. A rank waiting in a collective outside this module (FSDP2's, the user's) waits
for that one's own timeout.

Set-up collectives (those of ``optimize``: the experts' broadcast, the sparse-collective group's first
operation, the first cost-model exchanges) wait at least `SETUP_TIMEOUT_S` (`setup_timeout`): ranks
reach them after rank-local work of any length (loading weights, detection probes), where a deadline
sized for a training step would fail healthy runs.

Ranks in messages are global ranks (``RANK`` under torchrun).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import pickle
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from themis_compile.runtime.collectives import DEFAULT_TIMEOUT_S, collective_device

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SETUP_TIMEOUT_S",
    "Call",
    "CollectiveError",
    "CollectiveTimeoutError",
    "PeerFailedError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_counts",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object",
    "recv",
    "report_failure",
    "send",
    "setup_timeout",
]

SETUP_TIMEOUT_S = 300.0      # the least deadline of a set-up collective

_GRACE_MAX_S = 2.0           # most of the deadline spent collecting the other ranks' reports
_SPIN_S = 2e-3               # NCCL host waits: yield-spin this long, then poll every _POLL_S
_POLL_S = 2e-4
_MAX_IN_FLIGHT = 64          # device-async calls remembered per group for naming a stuck one
_STORE_PREFIX = "themis_compile/deadline"
_P2P = -1                    # the call number of point-to-point messages
WATCH_S = 1.0                # a host wait longer than this looks for another rank's failure report


# ============================================================================================ errors
class CollectiveError(RuntimeError):
    """A themis_compile collective failed on this rank.

    Attributes:
        collective: what was called, e.g. ``"all_to_all (token dispatch, backward)"``.
        layer: the MoE layer it served (``""`` for model-wide collectives).
        rank: this rank (global).
    """

    def __init__(self, message: str, collective: str = "", layer: str = "", rank: int = -1) -> None:
        super().__init__(message)
        self.collective = collective
        self.layer = layer
        self.rank = rank


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A themis_compile collective did not complete within its deadline.

    Attributes (besides `CollectiveError`'s):
        timeout_s: the deadline.
        waited_s: how long this rank waited for the call that raised, from its post to the error.
        missing_ranks: global ranks that did not participate (reported no wait in this call), or ``None``
            when they could not be determined (no rendezvous store).
    """

    def __init__(self, message: str, collective: str = "", layer: str = "", rank: int = -1,
                 timeout_s: float = 0.0, missing_ranks: tuple[int, ...] | None = None,
                 waited_s: float = 0.0) -> None:
        super().__init__(message, collective, layer, rank)
        self.timeout_s = timeout_s
        self.missing_ranks = missing_ranks
        self.waited_s = waited_s


class PeerFailedError(CollectiveError):
    """Another rank of the group reported a failure outside any collective (`report_failure`): the
    collective this rank waits in will not complete.

    Attributes (besides `CollectiveError`'s):
        failed_rank: the global rank that failed.
        reason: its error, one line.
    """

    def __init__(self, message: str, collective: str = "", layer: str = "", rank: int = -1,
                 failed_rank: int = -1, reason: str = "") -> None:
        super().__init__(message, collective, layer, rank)
        self.failed_rank = failed_rank
        self.reason = reason


class Call(NamedTuple):
    """One collective call, for messages: torch's operation, what it is for, and the layer it serves.
    (A named tuple: one is made per call, on the hot path.)"""

    op: str
    purpose: str
    layer: str = ""

    @property
    def collective(self) -> str:
        return f"{self.op} ({self.purpose})"

    def __str__(self) -> str:
        return f"{self.collective} of MoE layer {self.layer!r}" if self.layer else self.collective


# ============================================================================================ per group
class _Clock:
    """Per process group: how many calls of this module it has seen, and the device-async calls that may
    still be running (call number, call, completion test)."""

    __slots__ = ("calls", "in_flight", "reported")

    def __init__(self) -> None:
        self.calls = itertools.count()
        self.in_flight: deque[tuple[int, Call, Callable[[], bool]]] = deque(maxlen=_MAX_IN_FLIGHT)
        self.reported = False     # this rank reported a failure (report_failure) and posted nothing since


# Tied to the process group's lifetime: an entry goes when its group does.
_CLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


def _clock(group: Any) -> _Clock:
    clock = _CLOCKS.get(group)
    if clock is None:
        clock = _CLOCKS[group] = _Clock()
    return clock


def _host_waits(device: torch.device) -> bool:
    """Whether the host waits for the collective itself: CPU tensors (gloo) hold the result only then."""
    return device.type == "cpu"


def _order_after(work: Any) -> None:
    """Device tensors (NCCL): order the current stream after the collective; the host goes on."""
    work.wait()


def _device_done(work: Any) -> Callable[[], bool]:
    """A completion test for a device-async call that keeps no tensor alive: a CUDA event on the current
    stream, which `work.wait()` has ordered after the collective."""
    event = torch.cuda.Event()
    event.record()
    return event.query


# ============================================================================================ waiting
def setup_timeout(timeout_s: float) -> float:
    """The deadline of a set-up collective given the training deadline ``timeout_s``."""
    return max(float(timeout_s), SETUP_TIMEOUT_S)


def _grace(timeout_s: float) -> float:
    return min(_GRACE_MAX_S, 0.25 * timeout_s)


def _run(post: Callable[[], Any], call: Call, group: Any, timeout_s: float, device: torch.device,
         async_on_device: bool = False, peers: Sequence[int] | None = None) -> None:
    """Post a collective (``post()`` returns its Work) and wait for it within ``timeout_s``.

    ``peers`` (point-to-point: the global ranks taking part): only they call it, so it takes no call
    number (``_P2P``) and the ranks' numbering of the group's collectives stays the same."""
    group = _group(group)
    clock = _clock(group)
    if clock.reported:        # it failed, was caught, and goes on: its report no longer holds
        _withdraw_report(group, clock)
    seq = next(clock.calls) if peers is None else _P2P
    start = time.monotonic()
    try:
        work = post()
    except Exception as exc:  # noqa: BLE001 - re-raised with the collective's and layer's names
        raise _failure(call, exc) from exc
    deadline = start + timeout_s - _grace(timeout_s)
    if _host_waits(device):
        try:
            _wait_watching(work, group, call, deadline)
        except PeerFailedError:
            raise
        except Exception as exc:  # noqa: BLE001 - a timeout or a failed peer, named below
            if work.is_completed() and not _says_timeout(exc):
                _raise_reported_failure(group, call)     # a peer that reported its error, then exited
                raise _failure(call, exc) from exc
            raise _timed_out(clock, group, seq, call, timeout_s, start, peers) from exc
        return
    _order_after(work)
    if async_on_device:
        while clock.in_flight and clock.in_flight[0][2]():
            clock.in_flight.popleft()
        clock.in_flight.append((seq, call, _device_done(work)))
        return
    spin_until, watch_at = time.monotonic() + _SPIN_S, start + WATCH_S
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise _timed_out(clock, group, seq, call, timeout_s, start, peers)
        if now >= watch_at:
            _raise_reported_failure(group, call)
            watch_at = now + WATCH_S
        time.sleep(0 if now < spin_until else _POLL_S)


def _wait_watching(work: Any, group: Any, call: Call, deadline: float) -> None:
    """``work.wait()`` until ``deadline`` (raising as it does when that passes); past the first
    ``WATCH_S`` and every ``WATCH_S`` after, a failure another rank reported raises `PeerFailedError`.
    (A gloo wait that times out leaves the operation running: the next wait may still complete it.)"""
    while True:
        until = min(deadline, time.monotonic() + WATCH_S)
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(until - time.monotonic(), 1e-3)))
            return
        except Exception as exc:  # noqa: BLE001 - past the deadline, or not a timeout: the caller names it
            if until >= deadline or work.is_completed() or not _says_timeout(exc):
                raise
        _raise_reported_failure(group, call)


# ============================================================================================ failures
def _failure_key(group: Any) -> str:
    return f"{_STORE_PREFIX}/{group.group_name}/failed"


def report_failure(reason: str, *, group: Any = None) -> None:
    """Tell the other ranks of ``group`` that this rank failed outside any collective with ``reason``
    and will not post the collectives they may be waiting in: those waiting in one of this module's
    raise `PeerFailedError` within about ``WATCH_S`` instead of at their deadline. Call it right before
    raising. One append to the rendezvous store; a no-op without a process group. The report holds
    until this rank's next collective of ``group`` (a caught error)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = _group(group)
    line = " ".join(str(reason).split())[:2000]
    try:
        dist.distributed_c10d._get_default_store().append(_failure_key(group), f"{_global_rank()}\t{line}\n")
    except Exception as exc:  # noqa: BLE001 - the others then fail at their deadline, as without it
        logger.warning("themis_compile: could not report a failure through the store: %s", exc)
        return
    _clock(group).reported = True


def _withdraw_report(group: Any, clock: _Clock) -> None:
    clock.reported = False
    try:
        dist.distributed_c10d._get_default_store().append(_failure_key(group), f"{_global_rank()}\t\n")
    except Exception as exc:  # noqa: BLE001 - a stale report only makes a slow wait fail early
        logger.warning("themis_compile: could not withdraw a failure report from the store: %s", exc)


def _raise_reported_failure(group: Any, call: Call) -> None:
    """Raise `PeerFailedError` if another rank of ``group`` reported a failure (its latest line)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = _failure_key(group)
        if not store.check([key]):
            return
        latest: dict[int, str] = {}
        for line in store.get(key).decode().splitlines():
            r, reason = line.split("\t", 1)
            latest[int(r)] = reason
    except Exception:  # noqa: BLE001 - naming a failed peer is a courtesy; the deadline still holds
        return
    rank = _global_rank()
    ranks = set(dist.get_process_group_ranks(group))
    failed = sorted((r, why) for r, why in latest.items() if why and r != rank and r in ranks)
    if failed:
        r, why = failed[0]
        raise PeerFailedError(
            f"themis_compile: rank {rank} was waiting in {call} when rank {r} failed outside any collective "
            f"({why}); rank {r} will not post it, so it cannot complete; the process group is unusable now "
            "and must be rebuilt", call.collective, call.layer, rank, failed_rank=r, reason=why)


def _says_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _failure(call: Call, exc: BaseException) -> CollectiveError:
    rank = _global_rank()
    return CollectiveError(f"themis_compile: {call} failed on rank {rank}: {exc}; the process group is unusable "
                           f"now and must be rebuilt", call.collective, call.layer, rank)


def _timed_out(clock: _Clock, group: Any, seq: int, call: Call, timeout_s: float, start: float,
               peers: Sequence[int] | None = None) -> CollectiveTimeoutError:
    """The error for a wait that passed its deadline, after naming the ranks that did not participate."""
    rank = _global_rank()
    # The backend's own timeout (the process group's) may have come first.
    early = time.monotonic() < start + timeout_s - _grace(timeout_s) - 0.05
    # Step 1: the call that holds things up: the oldest device-async call still running, else this one.
    stuck_seq, stuck = seq, call
    for s, c, done in clock.in_flight:
        if not done():
            stuck_seq, stuck = s, c
            break
    noticed = "" if stuck is call else f" (noticed while waiting in {call})"
    # Step 2: report, and read the others' reports after the grace: at the deadline (the wait ended at
    # deadline - grace), or a grace after the backend's own error where that came first.
    until = time.monotonic() + _grace(timeout_s)
    ranks = list(peers) if peers is not None and stuck is call else dist.get_process_group_ranks(group)
    reports = _exchange_reports(group, rank, ranks, stuck_seq, stuck, until)
    if reports is None:
        who, missing = "the ranks that did not participate are unknown (no rendezvous store)", None
    else:
        waiting = [r for r in ranks if r in reports and reports[r][0] == stuck_seq]
        missing = tuple(r for r in ranks if r not in waiting)
        who = _describe_missing(missing, waiting, reports)
    verb = "timed out" if stuck is call else "did not complete"
    after = (f"{time.monotonic() - start:.1f} s (the process group's own timeout, shorter than the "
             f"collective's {timeout_s:.1f} s)" if early else f"{timeout_s:.1f} s")
    return CollectiveTimeoutError(
        f"themis_compile: {stuck} {verb} after {after} on rank {rank}{noticed}: {who}; the process "
        f"group is unusable now and must be rebuilt", stuck.collective, stuck.layer, rank, timeout_s, missing,
        time.monotonic() - start)


def _describe_missing(missing: Sequence[int], waiting: Sequence[int], reports: dict[int, tuple[int, str]]) -> str:
    if not missing:
        return (f"every rank ({list(waiting)}) was waiting in it: the collective itself is stuck (a slow or "
                f"broken link, or a collective posted outside themis_compile in between)")
    parts = []
    absent = [r for r in missing if r not in reports]
    if absent:
        parts.append(f"rank {absent[0]} did not participate" if len(absent) == 1
                     else f"ranks {absent} did not participate")
    for r in missing:
        if r in reports:
            parts.append(f"rank {r} waits in {reports[r][1]} instead")
    return "; ".join(parts) + f" (ranks {list(waiting)} were waiting in it)"


def _exchange_reports(group: Any, rank: int, ranks: Sequence[int], seq: int, call: Call, until: float
                      ) -> dict[int, tuple[int, str]] | None:
    """Append this rank's report to the group's key in the rendezvous store, and at ``until`` read the
    reports of ``ranks``: {rank: (call number, call)}, the latest per rank; ``None`` without a usable
    store. One append and one read per rank (the store serves every rank of a large job at once)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"{_STORE_PREFIX}/{group.group_name}"
        text = str(call).replace("\t", " ").replace("\n", " ")
        store.append(key, f"{rank}\t{seq}\t{text}\n")
        time.sleep(max(until - time.monotonic(), 0.0))
        reports = {}
        for line in store.get(key).decode().splitlines():
            r, s, what = line.split("\t", 2)
            reports[int(r)] = (int(s), what)
        return {r: v for r, v in reports.items() if r in ranks}
    except Exception as exc:  # noqa: BLE001 - naming the ranks is a courtesy; the timeout stands
        logger.warning("themis_compile: could not exchange timeout reports through the store: %s", exc)
        return None


# ============================================================================================ operations
def all_reduce(tensor: torch.Tensor, *, group: Any, timeout_s: float, purpose: str, layer: str = "",
               op: Any = None, async_on_device: bool = False) -> None:
    """``dist.all_reduce(tensor, op, group)`` (in place; ``op`` default SUM) with a deadline."""
    op = dist.ReduceOp.SUM if op is None else op
    _run(lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), Call("all_reduce", purpose, layer),
         group, timeout_s, tensor.device, async_on_device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, group: Any, timeout_s: float,
               purpose: str, layer: str = "") -> None:
    """``dist.all_gather(tensor_list, tensor, group)`` with a deadline."""
    _run(lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=True),
         Call("all_gather", purpose, layer), group, timeout_s, tensor.device)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, *, group: Any, timeout_s: float, purpose: str,
                      layer: str = "", async_on_device: bool = False) -> None:
    """``dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)`` with a
    deadline."""
    _run(lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                        async_op=True),
         Call("all_to_all", purpose, layer), group, timeout_s, output.device, async_on_device)


def broadcast(tensor: torch.Tensor, src: int, *, group: Any, timeout_s: float, purpose: str, layer: str = "") -> None:
    """``dist.broadcast(tensor, src, group)`` with a deadline; ``src`` is a global rank, as in torch."""
    _run(lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), Call("broadcast", purpose, layer),
         group, timeout_s, tensor.device)


def barrier(*, group: Any, timeout_s: float, purpose: str) -> None:
    """``dist.barrier(group)`` with a deadline."""
    _run(lambda: dist.barrier(group=group, async_op=True), Call("barrier", purpose), group, timeout_s,
         collective_device(group))


def send(tensor: torch.Tensor, dst: int, *, group: Any, timeout_s: float, purpose: str) -> None:
    """``dist.send(tensor, dst, group)`` (``dst`` global) with a deadline."""
    _run(lambda: dist.isend(tensor, dst, group=group), Call("send", purpose), group, timeout_s, tensor.device,
         peers=(_global_rank(), dst))


def recv(tensor: torch.Tensor, src: int, *, group: Any, timeout_s: float, purpose: str) -> None:
    """``dist.recv(tensor, src, group)`` (``src`` global) with a deadline."""
    _run(lambda: dist.irecv(tensor, src, group=group), Call("recv", purpose), group, timeout_s, tensor.device,
         peers=(src, _global_rank()))


def all_gather_object(obj: Any, *, group: Any, timeout_s: float, purpose: str, layer: str = "") -> list[Any]:
    """Every rank's (picklable) ``obj``, in group-rank order: ``dist.all_gather_object`` with a deadline
    (pickled sizes, then the padded bytes; two all-gathers, as torch does)."""
    group = _group(group)
    device = collective_device(group)
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    all_gather(sizes, size, group=group, timeout_s=timeout_s, purpose=purpose, layer=layer)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buf[:data.numel()] = data.to(device)
    parts = [torch.empty_like(buf) for _ in range(world)]
    all_gather(parts, buf, group=group, timeout_s=timeout_s, purpose=purpose, layer=layer)
    return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]


def broadcast_object(obj: Any, src: int = 0, *, group: Any, timeout_s: float, purpose: str, layer: str = "") -> Any:
    """Group rank ``src``'s (picklable) ``obj`` on every rank (``obj`` is ignored elsewhere):
    ``dist.broadcast_object_list`` with a deadline."""
    group = _group(group)
    device = collective_device(group)
    root = dist.get_global_rank(group, src)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) \
        if dist.get_rank(group) == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    broadcast(size, root, group=group, timeout_s=timeout_s, purpose=purpose, layer=layer)
    buf = data.to(device) if data.numel() else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    broadcast(buf, root, group=group, timeout_s=timeout_s, purpose=purpose, layer=layer)
    return pickle.loads(buf.cpu().numpy().tobytes())


# ============================================================================================ counts op
_COUNTS_PURPOSE = "global tokens per expert"


def _sum_counts(counts_E: torch.Tensor, group: Any, layer: str, timeout_s: float) -> torch.Tensor:
    counts_E = counts_E.clone()
    all_reduce(counts_E, group=group, timeout_s=timeout_s, purpose=_COUNTS_PURPOSE, layer=layer,
               async_on_device=True)
    return counts_E


@torch.library.custom_op("themis::all_reduce_counts", mutates_args=())
def _all_reduce_counts_op(counts_E: torch.Tensor, group_name: str, layer: str, timeout_s: float) -> torch.Tensor:
    """`all_reduce_counts` as one opaque node of a compiled graph (dynamo cannot trace a bounded wait)."""
    return _sum_counts(counts_E, dist.distributed_c10d._resolve_process_group(group_name), layer, timeout_s)


@_all_reduce_counts_op.register_fake
def _(counts_E, group_name, layer, timeout_s):
    return torch.empty_like(counts_E)


def all_reduce_counts(counts_E: torch.Tensor, *, group: Any, group_name: str, layer: str,
                      timeout_s: float) -> torch.Tensor:
    """The sum of ``counts_E`` over the group's ranks (a new tensor) with a deadline; under
    ``torch.compile`` one custom op (``group_name``: ``group.group_name``, read once outside the graph)."""
    if torch.compiler.is_compiling():
        return torch.ops.themis.all_reduce_counts(counts_E, group_name, layer, timeout_s)
    return _sum_counts(counts_E, group, layer, timeout_s)
