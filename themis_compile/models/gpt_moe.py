"""A GPT-style MoE decoder, readable top to bottom: the reference model of the project.

Pre-norm blocks of causal self-attention (``F.scaled_dot_product_attention``) and an MoE feed-forward in
every layer. The MoE feed-forward exists in the two forms real code uses:

- ``experts_form="loop"``: experts are an ``nn.ModuleList`` of MLPs and the block loops over them,
  HF-Mixtral style (``torch.where`` per expert, ``index_add_`` back);
- ``experts_form="stacked"``: expert weights stacked ``[E, ...]`` in one module and gathered per token
  pair, torchtitan / gpt-fast style.

Shape suffixes: B batch, S sequence, T tokens (B*S), H d_model, F d_ffn, E experts, K top-k, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROUTINGS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("swiglu", "gelu")
EXPERT_FORMS = ("loop", "stacked")


@dataclass
class MoEModelConfig:
    """Hyper-parameters of the reference model. ``num_experts`` is the total over all devices."""

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ffn: int = 128
    num_experts: int = 8
    top_k: int = 2
    seq_len: int = 128
    experts_form: str = "loop"
    routing: str = "softmax_topk"
    activation: str = "swiglu"
    shared_expert: bool = False
    aux_loss_weight: float = 0.001
    router_skew: float = 0.0
    # Table 1 of the paper gives experts per GPU; num_experts = experts_per_device * devices.
    experts_per_device: int | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r} is not one of {ROUTINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.experts_form not in EXPERT_FORMS:
            raise ValueError(f"experts_form={self.experts_form!r} is not one of {EXPERT_FORMS}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")

    def replace(self, **changes) -> "MoEModelConfig":
        return dataclasses.replace(self, **changes)


class ExpertMLP(nn.Module):
    """One expert: SwiGLU (w2(silu(w1 x) * w3 x)) or GeLU (w2(gelu(w1 x)))."""

    def __init__(self, d_model: int, d_ffn: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(d_model, d_ffn, bias=False)
        self.w2 = nn.Linear(d_ffn, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ffn, bias=False) if activation == "swiglu" else None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x_TH)) * self.w3(x_TH))
        return self.w2(F.gelu(self.w1(x_TH)))


class StackedExperts(nn.Module):
    """All experts' weights stacked along a leading E dimension (torchtitan ``GroupedExperts`` layout)."""

    def __init__(self, num_experts: int, d_model: int, d_ffn: int, activation: str = "swiglu") -> None:
        super().__init__()
        self.activation = activation
        self.w1_EFH = nn.Parameter(torch.empty(num_experts, d_ffn, d_model))
        self.w2_EHF = nn.Parameter(torch.empty(num_experts, d_model, d_ffn))
        self.w3_EFH = nn.Parameter(torch.empty(num_experts, d_ffn, d_model)) if activation == "swiglu" else None
        for w in self.parameters():
            # Same init as nn.Linear per expert slice.
            for e in range(num_experts):
                nn.init.kaiming_uniform_(w.data[e], a=math.sqrt(5))

    @property
    def num_experts(self) -> int:
        return self.w1_EFH.shape[0]

    @staticmethod
    def expert_forward(params: list[torch.Tensor], x_NH: torch.Tensor) -> torch.Tensor:
        """One expert on rows x_NH, given its slices (w1_FH, w2_HF[, w3_FH]) in parameter order."""
        w1_FH, w2_HF, *rest = params
        h_NF = x_NH @ w1_FH.t()
        h_NF = F.silu(h_NF) * (x_NH @ rest[0].t()) if rest else F.gelu(h_NF)
        return h_NF @ w2_HF.t()

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        # gpt-fast style: gather each pair's expert weights and run them with einsum; static shapes.
        T, K = ids_TK.shape
        x_TKH = x_TH[:, None, :].expand(T, K, x_TH.shape[-1])
        h_TKF = torch.einsum("tkh,tkfh->tkf", x_TKH, self.w1_EFH[ids_TK])
        if self.w3_EFH is not None:
            h_TKF = F.silu(h_TKF) * torch.einsum("tkh,tkfh->tkf", x_TKH, self.w3_EFH[ids_TK])
        else:
            h_TKF = F.gelu(h_TKF)
        y_TKH = torch.einsum("tkf,tkhf->tkh", h_TKF, self.w2_EHF[ids_TK])
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))


