"""The models ``bench step`` trains, each behind the one interface its harness needs.

``tiny-moe`` is the project's reference model (`themis_compile.models.GPTMoE`); ``hf-mixtral`` is
transformers' ``MixtralForCausalLM`` from a random-init ``MixtralConfig`` of the same sizes (hidden
``d_model``, intermediate ``d_ffn``, 4 attention heads, 2 key-value heads, vocabulary 256, no auxiliary
loss: ``output_router_logits`` stays off, so its training objective is the language-model loss alone).
The harness skews, calibrates, replays and counts the routing of both the same way, through a
`BenchRouter` per MoE block:

- ``router_bias`` (an [E] float32 tensor, changed in place): the router's logits are ``gate(x) +
  router_bias``. The reference model has this buffer itself. An HF Mixtral block gets it without any edit
  of transformers: a forward hook on its ``MixtralTopKRouter`` (`BiasedTopKRouter`) recomputes what that
  router returns — softmax of the biased logits, top-k, the top-k probabilities renormalized to sum 1 —
  from the logits it computed, so the block's own forward (and whatever runtime serves its experts
  call) receives the biased routing; at bias 0 the result is the router's own, bit for bit.
- ``logits(x_TH)``: the unbiased router logits (what a routing-trace replay fits the bias to);
  ``route(x_TH)``: the top-k expert ids under the current bias; ``block``: the module whose forward
  pre-hook sees the MoE block's input.
- ``last_global_counts()``: the tokens per expert of the last forward over the whole global batch.

Both models' ``router_skew`` starts from the same seeded direction (`router_skew_bias`, the reference
model's): expert e's bias is ``-skew * log(order_e + 1)``.

Shape suffixes: B batch, S sequence, T tokens, H hidden size, E experts, K top-k, V vocabulary.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "BenchModel", "BenchRouter", "BiasedTopKRouter", "build_bench_model", "router_skew_bias"]

MODELS = ("tiny-moe", "hf-mixtral")
VOCAB_SIZE = 256


def router_skew_bias(num_experts: int, layer_idx: int, skew: float) -> torch.Tensor:
    """[E] bias ``-skew * log(order_e + 1)`` over a seeded order of the experts of MoE layer ``layer_idx``:
    the reference model's ``router_skew`` (``MoEFeedForward.router_bias``; tests hold the two equal)."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(1234 + layer_idx))
    return -skew * torch.log(order.to(torch.float32) + 1.0)


class BenchRouter(abc.ABC):
    """One MoE block's routing as the harness sees it (see the module docstring)."""

    block: nn.Module                # its forward pre-hook sees the MoE block's input
    router_bias: torch.Tensor       # [E] float32, changed in place: logits = gate(x) + router_bias
    num_experts: int
    top_k: int

    @abc.abstractmethod
    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """[T, E] router logits without the bias."""

    @abc.abstractmethod
    def route(self, x_TH: torch.Tensor) -> torch.Tensor:
        """[T, K] expert ids the router picks under the current bias."""

    @abc.abstractmethod
    def last_global_counts(self) -> torch.Tensor:
        """[E] int64 tokens per expert of the last forward, over the whole global batch."""


