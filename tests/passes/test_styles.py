"""The styles table (``themis_compile.passes.styles.STYLES``) as a contract every style keeps.

- The table is detection's priority order: each row's analyses are rows of ``detect.ANALYSES``, the rows
  follow them in that order, and the call styles follow ``find_behaviour.CALL_STYLES``.
- No style is named anywhere in ``passes/`` that the table does not hold.
- Every style, on a model written that way (the witnesses below, built the way other projects write
  them, from the zoo, the outside styles, the HF families), is found as that style; ``prepare_moe_layers``
  rewrites it so that the block makes the runtime's one call ``experts(x_TH, ids_TK, weights_TK)`` and the
  model computes what it computed before, in train and eval mode; ``explain`` and ``describe_layer`` say
  the style's own sentence.

How each style trains sharded on 2 and 4 ranks is the business of its own test file (test_zoo_training,
test_outside_styles, test_style_*, test_hf_families, runtime/test_zero_expert_rows).
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import themis_compile
from themis_compile.passes import detect, find_behaviour, styles
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.explain import explain_moe_layers
from themis_compile.passes.replay import output_tensors
from themis_compile.passes.styles import STYLES, describe_layer, prepare_moe_layers, style_of
from tests.passes import hf_families as hf
from tests.passes import outside_styles as outside
from tests.passes import style_models
from tests.passes import zoo_models as zoo


def _zoo(style: str, blocks: dict | None = None):
    return lambda: zoo.ZooLM(style, blocks=blocks)


def _hf(family: str):
    return lambda: hf.tiny_model(family)


def _zero_experts():
    from tests.runtime.test_zero_expert_rows import TinyLM

    return TinyLM()


def _lists(module: str, style: str):
    def build():
        import importlib

        return zoo.ZooLM(style, blocks=importlib.import_module(f"tests.passes.{module}").BLOCKS)

    return build


# style -> a model holding blocks of that style only (its source says who writes them so).
WITNESSES = {
    "none": _hf("mixtral"),                                  # HF transformers >= 5
    "inline-loop": _zoo("hf_mixtral_v4"),                    # HF transformers < 5
    "replay": _zoo("deepseek_v3"),                           # an untraceable counts loop
    "dense-dispatch": _zoo("fairseq_top2"),                  # [T, E, C] dispatch and combine
    "zero-experts": _zero_experts,                           # LongCat-Flash's identity experts
    "joined": _zoo("jetmoe"),                                # two ParallelExperts halves
    "dispatch-mask": _hf("switch_transformers"),             # HF Switch >= 5, one-hot mask
    "scores-call": _zoo("hf_dbrx_v4"),                       # DBRX before v5
    "sorted-rows": _zoo("torchtitan"),                       # GroupedExperts on sorted rows
    "per-slot": _zoo("gpt_fast"),                            # ConditionalFeedForward
    "all-rows": _zoo("hf_llama4_v4"),                        # Llama 4, every expert on every row
    "flatten": _hf("dbrx"),                                  # DBRX >= 5, [B, S, H] into the experts
    "own-weights": lambda: style_models.style_model("gathered_einsum"),
    "indexed-weights": _zoo("stacked_split", outside.BLOCKS),
    "parallel-lists": _lists("test_style_parallel_lists", "sorted_split"),
    "param-lists": _lists("test_style_param_lists", "gated"),
}


def test_every_style_has_a_witness():
    assert sorted(WITNESSES) == sorted(s.name for s in STYLES)


# style -> its own test file (under tests/): what that style's blocks are, and that they are found as it.
STYLE_FILES = {
    "none": "passes/test_style_none.py", "inline-loop": "passes/test_style_inline_loop.py",
    "replay": "passes/test_replay.py", "dense-dispatch": "passes/test_style_dense_dispatch.py",
    "zero-experts": "runtime/test_zero_expert_rows.py", "joined": "passes/test_joined.py",
    "dispatch-mask": "passes/test_style_dispatch_mask.py", "scores-call": "passes/test_style_scores_call.py",
    "sorted-rows": "passes/test_style_sorted_rows.py", "per-slot": "passes/test_style_per_slot.py",
    "all-rows": "passes/test_all_rows.py", "flatten": "passes/test_style_flatten.py",
    "own-weights": "passes/test_style_gathered_einsum.py", "indexed-weights": "passes/test_style_indexed_weights.py",
    "parallel-lists": "passes/test_style_parallel_lists.py", "param-lists": "passes/test_style_param_lists.py",
}


def test_every_style_has_a_test_file_of_its_own():
    tests = Path(__file__).parent.parent
    assert sorted(STYLE_FILES) == sorted(s.name for s in STYLES)
    for name, path in STYLE_FILES.items():
        assert f'"{name}"' in (tests / path).read_text(), (name, path)     # it asserts blocks of that style


def test_the_table_follows_detections_priority():
    names = [s.name for s in STYLES]
    assert len(set(names)) == len(names)
    analyses = [a.name for a in detect.ANALYSES]
    for style in STYLES:
        assert style.found_by and set(style.found_by) <= set(analyses), style
    first = [min(analyses.index(a) for a in style.found_by) for style in STYLES]
    assert first == sorted(first), list(zip(names, first))
    calls = [name for name, _ in find_behaviour.CALL_STYLES]
    assert set(calls) <= set(names)
    by_behaviour = [s.name for s in STYLES if "behaviour" in s.found_by and s.name in calls
                    and min(analyses.index(a) for a in s.found_by) == analyses.index("behaviour")]
    assert by_behaviour == [c for c in calls if c in by_behaviour]
    for analysis in detect.ANALYSES:
        assert set(analysis.supersedes) <= set(names), analysis


def _named_styles(path: Path) -> set[str]:
    """Style names a source file spells: ``rewrite="..."`` arguments and ``.rewrite`` compared with or tested
    for membership in string constants."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "rewrite" and isinstance(node.value, ast.Constant):
            out.add(node.value.value)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "rewrite":
            for right in node.comparators:
                consts = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                out |= {c.value for c in consts if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return out


def test_no_style_is_named_outside_the_table():
    root = Path(themis_compile.__file__).parent
    names = {s.name for s in STYLES}
    named = {str(p.relative_to(root)): _named_styles(p) - names for p in sorted(root.rglob("*.py"))}
    assert {p: n for p, n in named.items() if n} == {}
    assert _named_styles(root / "passes" / "find_behaviour.py") >= {"none", "replay"}   # the scan sees them


def _forward(model, tokens: torch.Tensor, training: bool) -> list[torch.Tensor]:
    model.train(training)
    torch.manual_seed(0)
    with torch.no_grad():
        if hasattr(model, "_themis_test_kind"):      # an HF family (Switch is encoder-decoder: labels)
            return output_tensors(model(input_ids=tokens, labels=tokens, use_cache=False))
        return output_tensors(model(tokens))


def _runtime_calls(model, infos) -> dict[str, list[tuple]]:
    """Per layer, the argument signatures its experts module is called with in one forward."""
    calls: dict[str, list[tuple]] = {info.name: [] for info in infos}
    hooks = []
    for info in infos:
        def record(module, args, name=info.name):
            calls[name].append(tuple((a.dtype.is_floating_point, a.dim()) if isinstance(a, torch.Tensor) else type(a)
                                     for a in args))
        hooks.append(info.experts.register_forward_pre_hook(record))
    try:
        _forward(model, torch.randint(0, 32, (2, 8)), training=False)
    finally:
        for h in hooks:
            h.remove()
    return calls


@pytest.mark.parametrize("name", [s.name for s in STYLES])
def test_each_style_keeps_the_contract(name):
    style = styles.STYLES[[s.name for s in STYLES].index(name)]
    torch.manual_seed(0)
    model = WITNESSES[name]()
    found, rejected = find_moe_layers(model)
    assert found and not rejected, rejected
    assert {info.rewrite for info in found} == {name}
    report = explain_moe_layers(model)
    for info in found:
        assert style_of(info) is style
        lines = f"    forward:        {style.call(info)}\n    style:          {name} (written so by {style.written_by})"
        assert lines in report, report
        assert f"; {style.call(info)}" in describe_layer(info)

    original = copy.deepcopy(model)
    tokens = torch.randint(0, 32, (2, 8))
    infos = prepare_moe_layers(model)
    assert [i.name for i in infos] == [i.name for i in found]
    for info in infos:
        assert info.rewritten == (style.apply is not None)
    for training in (True, False):
        for got, want in zip(_forward(model, tokens, training), _forward(original, tokens, training), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # The one call the runtime swaps: experts(x_TH floating, ids_TK integer, weights_TK floating).
    for layer, seen in _runtime_calls(model, infos).items():
        assert (True, 2) in [sig[0] for sig in seen if sig], (layer, seen)
        assert any(sig[:3] == ((True, 2), (False, 2), (True, 2)) for sig in seen), (layer, seen)


def test_an_unknown_style_is_an_error_naming_the_layer():
    torch.manual_seed(0)
    (info,), _ = find_moe_layers(zoo.ZooLM("gpt_fast", layers=1))
    info.rewrite = "made-up"
    with pytest.raises(ValueError, match=r"MoE layer 'layers.0.moe': unknown style 'made-up'"):
        styles.rewrite_moe_layer(info)
