"""examples/train.py: launched with torchrun on 2 gloo ranks for a few steps, and its schedule and
checkpoint discovery on their own."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    # A session of its own, so that a timeout ends the launcher and both ranks, not the launcher alone.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} did not finish in {timeout_s} s\n{out}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    train = _load_script()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = train.cosine_schedule(opt, warmup=4, steps=20, min_ratio=0.1)
    lrs = []
    for _ in range(24):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])) and lrs[20:] == pytest.approx([0.1] * 4)


def test_latest_checkpoint_skips_unfinished_ones(tmp_path):
    train = _load_script()
    assert train.latest_checkpoint(str(tmp_path / "missing")) is None
    for step, finished in ((2, True), (4, True), (6, False)):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        if finished:
            (d / ".metadata").write_bytes(b"")
    assert train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-00000004")


def test_train_script_resumes_where_it_stopped(tmp_path):
    """Four steps straight through (bf16 autocast, clipping; its log lines and checkpoints checked),
    against a ``--resume`` for the last two from the checkpoint that run wrote after step 2 (alone in a
    directory of its own, so that it is the latest): experts were re-sharded (every 2 steps) before the
    checkpoint, and the resumed steps log the same losses and gradient norms. (A run stopped after step
    2 writes the same checkpoint: the save is the same call, the warmup learning rate of the first two
    steps does not depend on ``--steps``; one launch fewer.)"""
    common = ["--model", "tiny", "--policy", "themis", "--steps", "4", "--batch", "2", "--seq-len", "32",
              "--log-every", "1", "--bf16", "--clip", "1.0", "--reshard-interval", "2", "--ckpt-every", "2"]
    pattern = r"step +(\d+)  loss ([\d.]+)  .*grad_norm ([\d.]+)"
    straight = _torchrun(common + ["--ckpt-dir", str(tmp_path / "a")], timeout_s=420)
    assert straight.returncode == 0, straight.stderr[-6000:]
    # What the script reports (rank 0 only, one line a step) and the checkpoints it writes.
    log = straight.stdout + straight.stderr
    assert "optimized by themis_compile (policy themis, rank 0 of 2): 2 MoE layer(s) sharded" in log
    lines = re.findall(r"step +(\d+)  loss ([\d.]+)  lr ([\d.e+-]+)  tok/s ([\d,]+)  imbalance ([\d.]+)  "
                       r"grad_norm ([\d.]+)", log)
    assert [int(step) for step, *_ in lines] == [1, 2, 3, 4], log[-4000:]
    for _, loss, lr, tok_s, imbalance, grad_norm in lines:
        assert 0 < float(loss) < 2 * math.log(256) and float(lr) > 0 and int(tok_s.replace(",", "")) > 0
        assert float(imbalance) >= 1.0 and float(grad_norm) > 0
    ckpt = tmp_path / "a"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000004"]
    assert all((ckpt / name / ".metadata").exists() for name in ("step-00000002", "step-00000004"))
    shutil.copytree(ckpt / "step-00000002", tmp_path / "b" / "step-00000002")
    resumed = _torchrun(common + ["--ckpt-dir", str(tmp_path / "b"), "--resume"], timeout_s=420)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    want = re.findall(pattern, straight.stdout + straight.stderr)
    got = re.findall(pattern, resumed.stdout + resumed.stderr)
    assert [s for s, *_ in want] == ["1", "2", "3", "4"], straight.stdout[-3000:]
    assert got == want[2:], (got, want)
