"""Every collective of the library has a deadline: a rank that stays alive but stops participating makes the
others raise within ``collective_timeout_s``, naming the collective, the layer and the missing rank.

One spawned set of three ranks serves every case (the start-up of a spawn costs more than a case). Each
case builds its model on a fresh process group of three or two of the ranks (a timed-out group is
unusable); the skipping rank raises at the site (it "caught an exception and went on") and waits in a
barrier of the default group, alive, where the others join it after their error.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import themis_compile
from themis_compile import ThemisConfig
from themis_compile.models import build_model, lm_loss
from themis_compile.runtime import deadline, exchange
from themis_compile.runtime.deadline import CollectiveTimeoutError
from themis_compile.runtime.ep import ShardedExperts
from themis_compile.runtime.fssdp import FSSDPExperts
from themis_compile.testing import run_multirank

TIMEOUT_S = 1.5
SLACK_S = 3.0          # the waiting ranks raise within TIMEOUT_S + SLACK_S of the step's start


class _Skip(Exception):
    """What the skipping rank raises at the site instead of taking part."""


def _skip(*args, **kwargs):
    raise _Skip


def _model(group, **config):
    torch.manual_seed(0)
    model = build_model("tiny-moe", d_model=16, d_ffn=16, num_experts=4, seq_len=16)
    config = ThemisConfig(**{"dense_parallel": "ddp", "collective_timeout_s": TIMEOUT_S,
                             "overlap_degree": 2, "materialization_budget": 1, "reshard_interval": 0, **config})
    return themis_compile.optimize(model, config, group=group)


def _train_step(model, skipping: bool, where: str) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss = lm_loss(model(tokens), tokens)
    if skipping and where == "backward":
        raise _Skip
    loss.backward()


def _reshard_step(model, skipping: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    lm_loss(model(tokens), tokens).backward()
    if skipping:
        raise _Skip
    opt.step()                           # reshard_interval=1: Alg. 2 re-shards after this step


# name: (config, what the skipping rank skips, what the waiting ranks' error must say)
CASES = {
    "count exchange": ({"policy": "ep"}, "exchange_counts", "all_to_all (count exchange) of MoE layer 'blocks.0.moe'"),
    "dispatch": ({"policy": "ep"}, "all_to_all_rows", "all_to_all (token dispatch) of MoE layer 'blocks.0.moe'"),
    "backward": ({"policy": "ep"}, "backward",
                 "all_to_all (token combine, backward) of MoE layer 'blocks.1.moe'"),
    "count reducer": ({"policy": "ep"}, "global_tokens_per_expert",
                      "all_reduce (global tokens per expert) of MoE layer 'blocks.0.moe'"),
    "routing check": ({"policy": "ep"}, "_check_routing", "all_reduce (routing check) of MoE layer 'blocks.0.moe'"),
    "global tokens": ({"policy": "themis"}, "_global_tokens",
                      "all_reduce (tokens per expert and router flags) of MoE layer 'blocks.0.moe'"),
    "plan digest": ({"policy": "themis", "check_plans": True}, "_check_plan_digest",
                    "all_gather (plan digest) of MoE layer 'blocks.0.moe'"),
    "themis backward": ({"policy": "themis-rm"}, "backward",
                        "all_to_all (token combine, backward) of MoE layer 'blocks.1.moe'"),
    "reshard": ({"policy": "themis", "reshard_interval": 1}, "step",
                "all_gather (re-sharding: optimizer-state layouts) timed out"),
    "bandwidth": (None, "measure_bandwidth", "barrier (bandwidth measurement (intra)) timed out"),
    # The process group's own (gloo) timeout shorter than collective_timeout_s: its error comes first and
    # is reported in the same terms.
    "group timeout first": ({"policy": "ep", "collective_timeout_s": 30.0, "group_timeout_s": TIMEOUT_S},
                            "exchange_counts", ("all_to_all (count exchange) of MoE layer 'blocks.0.moe' timed out "
                                                "after ", " s (the process group's own timeout, shorter than the "
                                                          "collective's 30.0 s) on rank")),
    # The NCCL path, driven on gloo: the rows' all-to-alls do not block the host; the next bounded wait
    # times out and names the oldest device-async call still running.
    "device-async dispatch": ({"policy": "ep"}, "device-async",
                              "all_to_all (token dispatch) of MoE layer 'blocks.0.moe' did not complete after "
                              f"{TIMEOUT_S:.1f} s on rank {{rank}} (noticed while waiting in all_reduce (routing "
                              "check) of MoE layer 'blocks.1.moe')"),
}


def _as_on_device(store: list) -> None:
    """Make the deadline module treat CPU tensors as device tensors: no host wait, completion by polling."""
    for attr, value in [("_host_waits", lambda device: False), ("_order_after", lambda work: None),
                        ("_device_done", lambda work: work.is_completed)]:
        store.append((deadline, attr, getattr(deadline, attr)))
        setattr(deadline, attr, value)


def _run_case(name: str, skipper: int, members: list[int], monkeypatch_store: list) -> dict | str:
    config, where, _ = CASES[name]
    config = None if config is None else dict(config)
    group_timeout_s = TIMEOUT_S + 6 if config is None else config.pop("group_timeout_s", TIMEOUT_S + 6)
    rank = dist.get_rank()
    skipping = rank == skipper
    group = dist.new_group(members, timeout=datetime.timedelta(seconds=group_timeout_s))
    start = time.monotonic()
    try:
        if rank not in members:
            return "not a member"
        if config is None:
            from themis_compile.runtime.profiling import measure_bandwidth

            if skipping:
                raise _Skip
            measure_bandwidth(group, nbytes=64, iters=1, timeout_s=TIMEOUT_S)
            return "no error"
        model = _model(group, **config)
        if where == "device-async":
            _as_on_device(monkeypatch_store)
            where = "all_to_all_rows"
        if skipping and where in ("exchange_counts", "all_to_all_rows"):
            monkeypatch_store.append((exchange, where, getattr(exchange, where)))
            setattr(exchange, where, _skip)
        elif skipping and where in ("_check_routing", "_global_tokens", "_check_plan_digest"):
            cls = ShardedExperts if where == "_check_routing" else FSSDPExperts
            monkeypatch_store.append((cls, where, getattr(cls, where)))
            setattr(cls, where, _skip)
        elif skipping and where == "global_tokens_per_expert":
            model.blocks[0].moe.global_tokens_per_expert = _skip
        dist.barrier(group)              # ranks built their models at their own pace; the step starts together
        start = time.monotonic()
        if config.get("reshard_interval"):
            _reshard_step(model, skipping)
        else:
            _train_step(model, skipping, where)
        return "no error"
    except _Skip:
        return "skipped"
    except CollectiveTimeoutError as exc:
        return {"message": str(exc), "elapsed": time.monotonic() - start, "waited": exc.waited_s,
                "missing": exc.missing_ranks}
    finally:
        while monkeypatch_store:
            owner, attr, original = monkeypatch_store.pop()
            setattr(owner, attr, original)
        dist.barrier()                   # the default group: the skipping rank waits here, alive


def _cases(rank: int, world_size: int, cases: list[tuple[str, int, list[int]]]) -> list:
    # One full step of each runtime first, on every rank: first-call costs (lazy imports, allocator
    # warm-up) must not make a rank arrive late at a timed case on a loaded machine.
    for policy in ("ep", "themis"):
        _train_step(_model(dist.group.WORLD, policy=policy), False, "")
    return [_run_case(name, skipper, members, []) for name, skipper, members in cases]


def _check(results: list[list], cases: list[tuple[str, int, list[int]]]) -> None:
    for i, (name, skipper, members) in enumerate(cases):
        for rank, per_rank in enumerate(results):
            expected = CASES[name][2]
            expected = [e.format(rank=rank) for e in ((expected,) if isinstance(expected, str) else expected)]
            got = per_rank[i]
            if rank not in members:
                assert got == "not a member", (name, got)
                continue
            if rank == skipper:
                assert got == "skipped", (name, got)
                continue
            assert isinstance(got, dict), (name, rank, got)
            msg = got["message"]
            assert all(e in msg for e in expected), (name, msg)
            assert f"rank {skipper} did not participate" in msg, (name, msg)
            assert got["missing"] == (skipper,), (name, msg)
            waiting = [r for r in members if r != skipper]
            assert f"ranks {waiting} were waiting in it" in msg, (name, msg)
            # The wait ends at the deadline minus the grace (or at the group's own timeout), the error a grace later.
            config = CASES[name][0] or {}
            timeout_s = config.get("collective_timeout_s", TIMEOUT_S)
            grace = deadline._grace(timeout_s)
            waited = min(timeout_s - grace, config.get("group_timeout_s", timeout_s)) + grace
            assert waited - 0.05 <= got["waited"] <= waited + 0.5, (name, got["waited"])
            assert got["elapsed"] <= waited + SLACK_S, (name, got["elapsed"])


# Every site on three ranks, so that "which rank" means something: mostly rank 1 is missing, and rank 0
# (which, unlike in a monitored barrier, has no special role: the reports go through the store) and rank 2
# once each; and the two the issue met first on two ranks.
SKIPPERS = {"backward": 2, "count reducer": 0}
RUN_CASES = [(name, SKIPPERS.get(name, 1), [0, 1, 2]) for name in CASES]
RUN_CASES += [("backward", 1, [0, 1]), ("count reducer", 0, [0, 1])]


def test_every_site_times_out_naming_collective_layer_and_missing_rank():
    results = run_multirank(_cases, 3, args=(RUN_CASES,), timeout_s=60)
    _check(results, RUN_CASES)


def test_missing_ranks_are_told_apart_from_ranks_waiting_elsewhere():
    reports = {0: (7, "x"), 2: (7, "x"), 3: (9, "all_reduce (routing check) of MoE layer 'b.1'")}
    msg = deadline._describe_missing((1, 3), [0, 2], reports)
    assert msg == ("rank 1 did not participate; rank 3 waits in all_reduce (routing check) of MoE layer 'b.1' "
                   "instead (ranks [0, 2] were waiting in it)")
    assert "every rank ([0, 1]) was waiting in it" in deadline._describe_missing((), [0, 1], {})


def test_error_types_and_message_without_layer():
    exc = CollectiveTimeoutError("m", "all_gather (x)", "", 0, 1.0, (1,))
    assert isinstance(exc, TimeoutError) and isinstance(exc, RuntimeError)
    assert isinstance(exc, deadline.CollectiveError)
    assert str(deadline.Call("barrier", "bandwidth measurement")) == "barrier (bandwidth measurement)"
    assert str(deadline.Call("all_to_all", "token dispatch", "m.l")) == "all_to_all (token dispatch) of MoE layer 'm.l'"


@pytest.mark.parametrize("timeout_s", [300.0, 2.0])
def test_grace_is_a_part_of_the_deadline(timeout_s):
    grace = deadline._grace(timeout_s)
    assert 0 < grace <= 2.0 and grace <= timeout_s / 4


class _Group:
    """Stands in for a process group where no message is exchanged."""


class _FailedWork:
    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")

    def is_completed(self):
        return True


def test_a_failed_collective_raises_naming_it_and_the_layer():
    call = deadline.Call("all_to_all", "token dispatch", "blocks.0.moe")
    with pytest.raises(deadline.CollectiveError, match=r"all_to_all \(token dispatch\) of MoE layer 'blocks.0.moe' "
                                                       r"failed on rank 0: Connection closed by peer") as info:
        deadline._run(_FailedWork, call, _Group(), 5.0, torch.device("cpu"))
    assert not isinstance(info.value, TimeoutError) and info.value.layer == "blocks.0.moe"

    def post():
        raise ValueError("split sizes do not add up")

    with pytest.raises(deadline.CollectiveError, match="failed on rank 0: split sizes do not add up"):
        deadline._run(post, call, _Group(), 5.0, torch.device("cpu"))
