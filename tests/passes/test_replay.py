"""Capture and replay (themis_compile/passes/replay.py): blocks whose untraceable forward calls
``experts[i](rows)`` itself keep their routing code and are served by one ``experts(x, ids, weights)``
call. Held equal to the original on a probe (outputs, gradients, buffer updates, stored attributes),
and 2 gloo ranks under ``themis`` equal to one process (one process group for every block)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import themis_compile
from tests.passes import zoo_models as zoo
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.replay import ReplayError, ReplayPlan, apply_replay, replay_mismatch
from themis_compile.passes.styles import prepare_moe_layers


class DeepseekV3NoSkip(zoo.DeepseekV3MoE):
    """The DeepSeek-V3 reference block with one line less: experts without tokens are called on an empty
    batch of rows instead of skipped (``if num_tokens == 0: continue`` removed)."""

    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert.cpu().numpy()):
            end_idx = start_idx + num_tokens
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1)


class SlotLoopMoE(nn.Module):
    """Each slot k, each expert (in reverse order): ``experts[e](x[rows])`` with rows from ``.tolist()``
    (untraceable); every expert called K times, some with no rows. In-place jitter on the input in
    training (RNG), a statistics buffer updated in place, a load-balancing loss stored on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(zoo.H, zoo.E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(zoo.H, zoo.FFN), nn.GELU(), nn.Linear(zoo.FFN, zoo.H))
                                     for _ in range(zoo.E))
        self.register_buffer("tokens_per_expert", torch.zeros(zoo.E))
        self.jitter = 0.05

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        if self.training:
            hidden *= torch.empty_like(hidden).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        x = hidden.reshape(-1, shape[-1])
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(zoo.K, dim=-1)
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(ids.flatten(), minlength=zoo.E).float()
        self.aux_loss = (probs.mean(0) * F.one_hot(ids[:, 0], zoo.E).float().mean(0)).sum() * zoo.E
        out = torch.zeros_like(x)
        for k in range(zoo.K):
            for e in reversed(range(len(self.experts))):
                rows = [t for t, i in enumerate(ids[:, k].tolist()) if i == e]
                y = self.experts[e](x[rows])
                out = out.index_add(0, torch.tensor(rows, dtype=torch.long), y * weights[rows, k, None])
        return out.view(shape)


