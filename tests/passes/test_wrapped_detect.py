"""Experts held in a ModuleList inside a wrapper module, as detection and the rewrites see them: the zoo's
Megatron-Core block (sorted rows through ``SequentialMLP``) and DeepSpeed block (dense dispatch through
``Experts``), and a wrapper whose forward does not give each expert its own slots. Training and
checkpoints: tests/passes/test_zoo_training.py, tests/runtime/test_wrapped_experts.py."""

from __future__ import annotations

import pytest
import torch

from tests.passes import zoo_models as zoo
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.styles import prepare_moe_layers


@pytest.mark.parametrize("style, rewrite, tail", [("megatron", "sorted-rows", 1), ("deepspeed", "dense-dispatch", 0)])
def test_wrapped_experts_are_found_and_rewritten_keeping_names(style, rewrite, tail):
    torch.manual_seed(0)
    block = zoo.BLOCKS[style]()
    infos, rejected = find_moe_layers(block)
    assert not rejected and len(infos) == 1, rejected
    info = infos[0]
    assert (info.experts_form, info.rewrite, info.num_experts, info.top_k, info.call_tail) == (
        "wrapped", rewrite, zoo.E, zoo.K, tail)
    reference = zoo.BLOCKS[style]()
    reference.load_state_dict(block.state_dict())
    keys = list(block.state_dict())
    block(torch.randn(2, 4, zoo.H))        # a forward first: DeepSpeed's block then holds l_aux with its graph
    prepare_moe_layers(block, strict=True)
    assert list(block.state_dict()) == keys          # the wrapper keeps its list and the user's names
    x = torch.randn(2, 8, zoo.H)
    expected, got = reference(x), block(x)
    expected, got = zoo._moe_output(expected), zoo._moe_output(got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    expected.square().sum().backward()
    grads = dict(reference.named_parameters())
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


class _SlotMixingExperts(zoo.DeepSpeedExperts):
    """Chunks the dispatched [E, C, H] along C instead of E: expert i runs on capacity slots of every
    expert, which is no MoE layer (a reduction of DeepSpeed's forward that forgets its reshape)."""

    def forward(self, inputs):
        return super().forward(inputs.reshape(zoo.E, -1, zoo.H)).reshape(inputs.shape)


class _SlotMixingMoE(zoo.DeepSpeedMOELayer):
    def __init__(self) -> None:
        super().__init__()
        self.experts.__class__ = _SlotMixingExperts


def test_a_wrapper_mixing_slots_is_not_trained_as_an_moe():
    torch.manual_seed(0)
    block = _SlotMixingMoE()
    x = torch.randn(2, 4, zoo.H)
    before = block(x)
    with pytest.raises(ValueError, match="does not match the original"):
        prepare_moe_layers(block, strict=True)
    torch.testing.assert_close(block(x), before)       # left unchanged


class _SkippingSequentialMLP(zoo.MegatronSequentialMLP):
    """``SequentialMLP`` that runs only the experts with rows (an empty split stays empty)."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor):
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        outputs = [expert(tokens) if tokens.shape[0] else tokens for expert, tokens in zip(self.local_experts,
                                                                                             tokens_list)]
        return torch.cat(outputs, dim=0), None


@pytest.mark.parametrize("skipping", [False, True])
def test_a_wrapper_on_sorted_rows_that_skips_empty_experts_is_recorded_so(skipping):
    """An expert without tokens gets no gradient in one process when the wrapper skips its empty split:
    detection records it (``skips_empty_experts``), so that the runtime leaves that gradient missing too."""
    torch.manual_seed(0)
    block = zoo.MegatronMoELayer()
    if skipping:
        block.experts = _SkippingSequentialMLP()
    model = torch.nn.Sequential(block)
    infos, rejected = find_moe_layers(model)
    assert not rejected, rejected
    assert [(i.rewrite, i.skips_empty_experts) for i in infos] == [("sorted-rows", skipping)]
    x = torch.randn(2, 4, zoo.H)
    expected = block(x)[0]
    assert [i.skips_empty_experts for i in prepare_moe_layers(model, strict=True)] == [skipping]
    torch.testing.assert_close(block(x)[0], expected)
