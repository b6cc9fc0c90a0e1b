"""Under ``dense_parallel="ddp"`` the model checks that its replicated dense parameters stay equal.

Clipping with ``torch.nn.utils.clip_grad_norm_`` instead of ``themis_compile.clip_grad_norm_`` gives each
rank its own norm (each holds other experts' gradients); once clipping is active the ranks scale by
different factors and the DDP replicas drift apart. On 2 gloo ranks: every rank raises
`ReplicaMismatchError` at the next checked forward, with the cause and the fix, within a bounded time
and with the ranks still in step (``check_replicas=2`` at the next checked one; ``0`` never). Correct
training never trips it: gradient accumulation (a backward per micro-batch, and two forwards before one
backward), activation checkpointing (per block, and around the whole model, whose recomputation inside
backward runs the model's pre-hooks again), eval and ``no_grad`` forwards in between, a frozen dense
parameter, a DCP resume, and ``themis_compile.clip_grad_norm_`` with clipping active. Two forwards before their two
backwards, which DDP does not reduce correctly (plain DDP neither), are caught too. (Training with the check on
equals one process: test_clip.py, whose DDP cases assert the check ran at every step.)
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import themis_compile
from themis_compile.models import lm_loss
from themis_compile.runtime.replicas import ReplicaMismatchError, param_checksum
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import _batches, make_model, model_loss

BATCH, SEQ = 8, 8
LOOP = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6)
TIMEOUT_S = 10.0        # the collectives' deadline: a rank left waiting would raise within it
MAX_NORM = 0.05         # below every step's norm: clipping is active


def _optimized(policy: str, **config):
    config = dict(dense_parallel="ddp", reshard_interval=0, collective_timeout_s=TIMEOUT_S, **config)
    return themis_compile.optimize(make_model(LOOP), themis_compile.ThemisConfig(policy=policy, **config))


def _local(tokens, rank, world_size):
    n = tokens.shape[0] // world_size
    return tokens[rank * n:(rank + 1) * n]


def _torch_clipping(rank, world_size, check_replicas: int, steps: int = 4) -> dict:
    """Train with torch's clipping; where the check raises, the forward, the message and how long it took."""
    model = _optimized("ep", check_replicas=check_replicas)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = dict(norms=[], forward=None, message="", seconds=None)
    for tokens in _batches(steps, BATCH, SEQ, model.config.vocab_size):
        start = time.monotonic()
        try:
            loss = model_loss(model, _local(tokens, rank, world_size))
        except ReplicaMismatchError as exc:
            out.update(forward=exc.forward, message=str(exc), seconds=time.monotonic() - start, names=exc.names)
            break
        loss.backward()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    # The ranks are still in step: one more collective completes.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["in_step"] = t.item() == world_size
    return out


