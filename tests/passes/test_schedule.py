"""The scheduling pass: node order on hand-built and traced FX graphs, eager numerics, and the order in
which a (fake) runtime sees its calls."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from themis_compile.passes import schedule as S

# Legend: B batch, S sequence, H hidden, T tokens, K top-k.


class FakeExperts(nn.Module):
    """Stands in for a runtime's sharded experts and records the calls the pass makes."""

    def __init__(self, log: list, name: str, hidden: int = 8) -> None:
        super().__init__()
        self.log, self.layer = log, name
        self.w = nn.Parameter(torch.randn(hidden, hidden) * 0.1)

    def start_materialization(self) -> None:
        self.log.append(("spag_start", self.layer))

    def wait_materialization(self) -> None:
        self.log.append(("spag_wait", self.layer))

    def wait_reduction(self) -> None:
        self.log.append(("sprs_wait", self.layer))

    def forward(self, x_TH, ids_TK, weights_TK):
        self.wait_materialization()          # as the runtime does, just before dispatch
        self.log.append(("moe", self.layer))
        return (x_TH @ self.w) * weights_TK.sum(-1, keepdim=True)


class Attention(nn.Module):
    def __init__(self, log: list, name: str, hidden: int = 8) -> None:
        super().__init__()
        self.log, self.name = log, name
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x_BSH):
        self.log.append(("attn", self.name))
        q, k, v = self.qkv(x_BSH).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MoE(nn.Module):
    def __init__(self, log: list, name: str, hidden: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, 4)
        self.experts = FakeExperts(log, name, hidden)

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights_TK, ids_TK = torch.topk(torch.softmax(self.gate(x_TH), -1), 2)
        return self.experts(x_TH, ids_TK, weights_TK).view_as(x_BSH)


class Block(nn.Module):
    def __init__(self, log: list, i: int, attention: bool = True) -> None:
        super().__init__()
        self.attn = Attention(log, f"attn{i}") if attention else nn.Linear(8, 8)
        self.moe = MoE(log, f"moe{i}")

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.moe(x)


class Model(nn.Module):
    """Block 0 is hybrid (no attention before its MoE), blocks 1.. have attention."""

    def __init__(self, log: list, n: int = 3, first_dense: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(log, i, attention=not (first_dense and i == 0)) for i in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _layers(model: Model) -> dict[str, nn.Module]:
    return {f"blocks.{i}.moe": b.moe.experts for i, b in enumerate(model.blocks)}


def _names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes]


