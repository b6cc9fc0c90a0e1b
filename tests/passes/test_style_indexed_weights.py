"""Style "indexed-weights": stacked ``[E, ...]`` weights of the block itself, applied per expert by a loop
that indexes them, ``rows @ self.w_in[e]``, here on tokens sorted by expert and split by counts sized by the
weights' own shape (``bincount(ids, minlength=self.w_in.shape[0])``), the combine an ``index_add``. The
weights' shape stays readable while the forward runs with each weight seen as its E entries
(``parallel_lists.StackedEntries``). Found, explained, rewritten exactly (tests/passes/style_checks.py), and
trained like one process on 2 ranks under every policy; stacked biases beside such weights:
tests/passes/test_style_stacked_biases.py.

Shape suffixes: T tokens, N rows, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.passes import zoo_models as zoo
from tests.passes.style_checks import check_style
from tests.passes.style_training import trains_like_one_process

E, K = zoo.E, zoo.K
LAYERS = ["layers.0.moe", "layers.1.moe"]


class ShapeSizedLoopMoE(nn.Module):
    def __init__(self, dim: int = zoo.H, hidden: int = zoo.FFN, num_experts: int = E, top_k: int = K) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        weights_TK, ids_TK = self.router(x_TH).softmax(-1).topk(self.top_k)
        flat_N = ids_TK.flatten()
        order_N = flat_N.argsort(stable=True)
        counts = torch.bincount(flat_N, minlength=self.w_in.shape[0]).tolist()
        rows_NH = x_TH[order_N // self.top_k]
        outs = [F.gelu(chunk @ self.w_in[e]) @ self.w_out[e] for e, chunk in enumerate(rows_NH.split(counts))]
        y_NH = torch.cat(outs) * weights_TK.flatten()[order_N, None]
        return torch.zeros_like(x_TH).index_add(0, order_N // self.top_k, y_NH).reshape(x_BSH.shape)


def build() -> zoo.ZooLM:
    torch.manual_seed(0)
    return zoo.skew_routers(zoo.ZooLM("shape_sized", blocks={"shape_sized": ShapeSizedLoopMoE}), "router", 3.0)


def is_expert(name: str) -> bool:
    return ".w_in" in name or ".w_out" in name


def test_found_explained_and_rewritten_exactly():
    check_style(build, "indexed-weights", 2)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)
