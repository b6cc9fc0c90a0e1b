from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from themis_compile.bench import step
from themis_compile.bench.models import build_bench_model
from themis_compile.bench.replay import TraceReplay, fit_router_bias, target_counts
from themis_compile.sim.traces import synthetic_trace

DEMO_TRACE = Path(__file__).resolve().parents[1] / "sim" / "data" / "demo_trace.jsonl"


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: several intra-op threads on a loaded machine only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_target_counts_round_to_the_assignments_and_respect_the_cap():
    counts_E = target_counts(np.array([0.5, 0.3, 0.2, 0.0]), 20, 10)
    assert counts_E.tolist() == [10, 6, 4, 0]
    # 0.7 of 20 assignments exceeds T = 10 (a token picks distinct experts): the excess moves on.
    counts_E = target_counts(np.array([0.7, 0.2, 0.1, 0.0]), 20, 10)
    assert counts_E.sum() == 20 and counts_E.max() == 10 and counts_E[0] == 10


def test_fitted_bias_realizes_the_target_counts_exactly():
    gen = torch.Generator().manual_seed(0)
    for scale in (0.3, 3.0):
        z_TE = torch.randn(512, 8, generator=gen) * scale
        # An empty expert, an expert every token picks, and a long tail.
        counts_E = torch.tensor([0, 512, 200, 150, 80, 50, 30, 2])
        b_E = fit_router_bias(z_TE, counts_E, top_k=2)
        ids_TK = torch.topk(z_TE + b_E, 2, dim=-1).indices
        assert torch.equal(torch.bincount(ids_TK.reshape(-1), minlength=8), counts_E), scale
    with pytest.raises(ValueError):
        fit_router_bias(z_TE, torch.tensor([600, 424, 0, 0, 0, 0, 0, 0]), top_k=2)   # 600 > T


@pytest.mark.parametrize("source, kind", [("demo", "tiny-moe"), ("synthetic", "tiny-moe"), ("demo", "hf-mixtral")])
def test_replayed_loads_follow_the_trace_step_by_step(source, kind, tmp_path):
    # A training model (its routers' inputs change every step) replays a recorded trace (the demo's,
    # extreme) and a paper-like synthetic one (load-share Std 0.04): the realized shares of every step and
    # layer equal the trace's up to rounding to this rank's T·K assignments; HF Mixtral's biased router too.
    bench = build_bench_model(kind, d_model=32, d_ffn=64, num_experts=8, top_k=2, n_layers=2, seq_len=32,
                              router_skew=0.0)
    model = bench.model
    path = DEMO_TRACE
    if source == "synthetic":
        path = tmp_path / "trace.jsonl"
        synthetic_trace(2, 8, 2, 128, 2, 6, cv=8 * 0.04, seed=3).write_jsonl(path)
    replay = TraceReplay.load(path, num_experts=8, top_k=2, rank=0, world=1)
    replay.install(bench.routers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    got, want = [], []
    for s in range(4):
        replay.set_step(s)
        tokens = torch.randint(0, 256, (8, 32), generator=gen)
        bench.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
        for layer, r in enumerate(bench.routers):
            counts_E = r.last_global_counts().to(torch.float64)
            got.append((counts_E / counts_E.sum()).numpy())
            want.append(replay.target_shares(s, layer, local=False))
    got_N, want_N = np.concatenate(got), np.concatenate(want)
    assert np.abs(got_N - want_N).max() <= 1.0 / (8 * 32 * 2) + 1e-12     # one assignment of 512
    assert np.corrcoef(got_N, want_N)[0, 1] > 0.999
    # The trace's steps differ, and the replay followed them (not one step's shares throughout).
    assert np.abs(want[0] - want[-2]).max() > 0.002 and np.abs(got[0] - got[-2]).max() > 0.002
    assert replay.fit_seconds > 0
    replay.remove()
    bias_E = bench.routers[0].router_bias.clone()
    bench.loss(tokens)
    assert torch.equal(bench.routers[0].router_bias, bias_E)     # removed: the bias stays put


def test_skew_trace_option_parses_and_rejects_a_missing_file():
    args = step._parse(["--skew", f"trace:{DEMO_TRACE}"])
    assert args.skew_trace == str(DEMO_TRACE)
    assert step._resolve_skew(args, 2) == 0.0          # the replay, not a static bias, skews the router
    extreme = step._parse(["--skew", "extreme"])
    assert extreme.skew_trace is None and step._resolve_skew(extreme, 2) == 4.0
    with pytest.raises(SystemExit):
        step._parse(["--skew", "trace:/nonexistent/trace.jsonl"])
