"""Every MoE family of the installed transformers: found by ``explain`` and trained by 2 gloo ranks
under ``themis`` exactly as one process trains it on the whole batch.

The families are derived from the installed package (:func:`tests.passes.hf_families.moe_families`);
a family that is not sharded is listed in ``NOT_SHARDED`` with the reason ``explain`` gives, and
the test checks that ``explain`` gives it. The quick test checks detection of every family; the sweep
(``-m hf_sweep``) trains them all in one spawned process group.
"""

from __future__ import annotations

import logging
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import themis_compile
from tests.passes import hf_families as hf

pytest.importorskip("transformers")

# family -> a phrase of the reason explain() gives for it: not sharded (the model then stays data
# parallel), each for a property of the family's code documented in docs/detection.md. None: the family
# has no module the detector can probe (no text model, or no experts child).
NOT_SHARDED = {
    # The attention experts (MoA) run through JetMoeMoA.map / .reduce, never called; the MLP's experts, two
    # ParallelExperts halves with the block's code between them, are joined and sharded (PARTLY_SHARDED).
    "jetmoe": "runs the experts in 'experts' (JetMoeMoA) one by one itself",
    "doge": None,               # product-key experts held as embeddings: no experts child
    "vitpose_backbone": None,   # experts per dataset index in an image backbone: no text model
}

# Families of which some MoE layers are sharded and the others (NOT_SHARDED's reason) stay data parallel;
# the sweep trains them too.
PARTLY_SHARDED: set[str] = {"jetmoe"}

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 8


def _quiet():
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


FAMILIES = sorted(hf.moe_families())


def test_families_are_derived_from_the_installed_package():
    # The count is recorded, not asserted equal to a number: a new transformers release changes it.
    print(f"{len(FAMILIES)} MoE families in transformers {__import__('transformers').__version__}")
    assert len(FAMILIES) >= 70 and {"mixtral", "qwen3_moe", "deepseek_v3", "phimoe"} <= set(FAMILIES)


def _detect(family: str) -> tuple[list[str], list[str], str]:
    _quiet()
    model = hf.tiny_model(family)
    expected = hf.expected_moe_modules(model)
    report = themis_compile.explain(model)
    found = [line.split(":")[0].strip() for line in report.splitlines()[1:] if not line.strip().startswith("rejected")]
    return expected, found, report


@pytest.mark.hf_sweep
@pytest.mark.parametrize("family", FAMILIES)
def test_explain_lists_the_moe_layers_or_says_why_not(family):
    if family in NOT_SHARDED and NOT_SHARDED[family] is None:
        if family == "vitpose_backbone":
            with pytest.raises(LookupError):
                hf.tiny_model(family)
        else:
            expected, found, report = _detect(family)
            assert not expected and report.startswith("0 MoE layer(s) found"), report
        return
    expected, found, report = _detect(family)
    assert expected, f"{family}: the tiny config built no MoE layer"
    if family in NOT_SHARDED:
        rejected = {line.split()[1].rstrip(":"): line for line in report.splitlines()
                    if line.strip().startswith("rejected")}
        missing = [name for name in expected if name not in found]
        phrases = NOT_SHARDED[family] if isinstance(NOT_SHARDED[family], tuple) else (NOT_SHARDED[family],)
        assert missing and all(any(p in rejected.get(name, "") for p in phrases) for name in missing), report
        assert family in PARTLY_SHARDED or not set(expected) & set(found), report
        return
    assert set(expected) <= set(found), f"{family}: expected {expected}\n{report}"


def test_explain_lists_or_rejects_families_of_each_kind():
    """The quick run: a family found by its routing code, ones found by behaviour (llama4: every expert
    on every row, the all-rows rewrite; deepseek_v4: layer 0 routes by token ids, probed on recorded
    inputs), one whose experts hold a norm every expert uses, and one whose stacked weights hold zero
    experts after the real ones in transformers <= 5.24 (longcat_flash: the zero-experts rewrite)."""
    for family in ("qwen3_moe", "phimoe", "deepseek_v3", "llama4", "deepseek_v4", "muse_spark", "longcat_flash"):
        expected, found, report = _detect(family)
        assert expected and set(expected) <= set(found), report
    # transformers <= 5.24 stacks the zero experts as rows of the experts' weights; later releases add the
    # identity part in the MoE block and hold only the real experts.
    longcat = hf.tiny_model("longcat_flash")
    rows = longcat.model.layers[0].mlp.experts.gate_up_proj.shape[0]
    if rows > longcat.config.n_routed_experts:
        assert "4 experts + 2 zero (identity) experts" in report, report
    else:
        assert "4 experts (stacked" in report and "zero (identity)" not in report, report
    # Encoder and decoder layer i share their experts (tied weights): one sharded experts module serves both.
    expected, found, report = _detect("diffusion_gemma")
    assert set(expected) <= set(found) and report.count("experts tied to") == 2, report


