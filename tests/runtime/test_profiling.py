"""Measuring the cost model's inputs (`runtime/profiling.py`): T_attn hooks, the bandwidth ping-pong,
profiler ranges and chrome traces; and `runtime.budgets.apply_budgets`."""

from __future__ import annotations

import logging

import pytest
import torch

from themis_compile.cost_model import profile as P
from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig, lm_loss
from themis_compile.planner.topology import Topology
from themis_compile.runtime import profiling
from themis_compile.runtime.budgets import apply_budgets
from themis_compile.testing import run_multirank


def _model(seq_len: int = 8) -> GPTMoE:
    torch.manual_seed(0)
    return GPTMoE(MoEModelConfig(d_model=16, n_heads=2, n_layers=2, d_ffn=16, num_experts=4, top_k=2,
                                 seq_len=seq_len, vocab_size=16, experts_form="stacked"))


def _train(model, steps: int, seq_len: int = 8) -> None:
    tokens = torch.randint(0, 16, (2, seq_len))
    for _ in range(steps):
        lm_loss(model(tokens), tokens).backward()


def test_attention_profiler_medians_windows_and_removal():
    model = _model()
    done = []
    moe = {f"blocks.{i}.moe": b.moe for i, b in enumerate(model.blocks)}
    prof = profiling.AttentionProfiler(model, moe, warmup_steps=1, measure_steps=2, on_done=done.append)
    _train(model, 3)
    with torch.no_grad():            # evaluation forwards do not count as steps
        model(torch.randint(0, 16, (2, 8)))
    assert prof.profile is None
    _train(model, 1)                 # the 4th step's first attention closes the profile
    profile = prof.profile
    assert done == [profile] and profile.source == "measured"
    assert set(profile.attention) == {"blocks.0.attn", "blocks.1.attn"}
    for timing in profile.attention.values():
        assert timing.forward_s > 0 and timing.backward_s > 0 and timing.samples == 2
        assert timing.input_shape == (2, 8, 16)
    assert profile.preceding_attention == {"blocks.0.moe": "blocks.0.attn", "blocks.1.moe": "blocks.1.attn"}
    assert profile.t_attn("blocks.1.moe") == profile.attention["blocks.1.attn"].forward_s
    assert all(not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def test_profiler_failure_never_blocks_training(monkeypatch, caplog):
    model = _model()
    prof = profiling.AttentionProfiler(model, warmup_steps=0, measure_steps=2)

    def boom(_):
        raise RuntimeError("timer broke")

    monkeypatch.setattr(profiling, "_sync", boom)
    with caplog.at_level(logging.WARNING):
        _train(model, 2)
    assert prof.failed is not None and "timer broke" in prof.failed and prof.profile is None
    assert "falls back to defaults" in caplog.text
    assert all(not m._forward_pre_hooks for m in model.modules())


def _bandwidth(rank, world_size, devices_per_node):
    topo = Topology.from_env(world_size, devices_per_node)
    return profiling.measure_bandwidth(topology=topo, nbytes=1 << 16, iters=2)


def test_measure_bandwidth_two_ranks_intra_and_inter():
    intra = run_multirank(_bandwidth, 2, args=(2,), devices_per_node=2)
    inter = run_multirank(_bandwidth, 2, args=(1,), devices_per_node=1)
    assert set(intra[0]) == {"intra"} and intra[0] == intra[1] and intra[0]["intra"] > 0
    assert set(inter[0]) == {"inter"} and inter[0] == inter[1] and inter[0]["inter"] > 0
    assert profiling.measure_bandwidth() == {}        # no process group: nothing to measure


def test_chrome_trace_has_attention_ranges(tmp_path):
    model = _model()
    handles = profiling.annotate_attention(model)
    path = profiling.export_chrome_trace(lambda: _train(model, 1), tmp_path / "trace.json")
    text = path.read_text()
    assert text.count(P.ATTENTION_RANGE) >= 2
    for h in handles:
        h.remove()


def test_apply_budgets_sets_t_and_m_on_the_layers_that_take_them():
    b = P.budgets(P.load_override({"t_attn_s": 0.01, "intra_node_bw": 1e9}), {"l0": 1 << 16, "x": 1 << 16})

    class Layer:
        overlap_degree = 0
        materialization_budget = 0

    layer = Layer()
    assert apply_budgets({"l0": layer, "x": object()}, b) == ["l0"]
    assert (layer.overlap_degree, layer.materialization_budget) == (b["l0"].overlap_degree,
                                                                     b["l0"].materialization_budget)


def _busy(seconds: float) -> None:
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_phase_breakdown_counts_each_range_once_where_outermost():
    """Nested ranges count towards the outer phase; what no phase covers is the rest of the step; the
    phases add up to the step. (Lower bounds only: a busy loop takes at least its time, on a loaded
    machine more.)"""
    from torch.profiler import ProfilerActivity, profile, record_function

    busy = _busy

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("step"):
                with record_function("themis::spag_start"):
                    with record_function("themis::plan"):        # nested: plan + SpAG counted once
                        busy(0.010)
                    busy(0.010)
                with record_function("themis::experts"):
                    with record_function("themis::dispatch"):    # nested in another phase: not counted
                        busy(0.005)
                    busy(0.015)
                with record_function("themis::sprs"):
                    busy(0.005)
                busy(0.020)                                        # no phase range: the rest
    got = profiling.phase_breakdown(prof.events(), 2, "step")
    assert set(got) == {"plan + SpAG", "experts (forward)", "SpRS", profiling.OTHER_PHASE}
    assert got["plan + SpAG"] >= 20.0 and got["experts (forward)"] >= 20.0 and got["SpRS"] >= 5.0
    assert got[profiling.OTHER_PHASE] >= 20.0
    step_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == "step") / 1e3 / 2
    assert sum(got.values()) == pytest.approx(step_ms)