class MoEFeedForward(nn.Module):
    """Router -> top-k -> experts -> weighted combine (+ optional shared expert, + auxiliary loss).

    ``route`` is the user's routing code and ``combine_experts`` the expert computation; distributed
    runtimes replace the latter and keep the former.
    """

    def __init__(self, cfg: MoEModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.routing = cfg.routing
        self.aux_loss_weight = cfg.aux_loss_weight
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        if cfg.experts_form == "loop":
            self.experts = nn.ModuleList(
                ExpertMLP(cfg.d_model, cfg.d_ffn, cfg.activation) for _ in range(cfg.num_experts)
            )
        else:
            self.experts = StackedExperts(cfg.num_experts, cfg.d_model, cfg.d_ffn, cfg.activation)
        self.shared_expert = ExpertMLP(cfg.d_model, cfg.d_ffn, cfg.activation) if cfg.shared_expert else None
        # router_skew biases the router towards a seeded order of experts, p_e ~ (rank_e + 1)^-skew at
        # initialisation, so that benchmarks see paper-like skew. A buffer: it is part of the model.
        order = torch.randperm(cfg.num_experts, generator=torch.Generator().manual_seed(1234 + layer_idx))
        bias_E = -cfg.router_skew * torch.log(order.to(torch.float32) + 1.0)
        self.register_buffer("router_bias", bias_E, persistent=False)
        self.aux_loss = torch.zeros(())
        self.last_tokens_per_expert: torch.Tensor | None = None

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (weights_TK, expert ids_TK, router probabilities_TE)."""
        logits_TE = self.gate(x_TH) + self.router_bias
        if self.routing == "softmax_topk":
            probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
            weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        else:  # topk_softmax
            top_TK, ids_TK = torch.topk(logits_TE, self.top_k, dim=-1)
            weights_TK = torch.softmax(top_TK, dim=-1, dtype=torch.float32)
            probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        return weights_TK.to(x_TH.dtype), ids_TK, probs_TE

    def tokens_per_expert(self, ids_TK: torch.Tensor) -> torch.Tensor:
        # scatter_add_ (not bincount) keeps torch.compile graphs whole.
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=ids_TK.device)
        return counts_E.scatter_add_(0, ids_TK.reshape(-1), torch.ones_like(ids_TK.reshape(-1)))

    def global_tokens_per_expert(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Token counts over the whole global batch; a data-parallel runtime all-reduces here."""
        return counts_E

    def combine_experts(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.experts, nn.ModuleList):
            # Stacked experts, or the sharded experts a distributed runtime put in their place.
            return self.experts(x_TH, ids_TK, weights_TK)
        # HF-Mixtral style loop over experts.
        out_TH = torch.zeros_like(x_TH)
        for e, expert in enumerate(self.experts):
            token_idx, k_idx = torch.where(ids_TK == e)
            y = expert(x_TH[token_idx]) * weights_TK[token_idx, k_idx, None]
            out_TH.index_add_(0, token_idx, y.to(out_TH.dtype))
        return out_TH

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights_TK, ids_TK, probs_TE = self.route(x_TH)
        counts_E = self.global_tokens_per_expert(self.tokens_per_expert(ids_TK))
        self.last_tokens_per_expert = counts_E.detach()
        if self.aux_loss_weight:
            # Switch-style load-balancing loss E * sum_e f_e * P_e, f from the global counts (so that
            # data-parallel ranks average to the global-batch loss), P from the local probabilities.
            f_E = counts_E.to(probs_TE.dtype) / counts_E.sum().clamp(min=1)
            self.aux_loss = self.aux_loss_weight * self.num_experts * (f_E * probs_TE.mean(0)).sum()
        out_TH = self.combine_experts(x_TH, ids_TK, weights_TK)
        if self.shared_expert is not None:
            out_TH = out_TH + self.shared_expert(x_TH)
        return out_TH.view_as(x_BSH)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MoEModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        q, k, v = self.qkv(x_BSH).view(B, S, 3, self.n_heads, H // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, H))


class Block(nn.Module):
    def __init__(self, cfg: MoEModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoEFeedForward(cfg, layer_idx)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.ln_1(x_BSH))
        return x_BSH + self.moe(self.ln_2(x_BSH))


class GPTMoE(nn.Module):
    """``model(tokens_BS) -> logits_BSV``; ``model.aux_loss()`` is the summed load-balancing loss."""

    def __init__(self, cfg: MoEModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        B, S = tokens_BS.shape
        if S > self.config.seq_len:
            raise ValueError(f"sequence length {S} exceeds the model's seq_len={self.config.seq_len}")
        pos_S = torch.arange(S, device=tokens_BS.device)
        x_BSH = self.tok_emb(tokens_BS) + self.pos_emb(pos_S)
        for block in self.blocks:
            x_BSH = block(x_BSH)
        return self.lm_head(self.ln_f(x_BSH))

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.moe for b in self.blocks]

    def aux_loss(self) -> torch.Tensor:
        losses = [m.aux_loss for m in self.moe_layers()]
        return torch.stack([torch.as_tensor(loss) for loss in losses]).sum()


def lm_loss(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (mean over the B*(S-1) predicted positions)."""
    return F.cross_entropy(logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]), tokens_BS[:, 1:].reshape(-1))
