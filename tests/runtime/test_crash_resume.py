"""Training survives a killed rank: torchrun restarts the group and the run resumes from its last checkpoint.

Two torchrun launches of ``tests/runtime/crash_train.py`` (gloo, 2 ranks, themis, re-sharding every 2
steps, a DCP checkpoint every 2 of 6 steps) run side by side: one uninterrupted, and one whose rank 1 is
SIGKILLed before step 5 (after the checkpoint of step 4). torchrun (``--max-restarts 1``) restarts both
ranks; they resume from ``step_4`` and finish. The final parameters must equal the uninterrupted run's bit
for bit (same world size: the resume is exact). Every wait is bounded; on any failure or deadline the
launches are killed with their whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("crash_train.py")
DEADLINE_S = 270      # below the suite's per-test timeout, so that the launches are always cleaned up


def _launch(directory: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5", str(SCRIPT), "--dir", str(directory),
           "--steps", "6", "--every", "2", *extra]
    # torchrun shares its rendezvous TCPStore with the workers' init_process_group by default; after a
    # restart the new gloo group then reads the previous attempt's peer addresses from it and fails to
    # connect (torch issue 135712). A store of the workers' own avoids that.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill(proc: subprocess.Popen, directory: Path) -> None:
    """Stop a launch that is still running: torchrun first (it stops its workers), then any worker left
    (torchrun starts each in a session of its own), found by the pid files the script writes."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    for pid_file in directory.glob("pid*"):
        pid = int(pid_file.read_text())
        try:
            if "crash_train.py" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def test_training_survives_a_killed_rank(tmp_path):
    crash, reference = tmp_path / "crash", tmp_path / "reference"
    crash.mkdir()
    reference.mkdir()
    deadline = time.monotonic() + DEADLINE_S
    dirs = {"crash": crash, "reference": reference}
    procs = {"crash": _launch(crash, "--wait-at", "5"), "reference": _launch(reference)}
    outputs = {}
    try:
        waiting = crash / "waiting"
        while not waiting.exists():
            if procs["crash"].poll() is not None or time.monotonic() > deadline:
                pytest.fail("rank 1 never reached step 5:\n" + procs["crash"].communicate(timeout=10)[0][-6000:])
            time.sleep(0.2)
        os.kill(int(waiting.read_text()), signal.SIGKILL)
        for name, proc in procs.items():
            outputs[name] = proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    finally:
        for name, proc in procs.items():
            _kill(proc, dirs[name])
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} run failed:\n{outputs.get(name, '')[-6000:]}"

    # The first attempt started from scratch; after the restart both ranks resumed from step 4.
    for rank in range(2):
        assert (crash / f"attempt0.rank{rank}").read_text() == "0"
        assert (crash / f"attempt1.rank{rank}").read_text() == "4"
    assert not (reference / "attempt1.rank0").exists()
    final = {}
    for name, directory in (("crash", crash), ("reference", reference)):
        dcp_to_torch_save(directory / "final", tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)["model"]
    assert final["crash"].keys() == final["reference"].keys()
    for key, value in final["reference"].items():
        assert torch.equal(final["crash"][key], value), key