def test_phase_breakdown_splits_the_rest_by_the_parts_of_the_step():
    """Within the step's forward, backward and optimizer ranges, what no phase covers is that part's own
    compute; only what lies outside every part is the rest of the step; the phases still add up."""
    from torch.profiler import ProfilerActivity, profile, record_function

    busy = _busy

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            with record_function(profiling.FORWARD_RANGE):
                with record_function("themis::experts"):
                    busy(0.010)
                busy(0.020)                                         # attention and the rest of the forward
            with record_function(profiling.BACKWARD_RANGE):
                with record_function("themis::sprs"):
                    busy(0.005)
                busy(0.030)
            with record_function(profiling.OPTIMIZER_RANGE):
                busy(0.010)
            busy(0.002)
    got = profiling.phase_breakdown(prof.events(), 1, "step")
    parts = dict(profiling.PART_PHASES)
    assert got["experts (forward)"] >= 10.0 and got["SpRS"] >= 5.0
    assert got[parts[profiling.FORWARD_RANGE]] >= 20.0
    forward_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == profiling.FORWARD_RANGE) / 1e3
    experts_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == "themis::experts") / 1e3
    assert got[parts[profiling.FORWARD_RANGE]] == pytest.approx(forward_ms - experts_ms)   # experts counted once
    assert got[parts[profiling.BACKWARD_RANGE]] >= 30.0 and got[parts[profiling.OPTIMIZER_RANGE]] >= 10.0
    assert got[profiling.OTHER_PHASE] < got[parts[profiling.BACKWARD_RANGE]]
    step_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == "step") / 1e3
    assert sum(got.values()) == pytest.approx(step_ms)


def _profiled_steps(model, steps: int, seq_len: int = 32):
    from torch.profiler import ProfilerActivity, profile, record_function

    blocks = model.moe_layers()
    handles = profiling.annotate_step(model, blocks, [b.experts for b in blocks])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 16, (4, seq_len))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                with record_function("step"):
                    with record_function(profiling.FORWARD_RANGE):
                        loss = lm_loss(model(tokens), tokens)
                    with record_function(profiling.BACKWARD_RANGE):
                        loss.backward()
                    with record_function(profiling.OPTIMIZER_RANGE):
                        opt.step()
                        opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    return prof


def test_step_breakdown_splits_forward_and_backward_by_kind_and_leaves_little_rest():
    """A short training run under the profiler: every kind of compute the model has appears in forward and
    in backward (a backward node counted by the forward op that made it), the optimizer step is its own
    phase, the phases add up to the step, and the rest of the step is below 10 %."""
    torch.manual_seed(0)
    model = GPTMoE(MoEModelConfig(d_model=64, n_heads=4, n_layers=2, d_ffn=128, num_experts=4, top_k=2,
                                  seq_len=32, vocab_size=16, experts_form="stacked"))
    _profiled_steps(model, 1)                       # warm-up outside the profile
    prof = _profiled_steps(model, 2)
    got = profiling.step_breakdown(prof.events(), 2, "step")
    for kind in ("attention", "router", "experts", "dense (embeddings, norms, head)", "loss"):
        assert got.get(f"forward: {kind}", 0.0) > 0, kind
        assert got.get(f"backward: {kind}", 0.0) > 0, kind
    assert got["optimizer step"] > 0 and got[profiling.GRAD_ACCUMULATION_PHASE] > 0
    assert set(got) <= set(profiling.step_phases())
    step_ms = sum(e.time_range.elapsed_us() for e in prof.events() if e.name == "step") / 1e3 / 2
    assert sum(got.values()) == pytest.approx(step_ms)
    assert got[profiling.OTHER_PHASE] < 0.10 * step_ms, got
    # The hooks are gone: a later forward records no range.
    assert not model._forward_pre_hooks and not model.blocks[0].attn._forward_pre_hooks


def test_step_breakdown_counts_the_runtime_ranges_and_their_nesting():
    """Collective starts and waits are their own phases inside any kind; each instant counts once."""
    from torch.profiler import ProfilerActivity, profile, record_function

    busy = _busy

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            with record_function(profiling.FORWARD_RANGE):
                with record_function(profiling.ROUTER_RANGE):
                    busy(0.004)
                    with record_function(profiling.MOE_RUNTIME_RANGE):
                        with record_function("themis::spag_wait"):
                            busy(0.006)
                        with record_function("themis::experts"):
                            busy(0.008)
            with record_function(profiling.OPTIMIZER_RANGE):
                with record_function("themis::reshard"):
                    busy(0.005)
                busy(0.003)
    got = profiling.step_breakdown(prof.events(), 1, "step")
    assert got["SpAG exposed (wait)"] >= 6.0 and got["forward: experts"] >= 8.0
    assert got["forward: router"] >= 4.0 and got["re-shard"] >= 5.0 and got["optimizer step"] >= 3.0
    def ms(name):
        return sum(e.time_range.elapsed_us() for e in prof.events() if e.name == name) / 1e3

    # the nested ranges are not counted twice: the router's own time is its range less the runtime's
    assert got["forward: router"] == pytest.approx(ms(profiling.ROUTER_RANGE) - ms(profiling.MOE_RUNTIME_RANGE))
    step_ms = ms("step")
    assert sum(got.values()) == pytest.approx(step_ms)
