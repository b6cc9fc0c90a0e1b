"""The torch.compile backend "themis": registration, whole-graph capture of an optimized model, numerics
equal to eager, the schedule in the AOT graphs, and a loud message for models that were not optimized."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn

import themis_compile
from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig, lm_loss
from themis_compile.passes import backend as B
from themis_compile.passes import schedule as S

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Caches off: a cache hit would skip the inner compile and so the report these tests read.
NO_CACHE = dict(fx_graph_cache=False)


def _no_cache():
    return functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(NO_CACHE)


def test_backend_is_registered():
    assert "themis" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("themis") is B.themis_backend


def test_importing_the_backend_registers_nothing():
    # A fresh interpreter: importing the module (as the package's entry point does) leaves dynamo's
    # registry as it was; register_backend() (which optimize calls) adds the name, once.
    code = (
        "from torch._dynamo.backends import registry\n"
        "import themis_compile.passes.backend as B\n"
        "assert 'themis' not in registry._COMPILER_FNS, 'registered at import'\n"
        "B.register_backend(); B.register_backend()\n"
        "assert registry._COMPILER_FNS['themis'] is B.themis_backend\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


class CallLog(nn.Module):
    """Wraps a layer's sharded experts and records the runtime calls the compiled graph makes."""

    def __init__(self, inner: nn.Module, log: list, name: str) -> None:
        super().__init__()
        self.inner, self.log, self.layer = inner, log, name

    def start_materialization(self):
        self.log.append(("spag_start", self.layer))

    def wait_materialization(self):
        self.log.append(("spag_wait", self.layer))

    def wait_reduction(self):
        self.log.append(("sprs_wait", self.layer))

    def forward(self, x_TH, ids_TK, weights_TK):
        self.wait_materialization()          # as the runtime does, just before dispatch
        self.log.append(("moe", self.layer))
        return self.inner(x_TH, ids_TK, weights_TK)


@pytest.fixture(scope="module")
def compiled_run():
    torch.manual_seed(0)
    cfg = MoEModelConfig(d_model=32, n_heads=2, n_layers=2, d_ffn=32, num_experts=4, top_k=2, seq_len=8,
                         vocab_size=32, experts_form="stacked", aux_loss_weight=0.0)
    model = GPTMoE(cfg)
    unmodified = copy.deepcopy(model)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy="ep"))
    runtime = themis_compile.api.runtime_of(model)
    log: list = []
    layers = {}
    for i, block in enumerate(model.blocks):
        block.moe.experts = CallLog(block.moe.experts, log, f"moe{i}")
        layers[f"blocks.{i}.moe"] = block.moe.experts
    runtime.layers.update(layers)
    S.schedule_model(model, layers)

    tokens_BS = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    eager_loss = lm_loss(model(tokens_BS), tokens_BS)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_loss = lm_loss(unmodified(tokens_BS), tokens_BS)
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    B.reset_report()
    log.clear()
    a, b = _no_cache()
    with a, b:
        compiled = torch.compile(model, backend="themis", fullgraph=True)
        loss = lm_loss(compiled(tokens_BS), tokens_BS)
        forward_log = list(log)
        log.clear()
        loss.backward()
    return dict(model=model, loss=loss, eager_loss=eager_loss, ref_loss=ref_loss, eager_grads=eager_grads,
                forward_log=forward_log, backward_log=list(log), report=B.last_report())


def test_compiled_matches_eager_and_unmodified(compiled_run):
    r = compiled_run
    torch.testing.assert_close(r["loss"], r["eager_loss"])
    torch.testing.assert_close(r["loss"], r["ref_loss"])
    for name, p in r["model"].named_parameters():
        torch.testing.assert_close(p.grad, r["eager_grads"][name], msg=name)


def test_compiled_graph_is_scheduled(compiled_run):
    report = compiled_run["report"]
    (dynamo,) = report.dynamo          # fullgraph: one graph, both layers in it
    assert [s.fallback for s in dynamo] == [False, False]
    assert [s.attention for s in dynamo] == ["custom:blocks.0.attn", "custom:blocks.1.attn"]
    (forward,) = report.forward
    assert all(not s.fallback for s in forward)
    order = report.forward_order[0]
    for s in forward:
        # the SpAG start precedes the attention's first node; the wait is right before the MoE node
        start = next(n for n in order if n.startswith("spag_start") and order.index(n) < order.index(s.start_before))
        assert order.index(start) < order.index(s.start_before) < order.index(s.moe)
        assert order[order.index(s.moe) - 1].startswith("spag_wait")
    assert report.backward_fences == [2]
    assert report.graphs_without_moe == 0


def test_compiled_runtime_call_order(compiled_run):
    fwd, bwd = compiled_run["forward_log"], compiled_run["backward_log"]
    for layer in ("moe0", "moe1"):
        idx = [fwd.index((e, layer)) for e in ("spag_start", "spag_wait", "moe")]
        assert idx == sorted(idx)
    # layer 1 starts its SpAG after MoE 0 ran: its window is attention 1, which follows MoE 0
    assert fwd.index(("moe", "moe0")) < fwd.index(("spag_start", "moe1"))
    assert bwd == [("sprs_wait", "moe1"), ("sprs_wait", "moe0")]


