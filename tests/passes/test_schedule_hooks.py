"""The scheduling pass on models FX cannot trace: attention windows from the order modules run in, placed
with module hooks (HF Mixtral, Qwen3-MoE and DeepSeek-V3 on 2 gloo ranks, trained against one process),
and the user's activation-checkpoint wrapping kept by the pass."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import themis_compile
from themis_compile.passes import schedule as S
from themis_compile.passes.windows import Event, attention_windows
from tests.passes.test_schedule import Attention, MoE
from tests.runtime.equivalence import _batches, _dense_params, _expert_chunks_reference, assert_equivalent

# Legend: B batch, S sequence, H hidden, T tokens, K top-k.


# ------------------------------------------------------------------------------- the order -> windows
def _ev(spec: str) -> list[Event]:
    # "a0( a0) m0( m0)" -> attention a0 starts, ends, MoE m0 starts, ends (names: m... MoE, else attention)
    out = []
    for tok in spec.split():
        kind = "moe" if tok[0] == "m" else "attn"
        out.append(Event(kind, tok[:-1], "start" if tok[-1] == "(" else "end"))
    return out


def test_windows_from_order():
    # plain decoder: each MoE takes the attention right before it
    assert attention_windows(_ev("a0( a0) m0( m0) a1( a1) m1( m1)")) == {"m0": "a0", "m1": "a1"}
    # hybrid first block (no attention), then nested attention: the outermost one is the window
    assert attention_windows(_ev("m0( m0) a1( i1( i1) a1) m1( m1)")) == {"m0": None, "m1": "a1"}
    # an attention before the previous MoE is not reused; a MoE running twice keeps its first window;
    # an attention inside a MoE block is not a window
    assert attention_windows(_ev("a0( a0) m0( a9( a9) m0) m1( m1) a2( a2) m0( m0)")) == {"m0": "a0", "m1": None}


# ------------------------------------------------------------------------------- one process, fake runtime
class UntraceableBlock(nn.Module):
    """A block whose forward has data-dependent Python (as HF decoder layers do): FX cannot trace it."""

    def __init__(self, log: list, i: int, attention: bool = True) -> None:
        super().__init__()
        self.attn = Attention(log, f"attn{i}") if attention else nn.Linear(8, 8)
        self.moe = MoE(log, f"moe{i}")

    def forward(self, x):
        if bool(x.abs().sum() < 0):
            raise AssertionError("unreachable")
        x = x + self.attn(x)
        return x + self.moe(x)


class Model(nn.Module):
    def __init__(self, log: list, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(UntraceableBlock(log, i, attention=i != 1) for i in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _fake_layers(model: Model) -> dict[str, nn.Module]:
    return {f"blocks.{i}.moe": b.moe.experts for i, b in enumerate(model.blocks)}


def test_hooks_place_start_before_attention_and_sprs_wait_after_its_backward():
    log: list = []
    model = Model(log)
    reference = copy.deepcopy(model)
    result = S.schedule_model(model, _fake_layers(model))
    assert result.graphs == {} and set(result.untraced) == set(_fake_layers(model))
    assert result.windows == {}                      # nothing known before the first forward

    x_BSH = torch.randn(2, 4, 8)
    # Step 1 is observed only: the runtime starts each SpAG at its own forward, the numerics are unchanged.
    log.clear()
    out = model(x_BSH)
    torch.testing.assert_close(out, reference(x_BSH))
    assert [e for e in log if e[0] == "spag_start"] == []
    windows = result.windows
    assert {n: w.attention for n, w in windows.items()} == {
        "blocks.0.moe": "blocks.0.attn", "blocks.1.moe": None, "blocks.2.moe": "blocks.2.attn"}
    assert windows["blocks.1.moe"].start == "after blocks.0.moe" and windows["blocks.1.moe"].fallback
    # the recorders are gone; only the schedule's hooks remain (attention 0, attention 2, MoE block 0)
    hooks = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
    assert {name: n for name, n in hooks.items() if n != (0, 0)} == {
        "blocks.0.attn": (1, 0), "blocks.2.attn": (1, 0), "blocks.0.moe": (0, 1)}

    # Step 2: start l -> attention l -> wait l -> MoE l; the hybrid layer starts when MoE 0 ends.
    x = x_BSH.clone().requires_grad_()
    x_ref = x_BSH.clone().requires_grad_()
    log.clear()
    out = model(x)
    expected = reference(x_ref)
    torch.testing.assert_close(out, expected)
    fwd = list(log)
    for i in (0, 2):
        seq = [fwd.index(e) for e in (("spag_start", f"moe{i}"), ("attn", f"attn{i}"), ("spag_wait", f"moe{i}"),
                                      ("moe", f"moe{i}"))]
        assert seq == sorted(seq), fwd
    assert fwd.index(("moe", "moe0")) < fwd.index(("spag_start", "moe1")) < fwd.index(("moe", "moe1"))
    # backward: SpRS waits at the end of attention l's backward (the fence on its input), none for the
    # hybrid layer (it has no window); gradients unchanged
    log.clear()
    out.square().sum().backward()
    expected.square().sum().backward()
    assert log == [("sprs_wait", "moe2"), ("sprs_wait", "moe0")]
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    # evaluation forwards start SpAG at the window too, and fence nothing
    log.clear()
    with torch.no_grad():
        model(x_BSH)
    assert log.index(("spag_start", "moe2")) < log.index(("attn", "attn2"))
    result.hooks.remove()
    assert all(len(m._forward_pre_hooks) + len(m._forward_hooks) == 0 for m in model.modules())


def test_fx_path_is_kept_where_it_traces():
    from tests.passes.test_schedule import Model as TraceableModel
    from tests.passes.test_schedule import _layers

    model = TraceableModel([], n=3, first_dense=True)
    result = S.schedule_model(model, _layers(model))
    assert result.untraced == [] and result.graphs
    # block 0 has no attention: its graph falls back; the hooks may only upgrade it, and there is no
    # attention before it in the run either, so it stays where its graph put it
    assert result.hooks is not None and result.hooks.upgrade_only == {"blocks.0.moe"}
    model(torch.randn(1, 3, 8))
    assert result.windows["blocks.0.moe"].start == "unchanged"


# ------------------------------------------------------------------------------- activation checkpointing
def _attention_counter(model: nn.Module) -> list:
    calls: list = []
    for name, m in model.named_modules():
        if S.is_attention_module(m):
            m.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
    return calls


def _reference_gpt(n_layers: int = 2):
    from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig

    torch.manual_seed(0)
    cfg = MoEModelConfig(d_model=16, n_heads=2, n_layers=n_layers, d_ffn=16, num_experts=4, top_k=2, seq_len=8,
                         vocab_size=16, experts_form="stacked", aux_loss_weight=0.0)
    return GPTMoE(cfg), cfg


def _wrap_forward(block: nn.Module) -> None:
    forward = block.forward
    block.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def _wrap_modules(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: m in set(model.blocks))


def _step_attention_calls(model: nn.Module, tokens_BS: torch.Tensor, loss_fn) -> int:
    calls = _attention_counter(model)
    for _ in range(2):           # the first forward is observed; count the second step
        calls.clear()
        loss_fn(model, tokens_BS).backward()
    return len(calls)


@pytest.mark.parametrize("wrap", ["plain", "forward", "apply_activation_checkpointing"])
def test_schedule_keeps_checkpoint_wrapping_of_reference_blocks(wrap):
    from themis_compile.models.gpt_moe import lm_loss

    model, cfg = _reference_gpt()
    if wrap == "forward":
        for block in model.blocks:
            _wrap_forward(block)
    elif wrap == "apply_activation_checkpointing":
        _wrap_modules(model)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy="ep"))
    layers = themis_compile.api.runtime_of(model).layers
    assert S.sharded_layers(model) == layers          # what schedule_model schedules without ``layers``
    result = S.schedule_model(model)
    if wrap == "apply_activation_checkpointing":
        # the wrapper does not trace (checkpoint); the block inside it does, and is scheduled in FX
        assert set(result.graphs) == {f"blocks.{i}._checkpoint_wrapped_module" for i in range(cfg.n_layers)}
    elif wrap == "forward":
        assert result.graphs == {} and len(result.untraced) == cfg.n_layers   # the user's forward is kept
    tokens_BS = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    calls = _step_attention_calls(model, tokens_BS, lambda m, t: lm_loss(m(t), t))
    assert calls == (1 if wrap == "plain" else 2) * cfg.n_layers


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_schedule_keeps_hf_gradient_checkpointing():
    from tests.runtime.equivalence import make_model, model_loss

    counts = {}
    for enabled in (False, True):
        model = make_model({"hf": "mixtral"})
        if enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy="ep"))
        S.schedule_model(model, themis_compile.api.runtime_of(model).layers)
        tokens_BS = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        counts[enabled] = _step_attention_calls(model, tokens_BS, model_loss)
    assert counts == {False: 2, True: 4}


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning")
@pytest.mark.parametrize("context", ["non-reentrant", "reentrant", "save_on_cpu", "no_grad"])
def test_tracer_refuses_what_a_graph_would_drop(context):
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            if context == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu():
                    return self.inner(x) + 1
            if context == "no_grad":
                with torch.no_grad():
                    return self.inner(x) + 1
            return checkpoint(self.inner, x, use_reentrant=context == "reentrant") + 1

    with pytest.raises(S.UntraceableForward, match="checkpointing"):
        S.trace_for_schedule(Outer())


# ------------------------------------------------------------------------------- HF models on 2 ranks
STEPS, GLOBAL_BATCH, SEQ = 3, 4, 8


def _hf_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family != "deepseek-v3":
        from tests.runtime.equivalence import make_model

        return make_model({"hf": family})
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # A dense first layer (first_k_dense_replace=1), group-limited sigmoid routing, one shared expert.
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                           first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    return DeepseekV3ForCausalLM(cfg)


def _loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def _reference(family: str):
    model = _hf_model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in _batches(STEPS, GLOBAL_BATCH, SEQ, model.config.vocab_size):
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _dense_params(model), _expert_chunks_reference(model)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _instrument(model: nn.Module, layers: dict, log: list) -> None:
    """Log the runtime's SpAG starts and SpRS waits, each attention's forward (inside it, after every
    pre-hook) and the begin of its backward (the gradient of its output)."""
    for name, experts in layers.items():
        for method in ("start_materialization", "wait_reduction", "start_rematerialization"):
            inner = getattr(experts, method)

            def logged(inner=inner, method=method, name=name):
                log.append((method, name))
                return inner()

            setattr(experts, method, logged)
    for name, m in model.named_modules():
        if S.is_attention_module(m):
            inner = m.forward

            def forward(*args, inner=inner, name=name, **kwargs):
                log.append(("attn_forward", name))
                out = inner(*args, **kwargs)
                if torch.is_grad_enabled():
                    out[0].register_hook(lambda g, name=name: log.append(("attn_backward", name)))
                return out

            m.forward = forward


def _hf_rank(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    import torch.distributed as dist

    out = {}
    for family, policy in cases:
        capture = _Capture()
        logging.getLogger("themis_compile").addHandler(capture)
        logging.getLogger("themis_compile").setLevel(logging.DEBUG)
        model = themis_compile.optimize(_hf_model(family), themis_compile.ThemisConfig(
            policy=policy, reshard_interval=0, overlap_degree=4, materialization_budget=2))
        runtime = themis_compile.api.runtime_of(model)
        logging.getLogger("themis_compile").removeHandler(capture)
        result = S.schedule_of(model)
        log: list = []
        _instrument(model, runtime.layers, log)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        local = GLOBAL_BATCH // world_size
        losses, steps = [], []
        for tokens in _batches(STEPS, GLOBAL_BATCH, SEQ, model.config.vocab_size):
            log.clear()
            loss = _loss(model, tokens[rank * local:(rank + 1) * local])
            log.append(("backward", ""))
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append(list(log))
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world_size)
        owned = {}
        for li, (_name, experts) in enumerate(runtime.layers.items()):
            for e, chunk in experts.local_chunks().items():
                owned[(li, e)] = [t.detach().clone() for t in chunk]
        out[family, policy] = dict(
            result=(losses, _dense_params(model), owned, None), steps=steps, messages=capture.messages,
            untraced=list(result.untraced), windows={n: w.attention for n, w in result.windows.items()},
            delta_p=sum(s.delta_p for s in runtime.stats))
    return out


# themis-rm: the replicas of layer 0 are released after its forward and re-gathered (prefetched when
# layer 1's MoE backward ends, inside attention 1's backward window).
CASES = [("mixtral", "themis"), ("qwen3-moe", "themis"), ("deepseek-v3", "themis"), ("mixtral", "themis-rm")]


@pytest.fixture(scope="module")
def hf_runs():
    from themis_compile.testing import run_multirank

    return run_multirank(_hf_rank, 2, args=(CASES,), timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hf_attention_windows_on_two_ranks(hf_runs, case):
    for rank_out in hf_runs:
        run = rank_out[case]
        assert not [m for m in run["messages"] if "no traceable" in m or "no overlap" in m], run["messages"]
        layers = run["untraced"]
        assert layers and run["windows"] == {n: n.replace(".mlp", ".self_attn") for n in layers}
        assert run["delta_p"] > 0                 # replicas were really gathered
        for step, log in enumerate(run["steps"][1:], start=1):   # step 0 is the observed forward
            split = log.index(("backward", ""))
            fwd, bwd = log[:split], log[split:]
            for i, name in enumerate(layers):
                attn = name.replace(".mlp", ".self_attn")
                # SpAG of layer l starts before attention l's forward, after the previous layer's
                start = fwd.index(("start_materialization", name))
                assert start < fwd.index(("attn_forward", attn)), (step, fwd)
                if i > 0:
                    assert fwd.index(("attn_forward", layers[i - 1].replace(".mlp", ".self_attn"))) < start
                # the SpRS wait of layer l is in attention l's backward window: after it begins, before
                # the backward of the attention before it
                wait = bwd.index(("wait_reduction", name))
                assert bwd.index(("attn_backward", attn)) < wait, (step, bwd)
                earlier = [a for a in (e[1] for e in bwd if e[0] == "attn_backward") if a < attn]
                if earlier:
                    assert wait < bwd.index(("attn_backward", max(earlier))), (step, bwd)
                # themis-rm: the re-gather of layer l-1's released replicas is issued in the same window
                if case[1] == "themis-rm" and i > 0:
                    prefetch = bwd.index(("start_rematerialization", layers[i - 1]))
                    assert prefetch < bwd.index(("attn_backward", attn)) < wait, (step, bwd)


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hf_scheduled_training_equals_one_process(hf_runs, case):
    assert_equivalent(_reference(case[0]), [r[case]["result"] for r in hf_runs])