class ChainedExperts(SlotLoopMoE):
    """Expert 1 runs on expert 0's output: not servable (pass A answers zeros)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        ids = self.router(x).topk(zoo.K, dim=-1).indices
        first = self.experts[0](x)
        rows = [t for t, i in enumerate(ids[:, 0].tolist()) if i != 0]
        out = first
        for e in range(1, len(self.experts)):
            out = out + self.experts[e](first[rows]).sum(0)
        return out.view(hidden.shape)


BLOCKS = {"deepseek_v3_no_skip": DeepseekV3NoSkip, "slot_loop": SlotLoopMoE}


def _lm(name: str) -> zoo.ZooLM:
    torch.manual_seed(0)
    model = zoo.ZooLM("deepseek_v3")
    for layer in model.layers:
        layer.moe = BLOCKS[name]()
        # Jitter draws one random number per token: R ranks draw other numbers than one process on the
        # whole batch, whatever the rewrite. The probe tests keep it.
        layer.moe.jitter = 0.0
    return model


def _block(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BLOCKS[name]()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_untraceable_loops_are_found_as_replay(name):
    infos, rejected = find_moe_layers(_lm(name))
    assert rejected == []
    assert [i.name for i in infos] == ["layers.0.moe", "layers.1.moe"]
    assert {(i.rewrite, i.num_experts, i.top_k) for i in infos} == {("replay", zoo.E, zoo.K)}
    # Pass A stops at the E-th call only for a block seen calling every expert once.
    assert infos[0].plan == ReplayPlan(num_experts=zoo.E, calls_each_once=name == "deepseek_v3_no_skip",
                                       hidden_size=zoo.H)
    assert "capture and replay" in themis_compile.explain(_lm(name))


def _outputs_and_grads(block: nn.Module, x: torch.Tensor, training: bool):
    block.train(training)
    torch.manual_seed(7)
    x = x.clone().requires_grad_(True)
    out = block(x.clone())
    params = list(block.parameters())
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), [x] + params)
    return out.detach(), grads, block.tokens_per_expert.clone() if hasattr(block, "tokens_per_expert") else None, \
        getattr(block, "aux_loss", None)


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("training", [True, False])
def test_rewritten_block_equals_the_original_with_gradients_and_state(name, training):
    original = _block(name)
    rewritten = copy.deepcopy(original)
    (info,) = prepare_moe_layers(rewritten)
    assert info.rewritten and type(rewritten).__name__ == type(original).__name__
    assert [n for n, _ in rewritten.named_parameters()] == [n for n, _ in original.named_parameters()]
    x = torch.randn(3, 5, zoo.H, generator=torch.Generator().manual_seed(1))
    for _ in range(2):   # twice: the statistics buffer is updated once per forward, not twice
        out_a, grads_a, buf_a, aux_a = _outputs_and_grads(original, x, training)
        out_b, grads_b, buf_b, aux_b = _outputs_and_grads(rewritten, x, training)
        torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads_a, grads_b):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        if buf_a is not None:
            assert buf_a.sum() > 0
            torch.testing.assert_close(buf_b, buf_a)
        if aux_a is not None:
            torch.testing.assert_close(aux_b, aux_a)


def test_capture_stops_at_the_last_expert_call_when_each_runs_once():
    """The code after the expert loop (DeepSeek-V3: the shared expert) runs only in the replayed pass."""
    for name, runs in (("deepseek_v3_no_skip", 1), ("slot_loop", 2)):
        block = _block(name)
        prepare_moe_layers(block)
        probe = block.shared_experts if name == "deepseek_v3_no_skip" else block.router
        calls = []
        probe.register_forward_hook(lambda *_: calls.append(1))
        block(torch.randn(2, 3, zoo.H))
        assert len(calls) == runs, name


def test_a_skipping_block_is_served_and_marked_and_a_chained_one_rejected_with_the_reason():
    # The DeepSeek-V3 loop skips experts without tokens: served by capture and replay, and marked so that
    # the runtime leaves those experts' gradients None, as the loop does.
    infos, rejected = find_moe_layers(zoo.ZooLM("deepseek_v3"))
    assert rejected == [] and [(i.name, i.rewrite, i.skips_empty_experts) for i in infos] == [
        ("layers.0.moe", "replay", True), ("layers.1.moe", "replay", True)]
    infos, rejected = find_moe_layers(ChainedExperts())
    assert infos == [] and "depend on other experts' outputs" in rejected[0][1], rejected


def test_a_block_skipping_empty_experts_replays_with_their_gradient_none():
    """For a runtime that leaves experts without tokens ungraded: the skipping DeepSeek-V3 block served
    by capture and replay equals the original, None gradients included (one token: 2 of 4 experts)."""
    original = zoo.DeepseekV3MoE()
    x = torch.randn(1, 1, zoo.H)
    plan, why = replay_mismatch(original, "experts", x, seed=0, allow_skipping=True)
    assert why is None and plan.skips_empty
    rewritten = copy.deepcopy(original)
    apply_replay(rewritten, "experts", plan, layer="skip")
    for block in (original, rewritten):
        block(x).sum().backward()
    got = {n: p.grad for n, p in rewritten.named_parameters()}
    for n, p in original.named_parameters():
        assert (p.grad is None) == (got[n] is None), n
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad)
    assert any(p.grad is None for p in original.experts.parameters())


class _Drifting(SlotLoopMoE):
    """Row selection driven by state outside the module's attributes and buffers (a list it appends to):
    the replayed forward calls its experts otherwise than the captured one."""

    log: list = []

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.log.append(1)
        x = hidden.reshape(-1, hidden.shape[-1])
        return sum(self.experts[e](x[: len(self.log) % 2 + 1]).sum() for e in range(len(self.experts))) + x


def test_replayed_calls_that_differ_from_the_captured_ones_raise():
    block = _Drifting()
    apply_replay(block, "experts", ReplayPlan(num_experts=zoo.E), layer="drift")
    with pytest.raises(ReplayError, match="expert call 0 is expert 0 on rows"):
        block(torch.randn(4, zoo.H))
    skipping = zoo.DeepseekV3MoE()
    apply_replay(skipping, "experts", ReplayPlan(num_experts=zoo.E), layer="skip")
    with pytest.raises(ReplayError, match="did not call experts"):
        skipping(torch.randn(1, 1, zoo.H))


class DictLoopMoE(nn.Module):
    """Experts in an ``nn.ModuleDict`` next to a parameter-free entry (a token dropout on each expert's
    output, NLLB style), run one by one by the block itself over ``.tolist()`` rows (untraceable), only
    those with tokens; top-2 softmax routing. ``access`` is how the loop reaches the experts: the ways
    real code reaches ModuleDict entries, each with ``len`` or ``in`` beside it."""

    ACCESS = ("getattr", "getitem", "items", "values", "keys", "iter")

    class DenseActDense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wi, self.wo = nn.Linear(zoo.H, zoo.FFN), nn.Linear(zoo.FFN, zoo.H)

        def forward(self, x):
            return self.wo(F.relu(self.wi(x)))

    def __init__(self, access: str) -> None:
        super().__init__()
        self.access = access
        self.router = nn.Linear(zoo.H, zoo.E, bias=False)
        self.experts = nn.ModuleDict({f"expert_{i}": self.DenseActDense() for i in range(zoo.E)})
        self.experts["token_dropout"] = nn.Dropout(0.2)

    def _experts(self):
        d, access = self.experts, self.access
        if access == "getattr":
            return [(e, getattr(d, f"expert_{e}")) for e in range(len(d) - 1)]
        if access == "getitem":
            return [(e, d[f"expert_{e}"]) for e in range(zoo.E) if f"expert_{e}" in d]
        if access == "items":
            return [(int(k.split("_")[1]), m) for k, m in d.items() if k.startswith("expert_")]
        if access == "values":
            return list(enumerate(list(d.values())[:len(d) - 1]))
        keys = d.keys() if access == "keys" else iter(d)
        return [(int(k.split("_")[1]), d[k]) for k in keys if k != "token_dropout"]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        weights, ids = self.router(x).softmax(dim=-1).topk(zoo.K, dim=-1)
        dropout = self.experts["token_dropout"] if "token_dropout" in self.experts else nn.Identity()
        out = torch.zeros_like(x)
        for e, expert in self._experts():
            pairs = [(t, k) for t, row in enumerate(ids.tolist()) for k, i in enumerate(row) if i == e]
            if not pairs:
                continue
            token, slot = (list(v) for v in zip(*pairs))
            y = dropout(expert(x[token])) * weights[token, slot, None]
            out = out.index_add(0, torch.tensor(token, dtype=torch.long), y)
        return out.view(hidden.shape)


class DictExpertReadInRouting(DictLoopMoE):
    """The router reads an expert's weight (``self.experts["expert_0"].wi.weight``): an expert read as a
    module, which capture and replay cannot serve (the expert's parameters live in the runtime)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        tied = (x @ self.experts["expert_0"].wi.weight[:zoo.E].t()).softmax(dim=-1)
        self.router_z = tied.mean()
        return super().forward(hidden)


@pytest.mark.parametrize("access", DictLoopMoE.ACCESS)
def test_moduledict_experts_run_by_the_block_are_served_equal_to_the_original(access):
    """Outputs and gradients (train with the token dropout, and eval), on a probe where every expert gets
    tokens and on one token (2 of 4 experts: the others' gradients stay None, as in the original)."""
    torch.manual_seed(0)
    original = DictLoopMoE(access)
    rewritten = copy.deepcopy(original)
    (info,) = prepare_moe_layers(rewritten, strict=True)
    assert (info.rewrite, info.experts_form, info.num_experts, info.top_k, info.router_path) == (
        "replay", "moduledict", zoo.E, zoo.K, "router")
    assert info.skips_empty_experts and info.plan.skips_empty
    assert info.plan.expert_keys == tuple(f"expert_{e}" for e in range(zoo.E))
    assert [n for n, _ in rewritten.named_parameters()] == [n for n, _ in original.named_parameters()]
    for shape in ((3, 5, zoo.H), (1, 1, zoo.H)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        for training in (True, False):
            results = []
            for block in (original, rewritten):
                block.train(training)
                torch.manual_seed(7)
                x_in = x.clone().requires_grad_(True)
                out = block(x_in)
                loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
                results.append((out.detach(), torch.autograd.grad(loss, [x_in] + list(block.parameters()),
                                                                  allow_unused=True)))
            (out_a, grads_a), (out_b, grads_b) = results
            torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
            names = ["input"] + [n for n, _ in original.named_parameters()]
            for name, a, b in zip(names, grads_a, grads_b):
                assert (a is None) == (b is None), (shape, training, name)
                if a is not None:
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{shape} {training} {name}")
            nones = sum(g is None for g in grads_a)
            assert nones == (2 * 4 if shape[0] == 1 else 0), f"{shape}: {nones} parameters without gradient"


def test_moduledict_experts_read_as_modules_are_rejected_with_the_reason():
    infos, rejected = find_moe_layers(DictExpertReadInRouting("getattr"))
    assert infos == [] and len(rejected) == 1, (infos, rejected)
    why = rejected[0][1]
    assert "runs the experts in 'experts' (ModuleDict) one by one itself" in why, why
    assert "expert 0 is read as .wi inside the forward" in why, why


def test_moduledict_view_behaves_like_the_moduledict():
    """What the block's forward sees in place of the ModuleDict (either pass)."""
    from themis_compile.passes.replay import ExpertsDictView, _Capture, dict_layout

    block = DictLoopMoE("items")
    keys, expert_keys = dict_layout(block.experts)
    assert keys == tuple(block.experts.keys()) and expert_keys == keys[:zoo.E]
    view = ExpertsDictView(_Capture(zoo.E, stop_at_last=False), keys, expert_keys,
                           {"token_dropout": block.experts["token_dropout"]})
    assert len(view) == len(block.experts) and list(view) == list(block.experts) == list(view.keys())
    assert "expert_3" in view and "expert_4" not in view
    assert view["token_dropout"] is block.experts["token_dropout"] is view.token_dropout
    assert getattr(view, "expert_2") is view["expert_2"] is dict(view.items())["expert_2"]
    assert list(view.values())[2] is view["expert_2"] and view["expert_2"] is not view["expert_1"]
    with pytest.raises(KeyError):
        view["expert_9"]
    with pytest.raises(AttributeError, match="not one of their entries"):
        view.num_experts
    with pytest.raises(AttributeError, match="expert 2 is read as .wi"):
        view.expert_2.wi


class _DriftsWhenTold(DeepseekV3NoSkip):
    """Once ``drift`` is set, its replayed pass makes one expert call more than its captured one (a
    count kept in a list, which pass A's isolation does not restore): a ReplayError on that rank only."""

    drift = False

    def moe_infer(self, x, topk_ids, topk_weight):
        if self.drift:
            self.passes.append(1)
            if len(self.passes) % 2 == 0:
                self.experts[0](x[:1])
        return super().moe_infer(x, topk_ids, topk_weight)


def _one_rank_fails(rank: int, world_size: int):
    """Rank 1's first MoE layer raises ReplayError in its forward, and rank 1 stays alive (it caught the
    error; over NCCL a dead peer is not noticed either): rank 0 waits in the runtime's next collective.
    Each rank: (error type, message, seconds from the forward to the error, failed_rank)."""
    import datetime
    import time

    import torch.distributed as dist

    torch.manual_seed(0)
    model = zoo.ZooLM("deepseek_v3")
    for layer in model.layers:
        layer.moe = _DriftsWhenTold()
        layer.moe.passes = []
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy="themis", collective_timeout_s=90),
                                    strict=True)
    if rank == 1:
        model.layers[0].moe.drift = True
    tokens = torch.randint(0, zoo.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    store = dist.distributed_c10d._get_default_store()
    start = time.monotonic()
    try:
        model.loss(tokens).backward()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        result = type(exc).__name__, str(exc), time.monotonic() - start, getattr(exc, "failed_rank", None)
    else:
        result = None
    if rank == 0:
        store.set("test_replay/rank0_done", "1")
    else:
        store.wait(["test_replay/rank0_done"], datetime.timedelta(seconds=100))
    return result


STEPS, BATCH, SEQ = 3, 4, 8


def _train(model: nn.Module):
    losses = zoo.train_losses(model, STEPS, BATCH, SEQ)
    return losses, zoo.dense_params(model)


def _ranks(rank: int, world_size: int, names: list[str]):
    out = {}
    for name in names:
        model = themis_compile.optimize(_lm(name), themis_compile.ThemisConfig(policy="themis"), strict=True)
        out[name] = _train(model)
    out["caught failure"] = _a_caught_failure_is_withdrawn(rank, world_size)
    out["one rank fails"] = _one_rank_fails(rank, world_size)    # last: it leaves the group unusable
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """One process group of 2 gloo ranks for the distributed cases of this file."""
    from themis_compile.testing.multirank import run_multirank

    return run_multirank(_ranks, 2, args=(sorted(BLOCKS),), timeout_s=180)


def _a_caught_failure_is_withdrawn(rank: int, world_size: int):
    """Rank 1 reports a failure, catches it and goes on: its next collective withdraws the report, so a
    later wait of rank 0 longer than WATCH_S (a slow peer, which makes it read the store) completes.
    Each rank: (the sum, seconds rank 0 waited in the slow collective)."""
    import time

    from themis_compile.runtime import deadline

    t = torch.ones(1)
    deadline.all_reduce(t, group=None, timeout_s=60, purpose="test: start together")
    if rank == 1:
        deadline.report_failure("ReplayError: caught by the training loop", group=None)
    deadline.all_reduce(t, group=None, timeout_s=60, purpose="test: withdraws rank 1's report")
    if rank == 1:
        time.sleep(1.5 * deadline.WATCH_S)
    start = time.monotonic()
    deadline.all_reduce(t, group=None, timeout_s=60, purpose="test: a slow peer")
    return t.item(), time.monotonic() - start


def test_a_caught_replay_error_does_not_fail_the_others_later(two_ranks):
    (total, waited), _ = (r["caught failure"] for r in two_ranks)
    assert total == 8.0 and waited >= 1.0, (total, waited)


def test_a_replay_error_on_one_rank_fails_the_others_promptly_with_its_reason(two_ranks):
    """Without the report rank 0 would wait in its collective for the 90 s deadline."""
    waiting, failed = (r["one rank fails"] for r in two_ranks)
    assert failed[0] == "ReplayError" and "in the replayed forward but" in failed[1], failed
    assert waiting[0] == "PeerFailedError" and waiting[3] == 1, waiting
    assert "rank 1 failed outside any collective (ReplayError: MoE layer 'layers.0.moe'" in waiting[1], waiting
    assert waiting[2] < 30, f"rank 0 learnt of rank 1's failure only after {waiting[2]:.1f} s"


def test_two_ranks_under_themis_train_like_one_process(two_ranks):
    names = sorted(BLOCKS)
    results = two_ranks
    for name in names:
        ref_losses, ref_dense = _train(_lm(name))
        losses, dense = results[0][name]
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"
        assert dense.keys() == ref_dense.keys()
        for n in ref_dense:     # the key third of each qkv bias left out (zoo.dense_params)
            torch.testing.assert_close(dense[n], ref_dense[n], rtol=1e-4, atol=5e-4, msg=f"{name}: {n}")
