"""Test-session settings shared by every test (and inherited by the ranks the harness spawns)."""

from __future__ import annotations

import os
import tempfile

import torch

# Cost-model profiles are cached per user by default; tests must not read or leave a cache behind.
os.environ.setdefault("THEMIS_CACHE_DIR", tempfile.mkdtemp(prefix="themis-test-cache-"))

# One intra-op thread in the test processes, as in every rank `run_multirank` starts: the tensors are
# tiny, and on a machine whose cores are all busy (two pytest workers, their ranks) a second OpenMP
# thread only spins against them; the single-process references of the equivalence tests then run the
# same kernels on one thread as the ranks they are compared with.
torch.set_num_threads(1)

# The files that take longest, longest first (a full run's `--durations`, summed per file). Under
# `--dist loadfile` pytest-xdist hands whole files to its workers in the order of the collection, by
# default after sorting the files by their number of tests, most first: that puts these (a few long
# multi-rank tests each) last, and one worker ends the run alone on the last of them while the other
# idles. They go first instead, longest first, and the many short files fill in behind them. A file not
# listed keeps its place in the collection, after these.
LONGEST_FIRST = (
    "tests/runtime/test_fssdp.py",
    "tests/runtime/test_train_matrix.py",
    "tests/passes/test_zoo_training.py",
    "tests/runtime/test_ep.py",
    "tests/passes/test_hf_families.py",
    "tests/runtime/test_checkpoint.py",
    "tests/runtime/test_frozen.py",
    "tests/test_train_example.py",
    "tests/runtime/test_crash_resume.py",
    "tests/passes/test_backend.py",
    "tests/bench/test_step_bench.py",
    "tests/runtime/test_fallback.py",
    "tests/runtime/test_activation_checkpoint.py",
    "tests/runtime/test_empty_experts.py",
    "tests/kernels/test_bench.py",
    "tests/runtime/test_deadlines.py",
    "tests/runtime/test_clip.py",
)


def _distributed(config) -> bool:
    return getattr(config.option, "dist", "no") != "no"


def pytest_configure(config):
    if _distributed(config) and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False      # keep the order below (the controller schedules)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return          # not a pytest-xdist worker: one process, where the order does not change the time
    position = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.nodeid.split("::", 1)[0], len(position)))
