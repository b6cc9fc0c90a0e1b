"""MoE blocks whose forward needs more than hidden states, probed with the arguments recorded in one
forward of the whole model (``example_inputs``).

Two blocks, each inside a small transformer that passes it an extra argument:

- ``HashRoutedMoE(x, tokens)``: DeepSeek-V4's first layers, the experts of each token fixed by its id
  (``table[tokens]``), weighted by a learned gate;
- ``PositionBiasedMoE(x, position_ids)``: a top-k router whose scores get a learned bias per position.

Without ``example_inputs`` each is rejected with a reason that asks for them; with them ``explain`` lists
every layer, a model that probes on hidden states alone runs no extra forward, and 2 gloo ranks train it
under themis and ep exactly like one process on the whole global batch.

Shape suffixes: B batch, S sequence, T tokens, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import themis_compile
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.probe import _ProbeForward
from tests.passes import zoo_models as zoo
from tests.runtime.equivalence import assert_equivalent

H, FFN, E, K, VOCAB, HEADS, MAX_POS = 32, 32, 4, 2, 64, 4, 16
STEPS, BATCH, SEQ, LR = 4, 4, 8, 1e-2
CONFIG = dict(overlap_degree=8, materialization_budget=2)


class StackedExperts(nn.Module):
    """``experts(x_TH, ids_TK, weights_TK) -> out_TH`` over stacked SwiGLU weights, one expert at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.w1.shape[0]):
            token_N, k_N = torch.where(ids_TK == e)
            h_NF = F.silu(x_TH[token_N] @ self.w1[e].T) * (x_TH[token_N] @ self.w3[e].T)
            out_TH = out_TH.index_add(0, token_N, (h_NF @ self.w2[e].T) * weights_TK[token_N, k_N, None])
        return out_TH


class PerSlotExperts(nn.Module):
    """gpt-fast ``ConditionalFeedForward``: ``experts(x_TH, ids_TK) -> y_TKH``, the stacked weights gathered
    by the ids and applied with einsum (the block combines the slots itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        h_TKF = F.silu(torch.einsum("th,tkfh->tkf", x_TH, self.w1[ids_TK]))
        h_TKF = h_TKF * torch.einsum("th,tkfh->tkf", x_TH, self.w3[ids_TK])
        return torch.einsum("tkf,tkhf->tkh", h_TKF, self.w2[ids_TK])


class HashRoutedMoE(nn.Module):
    """Hash routing (DeepSeek-V4 ``DeepseekV4HashRouter``): a frozen token id -> K experts table picks the
    experts, the learned gate's sigmoid scores, renormalised, weigh them."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        g = torch.Generator().manual_seed(7)
        self.register_buffer("tid2eid", torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(VOCAB)]))
        self.experts = StackedExperts()

    def forward(self, x_BSH: torch.Tensor, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, H)
        ids_TK = self.tid2eid[tokens_BS.reshape(-1)]
        weights_TK = self.gate(x_TH).sigmoid().gather(1, ids_TK)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return self.experts(x_TH, ids_TK, weights_TK).view_as(x_BSH)


class PositionBiasedMoE(nn.Module):
    """A softmax top-k router whose logits get a learned bias per position (``moe(x, position_ids)``), its
    experts called per slot (gpt-fast), so the call is rewritten and the rewrite verified on probes with
    the recorded positions."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.position_bias = nn.Embedding(MAX_POS, E)
        self.experts = PerSlotExperts()

    def forward(self, x_BSH: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, H)
        logits_TE = self.router(x_TH) + self.position_bias(position_ids_BS).reshape(-1, E)
        weights_TK, ids_TK = torch.topk(logits_TE.softmax(-1), K, dim=-1)
        y_TKH = self.experts(x_TH, ids_TK)
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK).view_as(x_BSH)


BLOCKS = {"hash": HashRoutedMoE, "position": PositionBiasedMoE}


class Layer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.moe = block

    def forward(self, x_BSH: torch.Tensor, extra_BS: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q, k, v = self.qkv(self.norm1(x_BSH)).view(B, S, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, H)
        x_BSH = x_BSH + self.proj(a)
        return x_BSH + self.moe(self.norm2(x_BSH), extra_BS)


class RecLM(nn.Module):
    """Embedding, two (attention + MoE) layers whose MoE gets the token ids or the positions, LM head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer(BLOCKS[kind]()) for _ in range(2))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        B, S = tokens_BS.shape
        extra_BS = tokens_BS if self.kind == "hash" else torch.arange(S, device=tokens_BS.device).expand(B, S)
        x = self.embed(tokens_BS)
        for layer in self.layers:
            x = layer(x, extra_BS)
        return self.head(x)

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self(tokens_BS)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens_BS[:, 1:].reshape(-1))


LAYERS = ["layers.0.moe", "layers.1.moe"]


def _model(kind: str) -> RecLM:
    torch.manual_seed(0)
    return RecLM(kind)


