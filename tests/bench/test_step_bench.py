from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import themis_compile
from themis_compile.api import runtime_of
from themis_compile.bench import step
from themis_compile.bench.models import MODELS, build_bench_model, router_skew_bias
from themis_compile.runtime.profiling import step_phases
from themis_compile.testing import run_multirank

DEMO_TRACE = Path(__file__).resolve().parents[1] / "sim" / "data" / "demo_trace.jsonl"


def test_step_benchmark_reports_every_policy_with_trace(tmp_path):
    # One launch covers the report, the peers, the replay of a recorded routing trace (the demo's: skewed)
    # and the profiler breakdown (each launch spawns two ranks that run every policy: the suite pays for one).
    out = step.main(["--quick", "--skew", f"trace:{DEMO_TRACE}", "--trace", str(tmp_path), "--trace-steps", "1"])
    pol = out["policies"]
    assert set(pol) == {"ep", "themis", "themis-rm", "uniform", "fsdp2"}
    for policy, res in pol.items():
        assert res["step_time_s"] > 0
        assert len(res["memory_bytes_per_rank"]) == 2
    # The skewed router leaves EP imbalanced; Themis materializes replicas and balances it.
    assert pol["ep"]["imbalance_max_over_mean"] > 1.3
    assert pol["themis"]["mean_delta_p_per_layer"] > 0
    assert pol["themis"]["imbalance_max_over_mean"] < pol["ep"]["imbalance_max_over_mean"]
    assert pol["themis"]["memory_bytes_per_rank"][0]["replica_buffers_peak"] > 0
    assert out["router_skew"] == 0.0 and out["load_share_std"] > 0.15     # the replay sets the router bias
    # Every policy that routes realized the trace's global loads of every timed step, up to rounding to a
    # rank's T·K = 64 assignments; uniform replaces the router.
    for policy, res in pol.items():
        if policy == "uniform":
            assert res["trace_replay"] is None
        else:
            assert res["trace_replay"]["max_share_deviation"] <= 1 / 64, policy
            assert res["trace_replay"]["share_correlation"] > 0.99, policy
    assert pol["fsdp2"]["memory_bytes_per_rank"][0]["unsharded_buffers_peak"] > 0
    for key in ("themis_speedup_over_ep", "themis_speedup_over_fsdp2", "themis_over_uniform", "ep_over_uniform",
                "themis_memory_over_ep", "themis_memory_over_fsdp2"):
        assert key in out["ratios"]
    assert len(out["process_peak_rss_bytes_per_rank"]) == 2
    # Plain FSDP2 trains the same model on the same data: the same global loss as EP and Themis at every
    # step (the first step: the same forward; the next ones: the same global-batch gradient was applied).
    assert len(pol["fsdp2"]["loss_per_step"]) == 3    # --quick: 1 warm-up + 2 timed steps
    for policy in ("ep", "themis", "themis-rm"):
        for a, b in zip(pol["fsdp2"]["loss_per_step"], pol[policy]["loss_per_step"]):
            assert math.isclose(a, b, rel_tol=1e-5), (policy, a, b)
    # One chrome trace per policy and rank, and the per-phase breakdown names the runtime's phases.
    for policy in pol:
        for rank in range(2):
            trace = json.loads((tmp_path / f"step_{policy}_rank{rank}.json").read_text())
            assert any(e.get("name") == "bench::step" for e in trace["traceEvents"])
    themis_phases = set(pol["themis"]["phase_ms_per_step"])
    for name in ("plan", "spag", "spag_wait", "token_counts", "dispatch_plan", "dispatch", "experts", "combine",
                 "all_to_all_backward", "sprs", "sprs_wait"):
        assert f"themis::{name}" in themis_phases, name
    assert {"themis::dispatch", "themis::experts", "themis::combine"} <= set(pol["ep"]["phase_ms_per_step"])
    # Both exchange counts before the dispatch: EP all of them, Themis only the held experts' (each holder
    # learns what every source sends it; `exchange.exchange_held_counts`).
    assert "themis::count_exchange" in pol["ep"]["phase_ms_per_step"]
    assert "themis::count_exchange" in themis_phases
    assert "themis::spag_rematerialize" in pol["themis-rm"]["phase_ms_per_step"]
    assert "FSDP::all_gather" in pol["fsdp2"]["phase_ms_per_step"]
    assert all(v >= 0 for p in pol.values() for v in p["phase_ms_per_step"].values())
    assert pol["themis"]["phase_ms_per_step"]["bench::step"] > pol["themis"]["phase_ms_per_step"]["themis::experts"]
    # The phases count each range once: they add up to the profiled step.
    for policy, v in pol.items():
        phases = v["phases_ms_per_step"]
        assert math.isclose(sum(phases.values()), v["phase_ms_per_step"]["bench::step"], rel_tol=1e-6), policy
    # The breakdown has no large rest: forward and backward split by kind, the sparse collectives' starts
    # and exposed waits, the optimizer; SpAG / SpRS in flight beside it, split into exposed and hidden.
    themis = pol["themis"]["phases_ms_per_step"]
    for kind in ("attention", "router", "dispatch", "experts", "combine"):
        assert f"forward: {kind}" in themis and f"backward: {kind}" in themis, kind
    assert {"SpAG start (plan, post)", "SpAG exposed (wait)", "SpRS start", "SpRS exposed (wait)",
            "optimizer step"} <= set(themis)
    for kind in ("SpAG", "SpRS"):
        c = pol["themis"]["collectives_ms_per_step"][kind]
        assert c["count"] > 0 and c["in_flight"] >= c["hidden"] >= 0
    assert pol["ep"]["collectives_ms_per_step"]["SpAG"]["count"] == 0
    assert {"forward: experts", "dense FSDP2 (gather, reduce)"} <= set(pol["fsdp2"]["phases_ms_per_step"])
    for policy, v in pol.items():
        assert set(v["phases_ms_per_step"]) <= set(step_phases()), policy
        assert v["rest_fraction"] < 0.10, (policy, v["phases_ms_per_step"])
    assert (tmp_path / "breakdown.png").read_bytes()[:4] == b"\x89PNG"