# ------------------------------------------------------------------------------- hand-built graphs
def _hand_graph(existing_ops: bool):
    """x -> mm (dense) -> sdpa -> mm -> moe_experts(layer 7); with existing_ops the start/wait are adjacent
    to the MoE node, as torch.compile captures them."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    ids = g.placeholder("ids")
    gate = g.placeholder("gate")
    h = g.call_function(torch.mm, (x, w))
    a = g.call_function(F.scaled_dot_product_attention, (h, h, h))
    y = g.call_function(torch.mm, (a, w))
    if existing_ops:
        tok = g.call_function(torch.ops.themis.spag_start.default, (7,))
        ready = g.call_function(torch.ops.themis.spag_wait.default, (tok, 7))
    else:
        ready = g.call_function(torch.zeros, (1,))
    moe = g.call_function(torch.ops.themis.moe_experts.default, (y, ids, gate, ready, 7, True))
    out = g.call_function(lambda t: t[0], (moe,))
    g.output(out)
    return g


def test_hand_built_compiled_graph_moves_start_before_attention():
    g = _hand_graph(existing_ops=True)
    (sched,) = S.schedule_graph(g)
    g.lint()
    (start,) = [n for n in g.nodes if S.is_spag_start(n)]
    (wait,) = [n for n in g.nodes if S.is_spag_wait(n)]
    (moe,) = [n for n in g.nodes if S.is_moe_experts(n)]
    assert sched.layer == 7 and not sched.fallback
    assert start.next.target is F.scaled_dot_product_attention
    assert wait.next is moe and wait.args[0] is start
    assert start.prev.target is torch.mm   # dense compute before attention is not the window


def test_hand_built_graph_inserts_ops_and_fences_and_is_idempotent():
    g = _hand_graph(existing_ops=False)
    (sched,) = S.schedule_graph(g, insert_fences=True)
    g.lint()
    first = _names(g)
    starts = [n for n in g.nodes if S.is_spag_start(n)]
    waits = [n for n in g.nodes if S.is_spag_wait(n)]
    fences = [n for n in g.nodes if S.is_reduction_fence(n)]
    assert len(starts) == len(waits) == 1 and waits[0].args[0] is starts[0]
    assert first.index(starts[0].name) < first.index("scaled_dot_product_attention")
    assert S.is_moe_experts(waits[0].next)
    # the fence feeds the attention: its backward is the end of attention's backward
    (fence,) = fences
    assert fence.args[0].name == "mm" and fence in g.find_nodes(op="call_function", target=F.scaled_dot_product_attention)[0].all_input_nodes
    assert sched.fences == (fence.name,)
    S.schedule_graph(g, insert_fences=True)
    g.lint()
    assert _names(g) == first


def test_layer_without_attention_falls_back_to_earliest_legal_point():
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    ids = g.placeholder("ids")
    h = g.call_function(torch.mm, (x, w))
    r0 = g.call_function(torch.zeros, (1,))
    m0 = g.call_function(torch.ops.themis.moe_experts.default, (h, ids, h, r0, 1, True))
    y0 = g.call_function(lambda t: t[0], (m0,))
    h1 = g.call_function(torch.mm, (y0, w))
    m1 = g.call_function(torch.ops.themis.moe_experts.default, (h1, ids, h1, r0, 2, True))
    g.output(m1)
    s0, s1 = S.schedule_graph(g)
    g.lint()
    assert s0.fallback and s1.fallback
    start_0 = next(n for n in g.nodes if S.is_spag_start(n) and n.args[0] == 1)
    start_1 = next(n for n in g.nodes if S.is_spag_start(n) and n.args[0] == 2)
    assert start_0.prev is ids and start_0.next is h                 # layer 1: the first compute node
    assert start_1.prev is m0 and start_1.next is y0                 # layer 2: right after the previous MoE


def test_attention_before_previous_moe_is_not_reused():
    # attention -> moe A -> dense -> moe B: B's window is not A's attention (it lies before A).
    g = fx.Graph()
    x = g.placeholder("x")
    ids = g.placeholder("ids")
    a = g.call_function(F.scaled_dot_product_attention, (x, x, x))
    r = g.call_function(torch.zeros, (1,))
    ma = g.call_function(torch.ops.themis.moe_experts.default, (a, ids, a, r, 10, True))
    ya = g.call_function(lambda t: t[0], (ma,))
    d = g.call_function(torch.relu, (ya,))
    mb = g.call_function(torch.ops.themis.moe_experts.default, (d, ids, d, r, 11, True))
    g.output(mb)
    sa, sb = S.schedule_graph(g)
    assert not sa.fallback and sa.attention.startswith("sdpa:")
    assert sb.fallback and sb.attention is None


def test_regions_from_annotations_take_the_first_node():
    g = fx.Graph()
    x = g.placeholder("x")
    ids = g.placeholder("ids")
    q = g.call_function(torch.relu, (x,))
    k = g.call_function(torch.tanh, (q,))
    for n in (q, k):
        n.meta["custom"] = {"themis_region": "attn", "themis_attn": "blocks.0.attn"}
    r = g.call_function(torch.zeros, (1,))
    m = g.call_function(torch.ops.themis.moe_experts.default, (k, ids, k, r, 3, True))
    g.output(m)
    (s,) = S.schedule_graph(g)
    assert s.attention == "custom:blocks.0.attn"
    assert s.start_before == "relu"


# ------------------------------------------------------------------------------- traced eager graphs
def test_traced_model_order_fallback_and_numerics():
    log: list = []
    model = Model(log, n=3, first_dense=True)
    reference = copy.deepcopy(model)
    x_BSH = torch.randn(2, 4, 8)
    expected = reference(x_BSH)

    result = S.schedule_model(model, _layers(model))
    assert set(result.layers) == set(_layers(model)) and result.untraced == []
    assert result.layers["blocks.0.moe"].fallback
    assert not result.layers["blocks.1.moe"].fallback and result.layers["blocks.1.moe"].attention == "module:blocks.1.attn"
    gm = next(iter(result.graphs.values()))
    gm.graph.lint()
    names = _names(gm.graph)
    # the start of layer 1 is immediately before attention 1; its wait immediately before MoE 1
    s1 = next(n for n in gm.graph.nodes if S.is_spag_start(n) and n.args[0] == result.layers["blocks.1.moe"].layer)
    assert s1.next.target == "blocks.1.attn"
    w1 = next(n for n in gm.graph.nodes if S.is_spag_wait(n) and n.args[1] == s1.args[0])
    assert w1.next.target == "blocks.1.moe"
    assert names.index(s1.name) > names.index(next(n.name for n in gm.graph.nodes if n.target == "blocks.0.moe"))

    # eager numerics unchanged, and the runtime sees: start l -> attention l -> wait l -> moe l,
    # and in backward the SpRS wait of layer l after MoE l's backward (at the end of attention l's).
    x = x_BSH.clone().requires_grad_()
    log.clear()
    out = model(x)
    torch.testing.assert_close(out, expected)
    fwd = list(log)
    for i in (1, 2):
        seq = [fwd.index(e) for e in (("spag_start", f"moe{i}"), ("attn", f"attn{i}"), ("spag_wait", f"moe{i}"),
                                      ("moe", f"moe{i}"))]
        assert seq == sorted(seq), fwd
    assert fwd.index(("spag_start", "moe0")) < fwd.index(("spag_wait", "moe0")) < fwd.index(("moe", "moe0"))
    log.clear()
    out.sum().backward()
    expected.sum().backward()
    assert log == [("sprs_wait", "moe2"), ("sprs_wait", "moe1")]
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)


def test_untraceable_root_schedules_traceable_children():
    log: list = []

    class Root(Model):
        def forward(self, x):
            if x.shape[1] > 100:  # data-dependent Python control flow: the root does not trace
                raise ValueError("too long")
            return super().forward(x)

    model = Root(log, n=2, first_dense=False)
    result = S.schedule_model(model, _layers(model))
    assert set(result.graphs) == {"blocks.0", "blocks.1"}
    assert all(not s.fallback for s in result.layers.values())
    names = set(dict(model.named_parameters()))
    assert not any("_themis" in n for n in names)       # the scheduled graphs are not submodules
    model(torch.randn(1, 3, 8))
    assert log.index(("spag_start", "moe1")) < log.index(("attn", "attn1")) < log.index(("spag_wait", "moe1"))


def test_mark_attention_and_detection():
    lin = nn.Linear(4, 4)
    assert not S.is_attention_module(lin)
    assert S.mark_attention(lin) is lin and S.is_attention_module(lin)
    assert S.is_attention_module(Attention([], "a"))
    try:
        S.mark_attention("not a module")  # type: ignore[arg-type]
    except ValueError as exc:
        assert "nn.Module" in str(exc)
    else:
        raise AssertionError("mark_attention accepted a non-module")


def test_schedule_model_without_layers_raises():
    try:
        S.schedule_model(nn.Linear(2, 2), {})
    except ValueError as exc:
        assert "optimize" in str(exc)
    else:
        raise AssertionError("expected ValueError")


# ------------------------------------------------------------------------------- the runtime's end of the fence
class _Handle:
    def __init__(self, name: str, done: bool) -> None:
        self.name, self.done = name, done

    def is_completed(self) -> bool:
        return self.done


class _Layer:
    """Enough of an FSSDP layer for `FSSDPExperts.wait_reduction`: the shared pending list."""

    def __init__(self, state, taken: list) -> None:
        self.state, self.taken = state, taken

    def accumulate_reduced(self, handle) -> None:
        self.taken.append(handle.name)


def test_fence_takes_a_finished_reduction_and_leaves_one_in_flight():
    """At the end of attention l's backward the fence blocks on nothing: a finished SpRS of l is accumulated
    there, one in flight (and every later one of l, so that .grad sums them in issue order) is left to the
    end of the backward; other layers' reductions are not touched."""
    from types import SimpleNamespace

    from themis_compile.runtime.fssdp import FSSDPExperts

    taken: list = []
    state = SimpleNamespace(pending=[])
    layer, other = _Layer(state, taken), _Layer(state, taken)
    h1, h2, h3, h4 = _Handle("l1", True), _Handle("other", True), _Handle("l3", False), _Handle("l4", True)
    state.pending = [(layer, h1), (other, h2), (layer, h3), (layer, h4)]
    FSSDPExperts.wait_reduction(layer)
    assert taken == ["l1"]
    assert state.pending == [(other, h2), (layer, h3), (layer, h4)]
    h3.done = True
    FSSDPExperts.wait_reduction(layer)
    assert taken == ["l1", "l3", "l4"] and state.pending == [(other, h2)]