def _example() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3)),)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_found_with_example_inputs_rejected_without(kind):
    model = _model(kind)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    report = themis_compile.explain(model)
    assert report.startswith("0 MoE layer(s) found"), report
    for name in LAYERS:
        line = next(line for line in report.splitlines() if line.strip().startswith(f"rejected {name}:"))
        assert "the forward fails on probe hidden states" in line and "pass example_inputs" in line, report

    report = themis_compile.explain(model, example_inputs=_example())
    assert report.startswith("2 MoE layer(s) found"), report
    assert [line.split(":")[0].strip() for line in report.splitlines()[1:]] == LAYERS, report
    infos, rejected = find_moe_layers(model, {"tokens_BS": _example()[0]})   # kwargs work as well
    assert [i.name for i in infos] == LAYERS and not rejected, rejected
    call = infos[0].probe_call
    assert call is not None and call.hidden_states.shape == (2, SEQ, H)
    assert [i.top_k for i in infos] == [K, K] and [i.num_experts for i in infos] == [E, E]
    assert {i.rewrite for i in infos} == {"none" if kind == "hash" else "per-slot"}
    assert "probed with:" in themis_compile.explain(model, verbose=True, example_inputs=_example())
    # Read-only: no parameter, buffer or forward of the model is left changed.
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())
    assert not any("forward" in m.__dict__ for m in model.modules())   # the recorded probes are gone


def test_rejection_names_a_forward_that_fails_on_the_example_inputs():
    bad = (torch.randint(0, VOCAB, (2, SEQ)).float(),)     # embedding of float ids fails before the MoE
    report = themis_compile.explain(_model("hash"), example_inputs=bad)
    assert report.startswith("0 MoE layer(s) found"), report
    assert "a forward of the model on example_inputs fails before it is called" in report, report


def test_one_forward_only_when_a_candidate_needs_it():
    def count(model: nn.Module) -> list[int]:
        calls = [0]
        model.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
        return calls

    plain = zoo.ZooLM("gpt_fast")
    calls = count(plain)
    infos, _ = find_moe_layers(plain, example_inputs=(torch.randint(0, zoo.VOCAB, (2, SEQ)),))
    assert len(infos) == 2 and calls == [0]     # probes on hidden states alone: no forward of the model
    model = _model("position")
    calls = count(model)
    infos, _ = find_moe_layers(model, example_inputs=_example())
    assert len(infos) == 2 and calls == [1]


# --- training equivalence on 2 ranks, one process group for every case ---------------------------------

def _experts_of(model: nn.Module) -> dict[tuple[str, int], list[torch.Tensor]]:
    from themis_compile.runtime.experts import ExpertBank

    out = {}
    for name in LAYERS:
        experts = model.get_submodule(name).experts
        bank = ExpertBank(experts)
        for e in range(bank.num_experts):
            out[(name, e)] = [t.detach().clone() for t in bank.chunk(experts, e)]
    return out


def _reference(kind: str):
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in _batches():
        loss = model.loss(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, zoo.dense_params(model), _experts_of(model)


def _train(rank: int, world_size: int, kind: str, policy: str):
    model = themis_compile.optimize(_model(kind), themis_compile.ThemisConfig(policy=policy, **CONFIG),
                                    strict=True, example_inputs=_example())
    runtime = themis_compile.api.runtime_of(model)
    assert list(runtime.layers) == LAYERS
    assert not any(isinstance(m.__dict__.get("forward"), _ProbeForward) for m in model.modules())   # gone
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    local = BATCH // world_size
    losses = []
    for tokens in _batches():
        loss = model.loss(tokens[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world_size)
    owned = {(name, e): [t.detach().clone() for t in chunk]
             for name, experts in runtime.layers.items() for e, chunk in experts.local_chunks().items()}
    return losses, zoo.dense_params(model), owned, None


def _ranks(rank: int, world_size: int, cases: list[tuple[str, str]]):
    return [_train(rank, world_size, kind, policy) for kind, policy in cases]


def test_rewrite_is_verified_with_the_recorded_inputs():
    """The per-slot rewrite of the position-biased block is checked against the original on probes that
    carry the recorded positions; a rewrite that ignored them would not match."""
    from themis_compile.passes.styles import prepare_moe_layers

    model = _model("position")
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.position_bias.weight.mul_(20.0)     # positions decide the routing
    infos = prepare_moe_layers(model, strict=True, example_inputs=_example())
    assert [i.name for i in infos] == LAYERS and all(i.rewritten for i in infos)
    tokens = _example()[0]
    reference = _model("position")
    with torch.no_grad():
        for layer in reference.layers:
            layer.moe.position_bias.weight.mul_(20.0)
        torch.testing.assert_close(model(tokens), reference(tokens))


def test_two_ranks_train_like_one_process():
    from themis_compile.testing.multirank import run_multirank

    cases = [("hash", "themis"), ("position", "ep")]
    results = run_multirank(_ranks, 2, args=(cases,), timeout_s=240)
    references = {kind: _reference(kind) for kind in BLOCKS}
    for i, (kind, policy) in enumerate(cases):
        try:
            assert_equivalent(references[kind], [r[i] for r in results])
        except AssertionError as err:
            raise AssertionError(f"{kind} under {policy}: {err}") from err