def test_step_benchmark_rejects_unknown_skew():
    with pytest.raises(SystemExit):
        step._parse(["--skew", "mild"])
    with pytest.raises(SystemExit):                  # transformers' EP needs the HF model
        step._parse(["--policies", "ep,hf-ep"])


@pytest.mark.parametrize("model", ["tiny-moe", "hf-mixtral"])
def test_calibrated_router_skew_reproduces_the_target_std_on_its_batch(model):
    # One process: the calibrated model, run on the calibration batch (the first global batch), realizes
    # the requested load-share Std; a larger target needs a larger router_skew.
    args = step._parse(["--model", model, "--d-model", "32", "--d-ffn", "64", "--batch", "8", "--seq-len", "16"])
    skews = {}
    for target in (0.04, 0.08):
        skew = step.calibrate_router_skew(args, 2, target)
        bench = step._build_model(args, skew)
        bench.loss(step._global_batch(args, 2, step._batch_generator()))
        realized = sum(step.load_share_std(r.last_global_counts()) for r in bench.routers) / args.layers
        assert abs(realized - target) < 0.2 * target, (target, skew, realized)
        skews[target] = skew
    assert 0.0 < skews[0.04] < skews[0.08]


def _step_rank(rank: int, world: int, args) -> dict | None:
    return step._worker(args)