def _background_jobs_rank(rank: int, world: int) -> dict:
    import themis_compile
    from themis_compile.models.gpt_moe import GPTMoE, MoEModelConfig, lm_loss
    from themis_compile.runtime import collectives

    torch.manual_seed(0)
    model = GPTMoE(MoEModelConfig(d_model=16, n_heads=2, n_layers=2, d_ffn=16, num_experts=4, top_k=2, seq_len=8,
                                  vocab_size=16, experts_form="stacked", router_skew=4.0))
    out = {}
    for budget in (0, 2):      # no replica may be added / replicas of the skewed experts
        m = themis_compile.optimize(copy.deepcopy(model), themis_compile.ThemisConfig(
            policy="themis", overlap_degree=budget, materialization_budget=budget, cost_benefit=False,
            reshard_interval=0))
        assert S.schedule_of(m) is not None and S.schedule_of(m).layers
        submitted = []
        submit = collectives._GroupWorker.submit
        collectives._GroupWorker.submit = lambda self, job: (submitted.append(job), submit(self, job))[1]
        try:
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                tokens = torch.randint(0, 16, (2, 8), generator=g)
                lm_loss(m(tokens), tokens).backward()
        finally:
            collectives._GroupWorker.submit = submit
        out[budget] = len(submitted)
    return out


def test_nothing_to_hide_costs_no_background_work():
    """With the pass on and no replica to gather (budgets 0), no SpAG or SpRS job reaches the collectives'
    background thread: nothing competes with the attention the pass would hide it behind. With replicas,
    jobs do run there (the check can fail)."""
    from themis_compile.testing import run_multirank

    for jobs in run_multirank(_background_jobs_rank, 2):
        assert jobs[0] == 0 and jobs[2] > 0, jobs
