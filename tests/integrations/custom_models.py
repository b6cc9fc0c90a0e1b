"""Small Hugging Face causal LMs of our own whose MoE blocks hold their experts in forms that ``optimize``
rewrites by moving the user's parameters into an experts child it creates (the user's state-dict keys kept
through key maps), for the HF Trainer integration tests:

- ``ListedMoEForCausalLM``: the block holds each expert's two weights as entries of two
  ``nn.ParameterList`` s (``up.3``, ``down.3``) and applies them itself, one ``F.linear`` per weight for
  the rows routed to the expert; an expert that receives no token is skipped ("param-lists");
- ``StackedMoEForCausalLM``: the block holds ``[E, ...]`` stacked parameters of its own (``w_in``,
  ``w_out``), gathers each token's chosen experts' weights by id and contracts them with ``einsum``
  ("own-weights");
- ``IndexedMoEForCausalLM``: the same stacked parameters, indexed by expert id in a loop over the tokens
  sorted by expert, ``rows @ self.w_in[e]`` ("indexed-weights").

All are ordinary ``PreTrainedModel`` s (embeddings, pre-norm decoder layers with causal self-attention
and the MoE block, an LM head) returning ``CausalLMOutput`` with the loss when labels are given (summed
over the label tokens and divided by ``num_items_in_batch`` when Trainer passes it), so that
``save_pretrained`` / ``from_pretrained`` work on them unmodified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

__all__ = ["TinyMoEConfig", "ListedMoEForCausalLM", "StackedMoEForCausalLM", "IndexedMoEForCausalLM",
           "TraceableListedMoEForCausalLM",
           "CUSTOM_MODELS", "make_custom_model"]


class TinyMoEConfig(PretrainedConfig):
    model_type = "themis_tiny_moe"

    def __init__(self, vocab_size: int = 128, hidden_size: int = 32, expert_size: int = 32, num_layers: int = 2,
                 num_heads: int = 4, num_experts: int = 4, experts_per_token: int = 2, max_positions: int = 64,
                 **kwargs) -> None:
        self.vocab_size, self.hidden_size, self.expert_size = vocab_size, hidden_size, expert_size
        self.num_layers, self.num_heads, self.max_positions = num_layers, num_heads, max_positions
        self.num_experts, self.experts_per_token = num_experts, experts_per_token
        super().__init__(**kwargs)


def _route(gate: nn.Linear, x_TH: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router, the k best experts per token, their probabilities renormalized to sum to 1."""
    probs_TE = gate(x_TH).softmax(dim=-1)
    weights_TK, ids_TK = probs_TE.topk(top_k, dim=-1)
    return weights_TK / weights_TK.sum(dim=-1, keepdim=True), ids_TK


class ListedExpertsMoE(nn.Module):
    """Experts as two ParameterLists; the block runs expert e on its rows itself."""

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        h, f, n = config.hidden_size, config.expert_size, config.num_experts
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(h, n, bias=False)
        self.up = nn.ParameterList(nn.Parameter(torch.randn(f, h) * h ** -0.5) for _ in range(n))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(h, f) * f ** -0.5) for _ in range(n))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        weights_TK, ids_TK = _route(self.gate, x_TH, self.top_k)
        out_TH = torch.zeros_like(x_TH)
        for e in range(len(self.up)):
            tokens, slots = torch.nonzero(ids_TK == e, as_tuple=True)
            if tokens.numel() == 0:
                continue
            rows = F.linear(F.gelu(F.linear(x_TH[tokens], self.up[e])), self.down[e])
            out_TH = out_TH.index_add(0, tokens, rows * weights_TK[tokens, slots].unsqueeze(-1))
        return out_TH.view_as(hidden)