def test_hf_mixtral_step_benchmark_trains_alike_under_every_policy():
    # HF MixtralForCausalLM under every policy, transformers' native EP included, on 2 ranks (forked from the preloaded harness: no torchrun
    # launch), the hottest two experts of both layers on rank 1 at --skew extreme.
    args = step._parse(["--quick", "--model", "hf-mixtral", "--skew", "extreme"])
    out = run_multirank(_step_rank, 2, args=(args,), timeout_s=120)[0]
    pol = out["policies"]
    assert set(pol) == set(step.POLICIES + step.HF_POLICIES) and out["config"]["model"] == "hf-mixtral"
    assert out["router_skew"] == 4.0 and out["load_share_std"] > 0.15       # the biased router's skew
    assert pol["ep"]["imbalance_max_over_mean"] > 1.5
    assert pol["themis"]["mean_delta_p_per_layer"] > 0 and pol["themis-rm"]["mean_delta_p_per_layer"] > 0
    assert pol["themis"]["imbalance_max_over_mean"] < pol["ep"]["imbalance_max_over_mean"]
    assert pol["themis"]["memory_bytes_per_rank"][0]["replica_buffers_peak"] > 0
    assert pol["uniform"]["imbalance_max_over_mean"] == 1.0
    # No auxiliary loss: every policy but uniform (which changes the routing) trains the same global loss.
    assert len(pol["fsdp2"]["loss_per_step"]) == 3
    # transformers' own EP (from_pretrained with a DistributedConfig) is EP's peer: the same contiguous
    # owners, so the same imbalance.
    assert pol["hf-ep"]["imbalance_max_over_mean"] == pytest.approx(pol["ep"]["imbalance_max_over_mean"])
    for policy in ("ep", "themis", "themis-rm", "hf-ep"):
        for a, b in zip(pol["fsdp2"]["loss_per_step"], pol[policy]["loss_per_step"]):
            assert math.isclose(a, b, rel_tol=1e-5), (policy, a, b)
    for key in ("themis_speedup_over_ep", "themis_speedup_over_fsdp2", "themis-rm_speedup_over_ep",
                "themis_over_uniform", "ep_over_uniform", "themis_memory_over_ep", "themis_memory_over_fsdp2"):
        assert out["ratios"][key] > 0, key


def test_biased_mixtral_router_is_the_routers_own_at_bias_zero_and_follows_the_bias():
    # One process: the hook on HF's MixtralTopKRouter returns exactly what the router computes at bias 0,
    # a large bias sends every token to the biased expert (gradients still reach the router's weight), and
    # themis_compile.optimize detects and shards every MoE block with the hook in place.
    bench = build_bench_model("hf-mixtral", d_model=32, d_ffn=64, num_experts=8, top_k=2, n_layers=2,
                              seq_len=16, router_skew=0.0)
    router = bench.routers[0]
    assert type(router.gate).__name__ == "MixtralTopKRouter" and step.MODELS == MODELS
    x_TH = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    want = router.gate.forward(x_TH)                         # the router itself, without its hooks
    got = router.gate(x_TH)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert torch.equal(router.route(x_TH), want[2]) and torch.equal(router.logits(x_TH), want[0])
    assert torch.equal(router.last_global_counts(), torch.bincount(want[2].reshape(-1), minlength=8))
    router.router_bias[5] = 30.0
    _, scores_TK, ids_TK = router.gate(x_TH)
    assert (ids_TK == 5).any(-1).all() and int(router.last_global_counts()[5]) == 64
    assert torch.allclose(scores_TK.sum(-1), torch.ones(64))
    scores_TK[:, 1].sum().backward()
    assert router.gate.weight.grad.abs().sum() > 0
    # Both models start their skew from the reference model's seeded direction.
    ref = build_bench_model("tiny-moe", d_model=32, d_ffn=64, num_experts=8, top_k=2, n_layers=2, seq_len=16,
                            router_skew=4.0)
    skewed = build_bench_model("hf-mixtral", d_model=32, d_ffn=64, num_experts=8, top_k=2, n_layers=2,
                               seq_len=16, router_skew=4.0)
    for layer, (a, b) in enumerate(zip(ref.routers, skewed.routers)):
        assert torch.equal(a.router_bias, b.router_bias)
        assert torch.equal(a.router_bias, router_skew_bias(8, layer, 4.0))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = skewed.loss(tokens)
        model = themis_compile.optimize(skewed.model)          # one process: world size 1
        after = skewed.loss(tokens)
    assert len(runtime_of(model).layers) == 2 and "2 MoE layer" in themis_compile.explain(model)
    assert torch.allclose(before, after, rtol=1e-5)
    hot = [int(e) for e in torch.argsort(skewed.routers[1].router_bias, descending=True)[:2]]
    assert int(skewed.routers[1].last_global_counts()[hot].sum()) > 0.9 * 2 * 32
