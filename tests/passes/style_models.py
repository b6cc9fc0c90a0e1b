"""MoE blocks whose experts are stacked ``[E, ...]`` parameters of the block itself, written the ways people
write them (not shaped to the detector):

- ``GatheredEinsumMoE``: router logits, top-k, softmax over the k logits, each weight gathered by the
  selected ids (``self.w_gate[ids_TK]``, ``[T, K, D, F]``), contracted with ``torch.einsum`` and combined
  with the top-k weights (Mixtral-in-one-file code, gpt-fast's ``cond_ffn`` inline in the block);
- ``InlineMoEDecoderLayer``: a whole decoder layer, attention, norms, a sigmoid router with a load-balancing
  bias and the stacked experts inline in one forward: every (token, slot) pair a row, its expert's weights
  gathered per row and applied with ``torch.bmm`` (no MoE submodule at all);
- ``PaddedBmmMoE``: tokens scattered into a padded ``[E, C, D]`` buffer (C the largest count, nothing
  dropped), one ``torch.bmm`` per weight over stacked ``[E, D, F]`` parameters, gathered back and combined.

``StackedLM`` puts a block in the zoo's small transformer (``tests/passes/zoo_models.py``), or, for the
decoder layer, stacks the layers themselves. Sizes: D = F = 32, E = 4, top-2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.passes import zoo_models as zoo

D, FFN, E, K, VOCAB, HEADS = zoo.H, zoo.FFN, zoo.E, zoo.K, zoo.VOCAB, zoo.HEADS


def _stacked(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * shape[-2] ** -0.5)


class GatheredEinsumMoE(nn.Module):
    def __init__(self, dim: int = D, ffn_dim: int = FFN, num_experts: int = E, top_k: int = K) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_gate = _stacked(num_experts, dim, ffn_dim)
        self.w_up = _stacked(num_experts, dim, ffn_dim)
        self.w_down = _stacked(num_experts, ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, dim = x.shape
        x = x.reshape(B * S, dim)
        logits = self.router(x)
        top_logits, ids = logits.topk(self.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)
        gate = torch.einsum("td,tkdf->tkf", x, self.w_gate[ids])
        up = torch.einsum("td,tkdf->tkf", x, self.w_up[ids])
        y = torch.einsum("tkf,tkfd->tkd", F.silu(gate) * up, self.w_down[ids])
        out = torch.einsum("tkd,tk->td", y, weights)
        return out.reshape(B, S, dim)


class InlineMoEDecoderLayer(nn.Module):
    def __init__(self, dim: int = D, ffn_dim: int = FFN, num_experts: int = E, top_k: int = K) -> None:
        super().__init__()
        self.heads, self.top_k = HEADS, top_k
        self.attn_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.router_bias = nn.Parameter(torch.zeros(num_experts))
        self.w1 = _stacked(num_experts, dim, ffn_dim)
        self.w2 = _stacked(num_experts, ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, dim = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, S, dim))

        h = self.ffn_norm(x).reshape(-1, dim)
        scores = torch.sigmoid(self.router(h))
        _, ids = (scores + self.router_bias).topk(self.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        flat_ids = ids.reshape(-1)
        rows = h.repeat_interleave(self.top_k, dim=0)
        hidden = F.gelu(torch.bmm(rows.unsqueeze(1), self.w1[flat_ids]))
        y = torch.bmm(hidden, self.w2[flat_ids]).squeeze(1)
        moe = (y.view(-1, self.top_k, dim) * weights.unsqueeze(-1)).sum(dim=1)
        return x + moe.view(B, S, dim)


class PaddedBmmMoE(nn.Module):
    def __init__(self, dim: int = D, ffn_dim: int = FFN, num_experts: int = E, top_k: int = K) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w_in = _stacked(num_experts, dim, ffn_dim)
        self.w_out = _stacked(num_experts, ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_ids = ids.flatten()
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        capacity = int(counts.max())
        order = flat_ids.argsort(stable=True)
        expert_of = flat_ids[order]
        slot = torch.arange(flat_ids.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert_of]
        buf = x.new_zeros(self.num_experts, capacity, x.shape[-1])
        buf[expert_of, slot] = x[order // self.top_k]
        out_buf = torch.bmm(F.gelu(torch.bmm(buf, self.w_in)), self.w_out)
        y = torch.empty(flat_ids.numel(), x.shape[-1], dtype=x.dtype, device=x.device)
        y[order] = out_buf[expert_of, slot]
        out = (y.view(-1, self.top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
        return out.view(shape)


class DecoderLM(zoo.ZooLM):
    """Embedding, two decoder layers that hold their MoE inline, LM head (the zoo transformer's forward and loss)."""

    def __init__(self, layer: type = InlineMoEDecoderLayer, layers: int = 2) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(layer() for _ in range(layers))
        self.head = nn.Linear(D, VOCAB, bias=False)


BLOCKS = {"gathered_einsum": GatheredEinsumMoE, "padded_bmm": PaddedBmmMoE}
ROUTERS = {"gathered_einsum": "router", "padded_bmm": "gate"}
WEIGHTS = {"gathered_einsum": ("w_gate", "w_up", "w_down"), "inline_decoder": ("w1", "w2"), "padded_bmm": ("w_in", "w_out")}
LAYERS = {"gathered_einsum": ["layers.0.moe", "layers.1.moe"], "inline_decoder": ["layers.0", "layers.1"],
          "padded_bmm": ["layers.0.moe", "layers.1.moe"]}


def style_model(style: str) -> nn.Module:
    """The style's model, seeded: a block in the zoo's transformer, or the decoder layers themselves."""
    torch.manual_seed(0)
    if style == "inline_decoder":
        return DecoderLM()
    return zoo.ZooLM(style, blocks=BLOCKS)


def skewed_model(style: str, skew: float = 3.0) -> nn.Module:
    """The style's model with expert 0 favoured by every router, from outside the block (the zoo way: a
    norm bias along the router's row 0), or by the decoder layer's own selection bias."""
    model = style_model(style)
    v_D = torch.full((D,), D ** -0.5)
    with torch.no_grad():
        for layer in model.layers:
            if style == "inline_decoder":
                layer.router_bias[0] = 0.1 * skew
                continue
            layer.norm2.bias.copy_(v_D)
            getattr(layer.moe, ROUTERS[style]).weight[0] += skew * v_D
    return model


def expert_weight(style: str):
    """Which parameter names of the style's unmodified model are expert weights."""
    return lambda name: name.rsplit(".", 1)[-1] in WEIGHTS[style]
