"""What ``optimize`` does not shard is still data-parallel: no silent fallback to per-rank copies.

A model with no MoE layer, a model where one MoE-like block is rejected (its experts differ in width,
which FSSDP cannot shard) next to one that is sharded, one where a block is found but its rewrite fails
its check (a branch on a traced value in its routing) and is left as it is, and a model whose only MoE
block holds its experts
as ParameterLists of different widths (nothing to shard; its experts get gradients on some ranks only)
train on 2 ranks and on 4 (2 nodes x 2) exactly like one process on the whole global batch, under both
dense wrappers (FSDP2 and DDP). The warning names
the rejected block and why; ``strict=True`` refuses instead.

Shape suffixes: B batch, S sequence, T tokens, H hidden, F ffn, E experts, K top-k, V vocab.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import themis_compile
from themis_compile import ThemisConfig
from themis_compile.models.gpt_moe import CausalSelfAttention, ExpertMLP, MoEFeedForward, MoEModelConfig
from themis_compile.passes.styles import describe_layer
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import _batches, make_optimizer, model_loss, rank_state_dict

STEPS, BATCH, SEQ = 4, 8, 8
VOCAB, H = 64, 32
UNEVEN_WIDTHS = (48,) + (32,) * 7     # expert 0 is wider: not shardable, so rejected
REJECTED_REASON = "experts are not identical"
PARAMLIST_REASON = ("its 8 experts (scored by 'router') are entry e of each of the ParameterLists 'w_in', 'w_out': "
                    "experts are not identical (entries of 'w_in': 0: [48, 32] float32, 1: [32, 32] float32, ")


class UnevenMoE(nn.Module):
    """An MoE block (softmax, top-k, a loop with ``index_add_`` that skips empty experts)
    whose experts have different widths. It records which experts its last forward used on this rank."""

    def __init__(self, widths=UNEVEN_WIDTHS, top_k: int = 1) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(H, len(widths), bias=False)
        self.experts = nn.ModuleList(ExpertMLP(H, f) for f in widths)
        self.used_E: list[bool] = []

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        probs_TE = F.softmax(self.gate(x_TH), dim=-1)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)     # Switch-style: not renormalised
        out_TH = torch.zeros_like(x_TH)
        self.used_E = []
        for e, expert in enumerate(self.experts):
            token_idx, k_idx = torch.where(ids_TK == e)
            self.used_E.append(bool(token_idx.numel()))
            if token_idx.numel() == 0:
                continue        # this expert gets no gradient on this rank in this step
            y = expert(x_TH[token_idx]) * weights_TK[token_idx, k_idx, None]
            out_TH.index_add_(0, token_idx, y)
        return out_TH.view_as(x_BSH)


class GuardedMoE(UnevenMoE):
    """Identical experts (so found, as an inline loop), but its routing branches on a traced value, which no
    generated forward can keep: the rewrite fails its check and the layer is left as it is, data-parallel,
    its experts skipping tokens per rank like the rejected block's."""

    def __init__(self) -> None:
        super().__init__(widths=(32,) * 8)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if x_BSH.abs().max() > 1e6:
            x_BSH = x_BSH.clamp(-1e6, 1e6)
        return super().forward(x_BSH)


LEFT_REASON = "the forward branches on a traced value outside the expert loop"


class ParameterListMoE(nn.Module):
    """Experts as ``nn.ParameterList``s of weights, applied with ``F.linear`` per expert, experts without
    tokens skipped, expert 0 wider than the others: not identical, so nothing here can be sharded (detection
    names it and why; of equal widths they are, ``tests/passes/test_style_param_lists.py``), and the whole
    model is data-parallel while an expert's weights get a gradient on some ranks only: the wrappers must
    expect that, or the ranks enter mismatched reduce-scatters."""

    def __init__(self, widths=UNEVEN_WIDTHS) -> None:
        super().__init__()
        self.router = nn.Linear(H, len(widths), bias=False)
        self.w_in = nn.ParameterList(nn.Parameter(torch.randn(f, H) * H ** -0.5) for f in widths)
        self.w_out = nn.ParameterList(nn.Parameter(torch.randn(H, f) * f ** -0.5) for f in widths)
        self.used_E: list[bool] = []

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weight_T, id_T = F.softmax(self.router(x_TH), dim=-1).max(dim=-1)
        out_TH = torch.zeros_like(x_TH)
        self.used_E = []
        for e, (w_in, w_out) in enumerate(zip(self.w_in, self.w_out)):
            rows = torch.nonzero(id_T == e).flatten()
            self.used_E.append(bool(rows.numel()))
            if rows.numel():
                y = F.linear(F.gelu(F.linear(x_TH[rows], w_in)), w_out) * weight_T[rows, None]
                out_TH = out_TH.index_add(0, rows, y)
        return out_TH.view_as(x_BSH)


class DenseFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = ExpertMLP(H, 2 * H)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.mlp(x_BSH)


class Block(nn.Module):
    def __init__(self, cfg: MoEModelConfig, ffn: nn.Module) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.ffn = nn.LayerNorm(H), CausalSelfAttention(cfg), nn.LayerNorm(H), ffn

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln_1(x_BSH))
        return x_BSH + self.ffn(self.ln_2(x_BSH))


class TinyLM(nn.Module):
    """A small pre-norm decoder whose feed-forward per block is ``"dense"``, ``"uneven"`` (rejected) or
    ``"moe"`` (the reference model's MoE block, sharded)."""

    def __init__(self, ffns: tuple[str, ...]) -> None:
        super().__init__()
        self.config = cfg = MoEModelConfig(vocab_size=VOCAB, d_model=H, n_heads=2, d_ffn=H, num_experts=4, top_k=2,
                                           seq_len=SEQ, aux_loss_weight=0.01)
        make = {"dense": DenseFFN, "uneven": UnevenMoE, "moe": lambda: MoEFeedForward(cfg, 0),
                "paramlist": ParameterListMoE, "guarded": GuardedMoE}
        self.tok_emb = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList(Block(cfg, make[kind]()) for kind in ffns)
        self.lm_head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.tok_emb(tokens_BS)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.lm_head(x_BSH)

    def ffns(self, kind: type) -> list[nn.Module]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, kind)]

    def aux_loss(self) -> torch.Tensor:
        return sum((m.aux_loss for m in self.ffns(MoEFeedForward)), torch.zeros(()))


MODELS = {"dense": ("dense", "dense"), "mixed": ("uneven", "moe"), "paramlist": ("paramlist", "dense"),
          "left": ("guarded", "moe")}


def make_tiny(kind: str) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(MODELS[kind])


# --------------------------------------------------------------------------- training, both ways
def _sharded_layers(kind: str) -> list[str]:
    """The layers optimize shards: those prepared (a layer whose rewrite fails its check is left as it is)."""
    from themis_compile.passes.styles import prepare_moe_layers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [info.name for info in prepare_moe_layers(make_tiny(kind))]


def _kept_expert_chunks(model: nn.Module, layers: list[str]) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Every expert's chunk of the sharded ``layers``, keyed (index among them, expert)."""
    from themis_compile.passes.detect import find_moe_layers
    from themis_compile.runtime.experts import ExpertBank

    infos = [info for info in find_moe_layers(model)[0] if info.name in layers]
    out = {}
    for li, info in enumerate(infos):
        bank = ExpertBank(info.experts)
        for e in range(bank.num_experts):
            out[(li, e)] = [t.detach().clone() for t in bank.chunk(info.experts, e)]
    return out


def train_one_process(kind: str) -> dict:
    model = make_tiny(kind)
    opt = make_optimizer(model.parameters(), "adamw")
    losses, used = [], []
    for tokens in _batches(STEPS, BATCH, SEQ, VOCAB):
        loss = model_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        used.append([list(m.used_E) for m in model.ffns((UnevenMoE, ParameterListMoE))])
    layers = _sharded_layers(kind)
    prefixes = tuple(f"{name}.experts." for name in layers)
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith(prefixes)}
    return {"losses": losses, "dense": dense, "experts": _kept_expert_chunks(model, layers), "used": used}


