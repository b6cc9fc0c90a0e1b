"""Run a function on N gloo ranks on loopback: the harness every distributed test uses.

    def check(rank, world_size, scale):
        t = torch.full((2,), float(rank))
        dist.all_reduce(t)
        return t.tolist()

    results = run_multirank(check, 4, args=(2.0,))       # [result of rank 0, ..., rank 3]

Guarantees:
- every rank runs in its own process (forked from a server that imported torch and the library once,
  `themis_compile.testing._rank_preload`; the rank sees the caller's environment as of the call, except
  what those modules read when they were imported) with one CPU thread and a gloo process group whose
  collectives time out after ``timeout_s`` (so a collective that never completes raises instead of
  hanging);
- the rendezvous store is created by the parent on a free port (no port races between tests);
- the first failing rank's traceback is re-raised in the caller as :class:`RankError`;
- the whole run has a deadline: ranks still alive after it are killed and :class:`TimeoutError` names them;
- no orphaned processes: every child is terminated (then killed) before returning.

``devices_per_node`` declares that consecutive local ranks form "nodes" (4 ranks with 2 per node are two
nodes of 2): each rank sees ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun would set them on such a
cluster, which is what :meth:`themis_compile.planner.Topology.from_env` reads.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from themis_compile.testing.netns import EmulatedNodes

__all__ = ["run_multirank", "RankError"]


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    devices_per_node: int,
    timeout_s: float,
    env: dict[str, str],
    results: "mp.Queue[tuple[str, int, Any]]",
    netns: str | None = None,
    caller_env: dict[str, str] | None = None,
) -> None:
    if caller_env is not None:
        # Forked from the server: take the caller's environment as it is now, as a spawned child would.
        os.environ.clear()
        os.environ.update(caller_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % devices_per_node),
        LOCAL_WORLD_SIZE=str(devices_per_node),
        GROUP_RANK=str(rank // devices_per_node),
        OMP_NUM_THREADS="1",
    )
    os.environ.update(env)
    try:
        if netns is not None:    # an emulated node: this process lives in the node's network namespace
            from themis_compile.testing.netns import enter_namespace

            enter_namespace(netns)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            out = fn(rank, world_size, *args, **kwargs)
        finally:
            # No barrier here: a rank that failed must not wait for the others.
            dist.destroy_process_group()
        # Plain pickle bytes: tensors sent through a multiprocessing queue would travel as shared-memory
        # handles that die with this process.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        results.put(("err", rank, traceback.format_exc()))


_PRELOAD = ["themis_compile.testing._rank_preload"]


def _context():
    """Ranks are forked from a server that has imported torch (see `_rank_preload`); where fork servers do
    not exist (not POSIX), they are spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _is_collateral(tb: str) -> bool:
    # A rank that fails inside a collective because a peer died is a consequence, not the cause.
    return "torch/distributed" in tb or "Connection closed by peer" in tb


def _failure_report(rank: int, tb: str, results: "mp.Queue", world_size: int, grace_s: float = 3.0) -> str:
    """Collect the other ranks' failures for a moment and put the root cause first."""
    failures = [(rank, tb)]
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            status, other, payload = results.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if status == "err":
            failures.append((other, payload))
    failures.sort(key=lambda f: _is_collateral(f[1]))
    return "\n".join(f"rank {r} of {world_size} failed:\n{t}" for r, t in failures)


def run_multirank(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    devices_per_node: int | None = None,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    network: EmulatedNodes | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks (>= 1).
        devices_per_node: ranks per simulated node; ``None`` puts all ranks on one node.
        timeout_s: the process group's collective timeout. The whole run is given
            ``timeout_s + 60`` seconds (process start-up included) before ranks are killed.
        env: extra environment variables for the ranks (applied after the harness's own, so they may
            override them).
        network: run each node's ranks in its namespace of an entered `EmulatedNodes` (real, shaped
            node boundaries); it must have ``world_size // devices_per_node`` nodes.

    Raises:
        RankError: a rank raised; the first failure (by arrival) is reported with its traceback.
        TimeoutError: the run passed its deadline; the message names the ranks that had not finished.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    devices_per_node = world_size if devices_per_node is None else devices_per_node
    if devices_per_node < 1 or world_size % devices_per_node:
        raise ValueError(f"devices_per_node={devices_per_node} must divide world_size={world_size}")
    num_nodes = world_size // devices_per_node
    if network is not None and network.num_nodes != num_nodes:
        raise ValueError(f"the emulated network has {network.num_nodes} nodes, the run {num_nodes}")
    if network is not None and not network.store_addr:
        raise ValueError("the emulated network is not built yet: run inside `with EmulatedNodes(...) as net:`")
    import torch.distributed as dist

    # The parent hosts the rendezvous store on a port the OS picked: no free-port race.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, fn, tuple(args), dict(kwargs or {}), devices_per_node,
                  timeout_s, {**(network.rank_env(rank // devices_per_node) if network else {}), **(env or {})},
                  results, network.netns_of(rank // devices_per_node) if network else None, dict(os.environ)),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 60.0
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"run_multirank({fn.__name__}): ranks {missing} did not finish in time")
            try:
                status, rank, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    # A rank died without reporting (segfault, os._exit): do not wait for the deadline.
                    time.sleep(0.5)
                    if results.empty():
                        raise RankError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                        f"without a result") from None
                continue
            if status == "err":
                raise RankError(_failure_report(rank, payload, results, world_size))
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(outputs) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store
    return [outputs[r] for r in range(world_size)]
