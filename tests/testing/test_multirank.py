from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from themis_compile.testing import RankError, run_multirank


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item(), os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _hang_on_one(rank, world_size):
    if rank == 1:
        time.sleep(30)
        return
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never arrives: must time out, not hang


def test_results_by_rank_and_nodes():
    out = run_multirank(_sum_ranks, 4, args=(2.0,), devices_per_node=2)
    assert [o[0] for o in out] == [12.0] * 4
    assert [o[1] for o in out] == ["0", "1", "0", "1"]
    assert all(o[2] == "2" for o in out)


def test_failing_rank_traceback_is_reraised():
    with pytest.raises(RankError, match="boom from rank one"):
        run_multirank(_fail_on_one, 2, timeout_s=20)


def test_collective_that_never_completes_times_out():
    start = time.monotonic()
    with pytest.raises((RankError, TimeoutError)):
        run_multirank(_hang_on_one, 2, timeout_s=3)
    assert time.monotonic() - start < 60


def test_bad_arguments():
    with pytest.raises(ValueError):
        run_multirank(_sum_ranks, 3, args=(1.0,), devices_per_node=2)
