"""What detection found in a model, as ``themis_compile.explain`` prints it before ``optimize``: each MoE
layer with its router, experts, activation, shared experts and how it calls its experts (its style's
sentence, :data:`themis_compile.passes.styles.STYLES`), and each MoE-like module left data-parallel with
the reason, said so that the user can act on it."""

from __future__ import annotations

from torch import nn

from themis_compile.passes.candidates import shared_parameter_names
from themis_compile.passes.detect import SEARCHED, find_moe_layers
from themis_compile.passes.probe import ExampleInputs
from themis_compile.passes.styles import style_of

__all__ = ["explain_moe_layers"]


def explain_moe_layers(model: nn.Module, example_inputs: ExampleInputs | None = None) -> str:
    """A readable report of the MoE layers found and of the MoE-like modules rejected, with reasons."""
    infos, rejected = find_moe_layers(model, example_inputs)
    lines = [f"{len(infos)} MoE layer(s) found"]
    for info in infos:
        lines.append(f"  {info.name}:")
        lines.append(f"    router:         {info.router}")
        lines.append(f"    experts:        {info.num_experts} ({info.experts_form}, attribute "
                     f"'{info.experts_attr}'), top-{info.top_k}")
        lines.append(f"    activation:     {info.activation}")
        lines.append(f"    shared experts: {', '.join(info.shared_expert_names) or 'none'}")
        if shared := shared_parameter_names(info):
            lines.append(f"    every expert uses: {', '.join(shared)} (dense, data-parallel)")
        for aux in info.aux_losses:
            lines.append(f"    auxiliary:      {aux}")
        if info.probe_call is not None:
            lines.append("    probed with:    the arguments it gets in a forward of the model (recorded)")
        style = style_of(info)
        lines.append(f"    forward:        {style.call(info)}")
        lines.append(f"    style:          {style.name} (written so by {style.written_by})")
    if rejected:
        lines.append(f"{len(rejected)} MoE-like module(s) rejected")
        for name, why in rejected:
            lines.append(f"  {name}: {why}")
    if not infos and not rejected:
        lines.append(f"  searched for {SEARCHED}")
    return "\n".join(lines)