def train_ranks(rank: int, world_size: int, kind: str, config: dict) -> dict:
    model = make_tiny(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = themis_compile.optimize(model, ThemisConfig(**config))
    runtime = themis_compile.api.runtime_of(model)
    opt = make_optimizer(model.parameters(), "adamw")
    local = BATCH // world_size
    losses, used = [], []
    for tokens in _batches(STEPS, BATCH, SEQ, VOCAB):
        loss = model_loss(model, tokens[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world_size)
        used.append([list(m.used_E) for m in model.ffns((UnevenMoE, ParameterListMoE))])
    sharded = {id(p) for m in runtime.layers.values() for p in m.parameters()}
    dense = {}
    for n, p in model.named_parameters():
        if id(p) not in sharded:
            p = p.detach()
            dense[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()   # collective (FSDP2)
    owned = {(li, e): [t.detach().clone() for t in chunk]
             for li, experts in enumerate(runtime.layers.values()) for e, chunk in experts.local_chunks().items()}
    return {"losses": losses, "dense": dense, "owned": owned, "used": used,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "explain": themis_compile.explain(model),
            "owned_now": {name: experts.owned_experts() for name, experts in runtime.layers.items()}}


def assert_trains_like_one_process(reference: dict, results: list[dict]) -> None:
    for rank, out in enumerate(results):
        for step, (a, b) in enumerate(zip(out["losses"], reference["losses"], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs one process {b}"
        assert out["dense"].keys() == reference["dense"].keys()
        for name, p in out["dense"].items():
            torch.testing.assert_close(p, reference["dense"][name], rtol=1e-4, atol=5e-4, msg=f"rank {rank} {name}")
    owned = {}
    for out in results:
        for key, chunk in out["owned"].items():
            assert key not in owned, f"expert {key} owned twice"
            owned[key] = chunk
    assert owned.keys() == reference["experts"].keys()
    for key, chunk in owned.items():
        for a, b in zip(chunk, reference["experts"][key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-4, msg=f"expert {key}")


CONFIGS = {"fsdp2": {"policy": "themis", "dense_parallel": "fsdp2", "reshard_interval": 2},
           "ddp": {"policy": "ep", "dense_parallel": "ddp"}}


def _cases(rank: int, world_size: int, cases: list[tuple[str, str]]) -> list[dict]:
    # One process group for every case of a world size.
    return [train_ranks(rank, world_size, kind, CONFIGS[wrapper]) for kind, wrapper in cases]


CASES = {2: [("dense", "fsdp2"), ("dense", "ddp"), ("mixed", "fsdp2"), ("mixed", "ddp"), ("paramlist", "fsdp2"),
             ("paramlist", "ddp"), ("left", "fsdp2"), ("left", "ddp")],
         4: [("mixed", "fsdp2"), ("dense", "ddp")]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_unsharded_modules_train_like_one_process(world_size):
    cases = CASES[world_size]
    results = run_multirank(_cases, world_size, args=(cases,), devices_per_node=2, timeout_s=120)
    references = {kind: train_one_process(kind) for kind in MODELS}
    for i, (kind, wrapper) in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert_trains_like_one_process(references[kind], per_rank)
        (warning,) = [w for w in per_rank[0]["warnings"] if "themis_compile.optimize" in w]
        explained = per_rank[0]["explain"]
        assert f"data-parallel through {wrapper} over {world_size} ranks" in warning
        assert f"data-parallel through {wrapper} over {world_size} ranks" in explained
        if kind == "dense":
            assert "found no MoE layer in TinyLM" in warning
            assert "0 MoE layer(s) sharded" in explained
            continue
        if kind == "paramlist":
            # Named with what was seen, not the generic "found no MoE layer"; the whole model is data-parallel.
            lines = warning.splitlines()
            assert len(lines) == 2 and lines[1].startswith("  blocks.0.ffn: ") and PARAMLIST_REASON in lines[1]
            assert "0 MoE layer(s) sharded" in explained and f"\n    blocks.0.ffn: {PARAMLIST_REASON}" in explained
            assert_dynamic_sparsity(per_rank, references[kind])
            continue
        # One line per module not sharded, with the reason; the sharded block is not among them.
        lines = warning.splitlines()
        reason = LEFT_REASON if kind == "left" else REJECTED_REASON
        assert len(lines) == 2 and lines[1].startswith("  blocks.0.ffn: ") and reason in lines[1], lines
        if kind == "left":
            assert lines[0].startswith("themis_compile.optimize: 1 MoE layer(s) left as they are"), lines
        assert "\n    blocks.0.ffn: " in explained and reason in explained, explained
        for rank, out in enumerate(per_rank):     # explain() on an optimized model: what each rank holds
            owned = out["owned_now"]["blocks.1.ffn"]
            assert f"(policy {CONFIGS[wrapper]['policy']}, rank {rank} of {world_size}): 1 MoE layer(s) sharded" in out["explain"]
            assert (f"\n  blocks.1.ffn: {CONFIGS[wrapper]['policy']}, 4 experts (modulelist, 'experts'), top-2; "
                    f"this rank owns {len(owned)}: {owned}\n") in out["explain"]
        assert sorted(e for out in per_rank for e in out["owned_now"]["blocks.1.ffn"]) == [0, 1, 2, 3]
        if kind == "mixed":
            assert_dynamic_sparsity(per_rank, references[kind])
        else:
            # Some expert of the block left as it is got tokens on one rank only in some step, and some
            # expert none on any rank (one process leaves its .grad None; under FSDP2 the zero gradient it
            # reduce-scatters is set back to None before the step: runtime/unused.py).
            assert_dynamic_sparsity(per_rank, references[kind], every_step_uses_every_expert=False)
            assert not all(all(used[0]) for used in references[kind]["used"]), references[kind]["used"]


def assert_dynamic_sparsity(per_rank: list[dict], reference: dict, every_step_uses_every_expert: bool = True) -> None:
    """The unsharded block's experts went unused on some rank in some step while another rank used them
    (ranks would reduce different sets of gradients if the wrapper were not told), while every expert got
    tokens from the whole batch in every step, as in the one-process run."""
    num_experts = len(reference["used"][0][0])
    assert any(len({r["used"][step][0][e] for r in per_rank}) == 2
               for step in range(STEPS) for e in range(num_experts)), [r["used"] for r in per_rank]
    if every_step_uses_every_expert:
        assert all(all(used[0]) for used in reference["used"]), reference["used"]


# --------------------------------------------------------------------------- one process, no group
def test_world_size_one_warns_naming_each_rejected_module_and_trains_unchanged():
    reference = make_tiny("mixed")
    with pytest.warns(UserWarning) as record:
        model = themis_compile.optimize(make_tiny("mixed"), ThemisConfig(policy="ep"))
    (message,) = [str(w.message) for w in record if "themis_compile.optimize" in str(w.message)]
    lines = message.splitlines()
    assert lines[0].startswith("themis_compile.optimize: 1 MoE-like module(s) not sharded")
    assert len(lines) == 2 and lines[1].startswith("  blocks.0.ffn: ") and REJECTED_REASON in lines[1]
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
    assert list(themis_compile.api.runtime_of(model).layers) == ["blocks.1.ffn"]
    # Before optimize, explain lists what it would do; after, what it did (not "0 MoE layer(s) found").
    assert themis_compile.explain(reference).startswith("1 MoE layer(s) found\n  blocks.1.ffn: 4 experts")
    text = themis_compile.explain(model).splitlines()
    assert text[:2] == ["optimized by themis_compile (policy ep, rank 0 of 1): 1 MoE layer(s) sharded",
                        "  blocks.1.ffn: ep, 4 experts (modulelist, 'experts'), top-2; this rank owns 4: [0, 1, 2, 3]"]
    assert text[2].startswith("not sharded (world size 1") and text[-1].startswith(f"    blocks.0.ffn: {REJECTED_REASON}")
    verbose = themis_compile.explain(model, verbose=True).splitlines()
    assert verbose[2] == "    " + describe_layer(themis_compile.api.runtime_of(model).layer_infos["blocks.1.ffn"])


def test_strict_refuses_naming_the_rejected_modules():
    model = make_tiny("mixed")
    before = {k: v.clone() for k, v in rank_state_dict(model).items()}
    with pytest.raises(ValueError, match=r"(?s)strict=True.*1 MoE-like module\(s\) not sharded.*blocks\.0\.ffn: experts are"):
        themis_compile.optimize(model, strict=True)
    assert getattr(model, "_themis_runtime", None) is None and type(model.blocks[1].ffn.experts) is nn.ModuleList
    assert all(torch.equal(v, before[k]) for k, v in rank_state_dict(model).items())
    with pytest.raises(ValueError, match="strict=True.*found no MoE layer in TinyLM"):
        themis_compile.optimize(make_tiny("dense"), strict=True)