# --- training equivalence, one process group for every family ----------------------------------------

def _tokens(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, hf._SIZES["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def _train(model, tokens_per_step, rank: int = 0, world_size: int = 1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if world_size > 1:
        runtime = themis_compile.api.runtime_of(model)
        if hasattr(runtime, "attach_optimizer"):
            runtime.attach_optimizer(opt)
    local = GLOBAL_BATCH // world_size
    losses = []
    for tokens in tokens_per_step:
        loss = hf.family_loss(model, tokens[rank * local:(rank + 1) * local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float().clone()
        if world_size > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world_size)
    return losses


def _sweep_rank(rank: int, world_size: int, families: list[str], steps: int) -> dict[str, tuple[str, object]]:
    _quiet()
    out = {}
    for family in families:
        start = time.perf_counter()
        try:
            model = hf.tiny_model(family)
            model.train()
            with warnings.catch_warnings():
                # Modules that are not sharded (named in the warning) stay data-parallel: still trained
                # exactly, which is what this sweep checks; a family with nothing sharded is an error.
                warnings.simplefilter("ignore", UserWarning)
                themis_compile.optimize(model, themis_compile.ThemisConfig(policy="themis"))
            if not themis_compile.api.runtime_of(model).layers:
                raise ValueError("no MoE layer was sharded")
            out[family] = ("ok", _train(model, _tokens(steps), rank, world_size))
        except Exception as exc:   # recorded per family; the other rank fails at the same deterministic step
            out[family] = ("error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        dist.barrier()
        out[family] = out[family] + (time.perf_counter() - start,)
    # The one-process references, shared out over the ranks (no collective involved).
    references = {}
    for family in families[rank::world_size]:
        try:
            references[family] = _reference(family, steps)
        except Exception as exc:
            references[family] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return out, references


def _reference(family: str, steps: int) -> list[float]:
    _quiet()
    model = hf.tiny_model(family)
    model.train()
    return _train(model, _tokens(steps))


def sweep(families: list[str], steps: int = STEPS, world_size: int = 2) -> dict[str, str]:
    """family -> "equal" or the reason it is not (error on a rank, loss mismatch)."""
    from themis_compile.testing.multirank import run_multirank

    results = run_multirank(_sweep_rank, world_size, args=(families, steps), timeout_s=240)
    references = {f: ref for _, refs in results for f, ref in refs.items()}
    verdict, seconds = {}, {}
    for family in families:
        states = [r[family] for r, _ in results]
        seconds[family] = max(s[2] for s in states)
        errors = [s[1] for s in states if s[0] == "error"]
        if errors:
            verdict[family] = f"error: {errors[0]}"
            continue
        ref = references[family]
        if isinstance(ref, str):
            verdict[family] = f"reference failed: {ref}"
            continue
        losses = states[0][1]
        bad = [(i, a, b) for i, (a, b) in enumerate(zip(losses, ref)) if abs(a - b) > 1e-5 * abs(b)]
        verdict[family] = "equal" if not bad else f"loss differs: step {bad[0][0]} {bad[0][1]:.7g} vs {bad[0][2]:.7g}"
    sweep.seconds = seconds
    return verdict


def test_two_ranks_train_like_one_process_quick():
    """Two families of different styles (experts call, behaviour-found router) in one process group."""
    verdict = sweep(["qwen3_moe", "phimoe"])
    assert verdict == {"qwen3_moe": "equal", "phimoe": "equal"}, verdict


@pytest.mark.hf_sweep
def test_every_found_family_trains_like_one_process():
    families = [f for f in FAMILIES if f not in NOT_SHARDED or f in PARTLY_SHARDED]
    verdict = sweep(families)
    for family, v in sorted(verdict.items()):
        print(f"{family:24s} {v}")
    equal = [f for f, v in verdict.items() if v == "equal"]
    print(f"{len(equal)} of {len(families)} families train equal to one process")
    assert not [f for f, v in verdict.items() if v != "equal"], {f: v for f, v in verdict.items() if v != "equal"}

