"""The checks each style's own test file (``tests/passes/test_style_<name>.py``) makes on its witnesses,
models written that way by other projects' conventions (the zoo, the HF families):

- detection finds every MoE layer of the model as that style (``MoELayerInfo.rewrite``), none rejected;
- ``explain`` says the style's row's sentence about the block's forward;
- ``prepare_moe_layers`` rewrites it keeping the user's state-dict keys and parameter objects, and the
  model then computes what it did before: outputs in train and eval mode, and every parameter's gradient.

How each style trains sharded on 2 and 4 ranks: tests/passes/test_zoo_training.py (the zoo's blocks),
tests/passes/test_hf_families.py (the HF families), and the style files that train their own models.
"""

from __future__ import annotations

from typing import Callable

import torch

from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.explain import explain_moe_layers
from themis_compile.passes.replay import output_tensors
from themis_compile.passes.styles import prepare_moe_layers, style_of

VOCAB = 32      # below every witness's vocabulary


def _outputs(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    if hasattr(model, "_themis_test_kind"):       # an HF family (encoder-decoders need labels)
        return output_tensors(model(input_ids=tokens, labels=tokens, use_cache=False))
    return output_tensors(model(tokens))


def _run(model, tokens: torch.Tensor, training: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs, gradient by parameter name) of a seeded forward and backward of a random projection."""
    model.train(training)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    outs = [o for o in _outputs(model, tokens) if o.is_floating_point()]
    g = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return [o.detach() for o in outs], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_style(build: Callable[[], torch.nn.Module], style: str, num_layers: int) -> None:
    """The checks of the module docstring for the model ``build()`` (seeded: equal models on each call)."""
    model = build()
    found, rejected = find_moe_layers(model)
    assert not rejected, rejected
    assert [info.rewrite for info in found] == [style] * num_layers, [(i.name, i.rewrite) for i in found]
    report = explain_moe_layers(model)
    for info in found:
        assert f"    forward:        {style_of(info).call(info)}\n" in report, report

    original = build()
    keys, names = list(model.state_dict()), {id(p): n for n, p in model.named_parameters()}
    infos = prepare_moe_layers(model, strict=True)       # (strict: a layer left as it is raises)
    assert [i.name for i in infos] == [i.name for i in found]
    assert list(model.state_dict()) == keys
    assert {id(p) for p in model.parameters()} == set(names)      # the same parameter objects
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    for training in (True, False):
        got, _ = _run(model, tokens, training)
        want, want_grads = _run(original, tokens, training)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        by_name = {names[id(p)]: p.grad for p in model.parameters() if p.grad is not None}
        assert by_name.keys() == want_grads.keys()
        for name, grad in by_name.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=f"{style}: {name}")