class StackedExpertsMoE(nn.Module):
    """Experts as stacked parameters of the block, gathered by the chosen ids and applied with einsum."""

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        h, f, n = config.hidden_size, config.expert_size, config.num_experts
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(h, n, bias=False)
        self.w_in = nn.Parameter(torch.randn(n, h, f) * h ** -0.5)
        self.w_out = nn.Parameter(torch.randn(n, f, h) * f ** -0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        weights_TK, ids_TK = _route(self.gate, x_TH, self.top_k)
        h_TKF = F.gelu(torch.einsum("th,tkhf->tkf", x_TH, self.w_in[ids_TK]))
        y_TKH = torch.einsum("tkf,tkfh->tkh", h_TKF, self.w_out[ids_TK])
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK).view_as(hidden)


class IndexedExpertsMoE(nn.Module):
    """Experts as stacked parameters of the block, indexed by expert id in a loop over the tokens sorted by
    expert (``rows @ self.w_in[e]``)."""

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        h, f, n = config.hidden_size, config.expert_size, config.num_experts
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(h, n, bias=False)
        self.w_in = nn.Parameter(torch.randn(n, h, f) * h ** -0.5)
        self.w_out = nn.Parameter(torch.randn(n, f, h) * f ** -0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x_TH = hidden.reshape(-1, hidden.shape[-1])
        weights_TK, ids_TK = _route(self.gate, x_TH, self.top_k)
        order = ids_TK.flatten().argsort(stable=True)
        counts = torch.bincount(ids_TK.flatten(), minlength=len(self.w_in)).tolist()
        outs = [F.gelu(rows @ self.w_in[e]) @ self.w_out[e]
                for e, rows in enumerate(x_TH[order // self.top_k].split(counts))]
        y_NH = torch.zeros(order.numel(), x_TH.shape[-1], dtype=x_TH.dtype, device=x_TH.device)
        y_NH = y_NH.index_copy(0, order, torch.cat(outs))
        return (y_NH.view(*ids_TK.shape, -1) * weights_TK.unsqueeze(-1)).sum(dim=1).view_as(hidden)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class DecoderLayer(nn.Module):
    def __init__(self, config: TinyMoEConfig, moe_cls: type) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.moe_norm = nn.RMSNorm(config.hidden_size)
        self.moe = moe_cls(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class _TinyMoEForCausalLM(PreTrainedModel):
    config_class = TinyMoEConfig
    base_model_prefix = "model"
    moe_cls: type = nn.Module
    check_length = True

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.moe_cls) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # The experts keep their own initialization (__init__); from_pretrained overwrites everything.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.05)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        # A length check on the input, as HF models have: it also keeps torch.fx from tracing this forward
        # whole (a trace would fix the branches on labels / num_items_in_batch below to the traced ones), so
        # that optimize's schedule traces the decoder layers instead.
        if self.check_length and input_ids.shape[1] > self.config.max_positions:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens, more than {self.config.max_positions}")
        x = self.embed(input_ids) + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            shift_labels = labels[:, 1:].reshape(-1)
            if num_items_in_batch is None:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
            else:
                loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
                loss = loss / num_items_in_batch
        return CausalLMOutput(loss=loss, logits=logits)


class ListedMoEForCausalLM(_TinyMoEForCausalLM):
    moe_cls = ListedExpertsMoE


class StackedMoEForCausalLM(_TinyMoEForCausalLM):
    moe_cls = StackedExpertsMoE


class IndexedMoEForCausalLM(_TinyMoEForCausalLM):
    moe_cls = IndexedExpertsMoE


class TraceableListedMoEForCausalLM(ListedMoEForCausalLM):
    """Without the length check: torch.fx traces its forward whole (tests/integrations/test_trainer_forms.py
    holds what the schedule makes of that trace)."""

    check_length = False


CUSTOM_MODELS = {"param-lists": ListedMoEForCausalLM, "own-weights": StackedMoEForCausalLM,
                 "indexed-weights": IndexedMoEForCausalLM}


def make_custom_model(form: str, **config) -> _TinyMoEForCausalLM:
    """A freshly initialized model of ``CUSTOM_MODELS[form]`` (seed 0: the same weights on every rank)."""
    torch.manual_seed(0)
    return CUSTOM_MODELS[form](TinyMoEConfig(**config))