def _correct_training(rank, world_size, policy: str, how: str, micro: str) -> dict:
    """Accumulation and checkpointing, eval / no_grad forwards in between, themis' clipping: no error."""
    model = make_model(LOOP)
    if how == "blocks":
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    model = _optimized(policy, schedule=False)
    model.blocks[0].ln_1.weight.requires_grad_(False)          # a frozen dense parameter
    call = functools.partial(checkpoint, model, use_reentrant=False) if how == "model" else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    recomputed = [0]

    def count(module, args):
        recomputed[0] += torch._C._current_graph_task_id() != -1
    model.register_forward_pre_hook(count)
    norms = []
    for step, tokens in enumerate(_batches(3, BATCH, SEQ, model.config.vocab_size)):
        parts = _local(tokens, rank, world_size).chunk(2)
        if micro == "joint":
            sum((lm_loss(call(part), part) + model.aux_loss()) / 2 for part in parts).backward()
        else:
            for part in parts:
                ((lm_loss(call(part), part) + model.aux_loss()) / 2).backward()
        norms.append(themis_compile.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(parts[0])
        model.eval()
        model(parts[0])
        model.train()
    check = model._themis_replica_check
    return dict(forwards=check.forwards, last_equal=check.last_equal, norms=norms, recomputed=recomputed[0])


def _forwards_before_backwards(rank, world_size) -> tuple[int | None, str]:
    """Two forwards, then a backward of each, outside no_sync: DDP leaves gradients unreduced (plain DDP
    too); the replicas differ after the step, and the next forward says so."""
    model = _optimized("ep")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for tokens in _batches(2, BATCH, SEQ, model.config.vocab_size):
        try:
            losses = [model_loss(model, part) for part in _local(tokens, rank, world_size).chunk(2)]
        except ReplicaMismatchError as exc:
            return exc.forward, str(exc)
        for loss in losses:
            loss.backward()
        themis_compile.clip_grad_norm_(model, 1e9)
        opt.step()
        opt.zero_grad()
    return None, ""


def _resume(rank, world_size, path: str) -> list[int | None]:
    """A DCP checkpoint saved after 2 steps, loaded into a fresh model that trains on: no error."""
    from torch.distributed import checkpoint as dcp

    from themis_compile.checkpoint import get_state_dict, set_state_dict

    checked = []
    for run, steps in (("save", 2), ("load", 2)):
        model = _optimized("themis")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if run == "load":
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for tokens in _batches(steps, BATCH, SEQ, model.config.vocab_size):
            model_loss(model, _local(tokens, rank, world_size)).backward()
            themis_compile.clip_grad_norm_(model, MAX_NORM)
            opt.step()
            opt.zero_grad()
        if run == "save":
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        checked.append(model._themis_replica_check.last_equal)
    return checked


def _run(rank, world_size, path):
    return dict(every=_torch_clipping(rank, world_size, 1), second=_torch_clipping(rank, world_size, 2),
                off=_torch_clipping(rank, world_size, 0, steps=3), resumed=_resume(rank, world_size, path),
                correct=[_correct_training(rank, world_size, *case) for case in CORRECT],
                unreduced=_forwards_before_backwards(rank, world_size))


# (policy, activation checkpointing: per block / around the whole model, micro-batches: a backward each /
# two forwards, then one backward)
CORRECT = [("themis", "blocks", "each"), ("ep", "model", "joint")]


def test_replica_check(tmp_path):
    ranks = run_multirank(_run, 2, args=(str(tmp_path / "ckpt"),), timeout_s=60)
    # torch's clip_grad_norm_: local norms differ, clipping is active; every rank raises at the forward
    # after the first clipped step (at the next checked one with check_replicas=2), in bounded time.
    for key, forward in [("every", 2), ("second", 3)]:
        runs = [r[key] for r in ranks]
        first = [run["norms"][0] for run in runs]
        assert first[0] != first[1] and min(first) > MAX_NORM, f"{key}: local norms {first}"
        for rank, run in enumerate(runs):
            assert run["forward"] == forward, f"{key} rank {rank}: {run}"
            assert run["in_step"] and run["seconds"] < TIMEOUT_S / 2, f"{key} rank {rank}: {run}"
            msg = run["message"]
            for part in (f"at training forward {forward}", "replicated dense parameters differ across ranks",
                         "torch.nn.utils.clip_grad_norm_", "fabric.clip_gradients", "themis_compile.clip_grad_norm_",
                         "check_replicas"):
                assert part in msg, f"{key} rank {rank}: {part!r} not in {msg}"
        assert runs[0]["names"] and runs[0]["names"] == runs[1]["names"], key
    for rank, r in enumerate(ranks):
        assert r["off"]["forward"] is None and len(r["off"]["norms"]) == 3, f"rank {rank}: check_replicas=0 raised"
    for case, *per_rank in zip(CORRECT, *[r["correct"] for r in ranks]):
        for rank, got in enumerate(per_rank):
            # 3 steps of 2 training forwards each, every one checked; eval and no_grad forwards not counted.
            assert got["forwards"] == 6 and got["last_equal"] == 6, f"{case} rank {rank}: {got}"
            assert min(got["norms"]) > MAX_NORM, f"{case} rank {rank}: clipping is not active ({got['norms']})"
        if case[1] == "model":
            assert per_rank[0]["recomputed"] == 6, f"{case}: the model's forward was not recomputed in backward"
    for rank, r in enumerate(ranks):
        assert r["resumed"] == [2, 2], f"rank {rank}: replica checks before saving and after loading {r['resumed']}"
        forward, message = r["unreduced"]
        assert forward == 3 and "several forwards before their backwards" in message, f"rank {rank}: {r['unreduced']}"


def test_config():
    assert themis_compile.ThemisConfig().check_replicas == 1
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="check_replicas"):
            themis_compile.ThemisConfig(check_replicas=bad)


def test_checksum_sees_one_bit_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.int64,
                  torch.bool):
        full = (torch.arange(1, 7).reshape(2, 3) % 2 == 0) if dtype == torch.bool else \
            torch.linspace(-1, 1, 6).reshape(2, 3).to(dtype) if dtype != torch.int64 else torch.arange(6)
        # 6 elements, and 5 (1- and 2-byte elements that do not pair into 4-byte words)
        for t in (full, full.reshape(-1)[:5]):
            base = param_checksum(t)
            assert base.dtype == torch.int32 and base.shape == ()
            if t.ndim == 2:
                assert param_checksum(t.mT.contiguous().mT) == base     # the same values, another layout
            n = t.numel()
            for byte in (0, t.element_size() * (n - 1)):     # the lowest bit of the first and of the last element
                u = t.clone()
                u.reshape(-1).view(torch.uint8)[byte] ^= 1
                assert param_checksum(u) != base, (dtype, n, byte)