def test_graph_without_moe_warns_loudly_or_raises_when_strict():
    f = nn.Linear(4, 4)
    torch._dynamo.reset()
    B.reset_report()
    with pytest.warns(RuntimeWarning, match="themis_compile.optimize"):
        out = torch.compile(f, backend="themis")(torch.randn(2, 4))
    assert out.shape == (2, 4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="themis_compile.optimize"):
        torch.compile(f, backend=B.make_themis_backend(strict=True))(torch.randn(3, 4))
    torch._dynamo.reset()


class _Broken(nn.Module):
    """Two layers with a graph break between them: dynamo compiles two graphs, neither with a MoE node."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def _themis_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "themis_compile.optimize" in str(w.message)]


@pytest.fixture
def cheap_inductor(monkeypatch):
    # What these tests check is decided before inductor runs: keep inductor out (it is slow on CPU).
    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", lambda gm, example_inputs, **kwargs: gm.forward)
    torch._dynamo.reset()
    B.reset_report()
    yield
    torch._dynamo.reset()


def test_model_not_optimized_warns_once_over_all_its_graphs(cheap_inductor):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_Broken(), backend="themis")(torch.randn(2, 4))
    assert out.shape == (2, 4)
    assert B.last_report().graphs_without_moe == 2
    (message,) = _themis_warnings(caught)
    assert "was not passed through themis_compile.optimize" in message
    with pytest.raises(Exception, match="not passed through themis_compile.optimize"):
        torch.compile(_Broken(), backend=B.make_themis_backend(strict=True))(torch.randn(3, 4))


@pytest.mark.parametrize("case", ["ep", "no-moe", "step-function"])
def test_optimized_model_without_themis_graphs_does_not_warn(cheap_inductor, case):
    """Under policy ep nothing is scheduled and every graph lacks a themis node (here ~15 graphs, broken at
    the runtime's host-side checks); a model optimize found no MoE layer in has none either. The model
    was optimized in both: no "was it optimized?" warning, even when a step function is compiled."""
    torch.manual_seed(0)
    if case == "no-moe":
        with pytest.warns(UserWarning, match="found no MoE layer"):
            model = themis_compile.optimize(_Broken(), themis_compile.ThemisConfig(policy="ep"))
        x = torch.randn(2, 4)
    else:
        cfg = MoEModelConfig(d_model=16, n_heads=2, n_layers=1, d_ffn=16, num_experts=4, top_k=2, seq_len=8,
                             vocab_size=16, aux_loss_weight=0.0)
        model = themis_compile.optimize(GPTMoE(cfg), themis_compile.ThemisConfig(policy="ep"))
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "step-function":
            out = torch.compile(lambda m, t: m(t).sum(), backend="themis")(model, x)
        else:
            out = torch.compile(model, backend="themis")(x)
    torch.testing.assert_close(out, model(x).sum() if case == "step-function" else model(x))
    assert B.last_report().graphs_without_moe >= (2 if case == "no-moe" else 3)
    assert _themis_warnings(caught) == [] and B.last_report().unoptimized_warnings == 0
    torch.compile(model, backend=B.make_themis_backend(strict=True))(x)      # strict: no error either


def _two_rank_compiled(rank: int, world_size: int) -> dict:
    import torch._functorch.config as fc

    from themis_compile.api import runtime_of

    cfg = MoEModelConfig(d_model=16, n_heads=2, n_layers=1, d_ffn=16, num_experts=4, top_k=2, seq_len=8,
                         vocab_size=16, experts_form="stacked", router_skew=2.0, aux_loss_weight=0.0)
    out = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        # Dense parameters through FSDP2: its hooks stay out of the captured graph, so the whole model
        # compiles as one graph (DDP's composable replicate() sets a class attribute in its forward
        # pre-hook, which dynamo cannot trace: a graph break).
        model = themis_compile.optimize(GPTMoE(cfg), themis_compile.ThemisConfig(
            policy="themis", reshard_interval=0, dense_parallel="fsdp2", cost_benefit=False))
        S.schedule_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        B.reset_report()
        run = model if mode == "eager" else torch.compile(model, backend="themis", fullgraph=True)
        g = torch.Generator().manual_seed(rank)
        losses = []
        with fc.patch(enable_autograd_cache=False), inductor_config.patch(NO_CACHE):
            for _ in range(2):
                tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
                loss = lm_loss(run(tokens), tokens)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        replicas = sum(s.delta_p for s in runtime_of(model).stats)
        out[mode] = {"losses": losses, "scheduled": [len(f) for f in B.last_report().forward],
                     "delta_p": replicas}
    torch._dynamo.reset()
    return out


def test_two_ranks_compiled_trains_like_eager_themis():
    from themis_compile.testing import run_multirank

    for rank_out in run_multirank(_two_rank_compiled, 2, timeout_s=240):
        eager, compiled = rank_out["eager"], rank_out["compiled"]
        assert compiled["scheduled"] and all(n >= 1 for n in compiled["scheduled"])
        assert eager["delta_p"] > 0 and compiled["delta_p"] > 0       # replicas were really materialized
        for a, b in zip(eager["losses"], compiled["losses"]):
            assert abs(a - b) <= 1e-5 * abs(a)
