"""Expert parallelism (EP): the static baseline every speed-up is measured against (paper §2.2, §5).

Experts are owned contiguously by ranks (E need not divide by the world size; E < world size leaves some
ranks without experts). Each iteration: the router's top-k pairs go to their expert's owner through one
uneven all-to-all, the owner runs the expert on what it received, and the outputs return for the weighted
combine. Dropless, full autograd, world size 1 without communication.

Gradient scaling: dense parameters are averaged over ranks by DDP. An expert's gradient already sums the
contributions of every rank's tokens, so it is divided by the world size to equal the gradient of the
global-batch mean loss that single-process training computes.

Shape suffixes: T tokens, K top-k, H d_model, E experts, N rows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from themis_compile.planner.placement import Placement
from themis_compile.runtime.exchange import dispatch_compute_combine
from themis_compile.runtime.experts import ExpertBank

logger = logging.getLogger(__name__)


class ShardedExperts(nn.Module):
    """Stands in for a layer's experts module: ``(x_TH, ids_TK, weights_TK) -> out_TH``.

    Holds only the experts this rank owns, as ``self.shards[str(e)]`` (global expert ids), so that an
    optimizer built from ``model.parameters()`` sees exactly the owned experts.
    """

    def __init__(
        self,
        bank: ExpertBank,
        experts: nn.Module,
        shard: Placement,
        *,
        rank: int,
        world_size: int,
        group=None,
        layer: str = "",
        scale_grads: bool = True,
        uniform_routing: bool = False,
    ) -> None:
        super().__init__()
        self.uniform_routing = uniform_routing
        if shard.num_devices != world_size or not shard.is_shard_placement():
            raise ValueError(f"MoE layer {layer!r}: not a shard placement over {world_size} ranks")
        self.bank = bank
        self.layer = layer
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.num_experts = bank.num_experts
        self.shard_placement = shard
        self.shards = nn.ModuleDict({str(e): bank.shard_of(experts, int(e)) for e in shard.experts_on(rank)})
        self.register_buffer("owner_E", torch.tensor(shard.owners().tolist(), dtype=torch.int64), persistent=False)
        if world_size > 1 and scale_grads:
            scale = 1.0 / world_size
            for p in self.shards.parameters():
                p.register_hook(lambda g: g * scale)

    def set_shard_placement(self, shard: Placement) -> None:
        """Adopt a new shard placement after re-sharding moved the experts (``self.shards`` updated)."""
        if sorted(int(e) for e in self.shards.keys()) != [int(e) for e in shard.experts_on(self.rank)]:
            raise RuntimeError(f"MoE layer {self.layer!r}: held experts do not match the new shard placement")
        self.shard_placement = shard
        self.owner_E.copy_(torch.tensor(shard.owners().tolist(), dtype=torch.int64))

    def owned_experts(self) -> list[int]:
        return [int(e) for e in self.shards.keys()]

    def local_chunks(self) -> dict[int, list[torch.Tensor]]:
        """Owned experts' parameters, by global expert id (ascending)."""
        return {int(e): list(self.shards[e].parameters()) for e in sorted(self.shards.keys(), key=int)}

    def _routing_error(self, ids_TK: torch.Tensor) -> bool:
        return bool(ids_TK.numel()) and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= self.num_experts)

    def _check_routing(self, ids_TK: torch.Tensor) -> None:
        # Agreed across ranks before any token moves, so that a bad router on one rank fails every rank
        # instead of leaving the others waiting in the all-to-all.
        bad = torch.tensor([int(self._routing_error(ids_TK))], dtype=torch.int64, device=ids_TK.device)
        if self.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item():
            raise ValueError(f"MoE layer {self.layer!r}: a router chose an expert id outside "
                             f"[0, {self.num_experts})")

    def run_experts(self, chunks: dict[int, Sequence[torch.Tensor]], rows_NH: torch.Tensor,
                    counts_E: Sequence[int]) -> torch.Tensor:
        """Run every expert with rows, or held here, on its rows (grouped by expert, expert order).

        Held experts with zero rows still run on an empty input so that their gradient is zero, not
        missing — the same as the unsharded model, where every expert runs every step.
        """
        outputs = []
        for e, part in enumerate(torch.split(rows_NH, list(counts_E))):
            params = chunks.get(e)
            if params is None:
                if counts_E[e]:
                    raise RuntimeError(f"MoE layer {self.layer!r}: {counts_E[e]} rows of expert {e} arrived on "
                                       f"rank {self.rank}, which does not hold it")
                continue
            outputs.append(self.bank.run(params, part))
        if not outputs:
            # No expert here (and so no rows): an empty result that stays in the autograd graph, so that
            # this rank joins the all-to-all of the backward pass like every other rank.
            if rows_NH.requires_grad:
                return rows_NH * 0
            return rows_NH.new_zeros(rows_NH.shape).requires_grad_(torch.is_grad_enabled())
        return torch.cat(outputs, 0)

    def destinations(self, ids_TK: torch.Tensor) -> torch.Tensor:
        return self.owner_E[ids_TK]

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        with record_function("themis::check_routing"):
            self._check_routing(ids_TK)
        if self.uniform_routing:
            # The paper's "Uniform" reference gate (benchmarking only: it changes the model on purpose).
            from themis_compile.api import uniform_ids

            ids_TK = uniform_ids(ids_TK, self.num_experts)
        chunks = self.local_chunks()
        return dispatch_compute_combine(
            x_TH, ids_TK, weights_TK, self.destinations(ids_TK), self.num_experts,
            lambda rows, counts: self.run_experts(chunks, rows, counts),
            group=self.group, world_size=self.world_size,
        )