class _ReferenceRouter(BenchRouter):
    """The reference model's ``MoEFeedForward``: it has the bias, the routing and the counts itself; its
    counts are global already (a data-parallel runtime all-reduces them in ``global_tokens_per_expert``)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.router_bias = block.router_bias
        self.num_experts, self.top_k = block.num_experts, block.top_k

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.block.gate(x_TH)

    def route(self, x_TH: torch.Tensor) -> torch.Tensor:
        return self.block.route(x_TH)[1]

    def last_global_counts(self) -> torch.Tensor:
        return self.block.last_tokens_per_expert


class BiasedTopKRouter(BenchRouter):
    """A ``router_bias`` for an HF ``MixtralSparseMoeBlock``: a forward hook on ``block.gate``.

    Contract: ``block.gate`` is a module whose forward returns ``(router_logits_TE, scores_TK, ids_TK)``
    computed as transformers' ``MixtralTopKRouter`` does (logits = ``F.linear(x_TH, gate.weight)``).
    The hook returns, from ``router_logits_TE + router_bias``:

        logits_TE = router_logits_TE + router_bias
        probs_TE  = softmax(float32(logits_TE))
        scores_TK, ids_TK = top-k(probs_TE)
        scores_TK /= scores_TK.sum(-1)                   # renormalized over the k kept experts
        return logits_TE, scores_TK, ids_TK

    and records this rank's tokens per expert. The hook lives as long as this object's ``remove``
    is not called; it is the only change to the model (no parameter, buffer or state-dict key is added).
    """

    def __init__(self, block: nn.Module) -> None:
        gate = block.gate
        self.block, self.gate = block, gate
        self.num_experts, self.top_k = int(gate.num_experts), int(gate.top_k)
        self.router_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=gate.weight.device)
        self._counts_E: torch.Tensor | None = None
        self._handle = gate.register_forward_hook(self._biased)

    def _biased(self, gate: nn.Module, args: tuple, out: tuple) -> tuple:
        logits_TE = out[0] + self.router_bias.to(out[0].dtype)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        scores_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        scores_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True)
        self._counts_E = _count(ids_TK, self.num_experts)
        return logits_TE, scores_TK, ids_TK

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        weight = self.gate.weight
        if hasattr(weight, "full_tensor"):        # FSDP2 outside the layer's forward (collective)
            weight = weight.full_tensor()
        return F.linear(x_TH.reshape(-1, x_TH.shape[-1]), weight)

    def route(self, x_TH: torch.Tensor) -> torch.Tensor:
        probs_TE = torch.softmax((self.logits(x_TH) + self.router_bias).float(), dim=-1)
        return torch.topk(probs_TE, self.top_k, dim=-1).indices

    def last_global_counts(self) -> torch.Tensor:
        """This rank's counts of the last forward summed over the ranks: a collective when a process group
        exists (every rank calls it, outside the timed step), this process's counts otherwise."""
        import torch.distributed as dist

        if self._counts_E is None:
            raise RuntimeError("no forward has run through this router yet")
        counts_E = self._counts_E.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts_E)
        return counts_E

    def remove(self) -> None:
        self._handle.remove()


def _count(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device)
    return counts_E.scatter_add_(0, ids_TK.reshape(-1), torch.ones_like(ids_TK.reshape(-1))).detach()


@dataclass
class BenchModel:
    """A benchmark model: ``model`` (unmodified: what ``themis_compile.optimize`` or plain FSDP2 is given),
    its routers (one per MoE block, in order), ``blocks`` (the transformer blocks plain FSDP2 shards one
    by one) and ``loss(tokens_BS)``: next-token cross-entropy (`models.lm_loss`) plus the model's
    auxiliary loss, where it has one."""

    kind: str
    model: nn.Module
    routers: list[BenchRouter]
    blocks: list[nn.Module]
    loss: Callable[[torch.Tensor], torch.Tensor]

    def set_router_skew(self, skew: float) -> None:
        """Every router's bias to ``router_skew_bias(E, layer, skew)``."""
        for layer, r in enumerate(self.routers):
            r.router_bias.copy_(router_skew_bias(r.num_experts, layer, skew).to(r.router_bias))


def build_bench_model(kind: str, *, d_model: int, d_ffn: int, num_experts: int, top_k: int, n_layers: int,
                      seq_len: int, router_skew: float, seed: int = 0) -> BenchModel:
    """The ``kind`` model (`MODELS`) of these sizes, initialized from ``seed``, its routers skewed by
    ``router_skew``."""
    from themis_compile.models import build_model, lm_loss

    torch.manual_seed(seed)
    if kind == "tiny-moe":
        model = build_model("tiny-moe", d_model=d_model, d_ffn=d_ffn, num_experts=num_experts, top_k=top_k,
                            n_layers=n_layers, seq_len=seq_len, router_skew=router_skew, n_heads=4,
                            vocab_size=VOCAB_SIZE)
        return BenchModel(kind, model, [_ReferenceRouter(m) for m in model.moe_layers()], list(model.blocks),
                          lambda tokens_BS: lm_loss(model(tokens_BS), tokens_BS) + model.aux_loss())
    if kind == "hf-mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(vocab_size=VOCAB_SIZE, hidden_size=d_model, intermediate_size=d_ffn,
                            num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=num_experts, num_experts_per_tok=top_k,
                            max_position_embeddings=seq_len, output_router_logits=False, use_cache=False)
        model = MixtralForCausalLM(cfg)
        bench = BenchModel(kind, model, [BiasedTopKRouter(layer.mlp) for layer in model.model.layers],
                           list(model.model.layers),
                           lambda tokens_BS: lm_loss(model(input_ids=tokens_BS).logits, tokens_BS))
        bench.set_router_skew(router_skew)
        return bench
    raise ValueError(f"unknown bench model {kind!r}; choose from {MODELS}")
