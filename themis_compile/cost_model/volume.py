"""Communication volume and lower-bound time of the sparse collectives (§3.3).

Everything here is a function of the shard placement P, the ephemeral placement P' ⊇ P, the chunk size
Ψ (bytes of one expert's parameters, or of its gradient) and the topology alone — no process group, no
plan. ``runtime/collectives.py`` records what it actually moves and its tests assert that the two agree.

The quantities (§3.3):

- SpAG(P, P') delivers one whole chunk per pair of ΔP = P' \\ P, so device d *receives* exactly
  ``|ΔP_d|·Ψ`` bytes and the collective moves ``|ΔP|·Ψ`` bytes in total (Eq. 4). Which devices *send* is a
  choice of the realization; the owner of a replicated chunk must send it at least once, so it sends at
  least ``Ψ`` per owned chunk that has an added replica.
- SpRS(P', P) mirrors it: device d *sends* exactly ``|ΔP_d|·Ψ`` (one gradient chunk leaves every added
  replica, possibly as a partial sum), ``|ΔP|·Ψ`` in total, and an owner receives at least ``Ψ`` per owned
  replicated chunk.
- Inter-node bytes: a well-routed transfer enters every node the chunk newly reaches exactly once and
  fans out inside the node, so ``Ψ`` per newly reached (chunk, node) pair; gradients are combined per node
  and one partial sum leaves each such node. A node's ingress (SpAG) / egress (SpRS) is ``Ψ`` per chunk
  that newly reaches it; the owner's node sends (SpAG) / receives (SpRS) at least ``Ψ`` per owned chunk
  that reaches another node.
- Lower-bound time: no realization finishes before its bottleneck device or node link does:
  ``max(max_d vol_d / bw_device, max_n vol_n / bw_inter)``, where ``vol_d`` is the larger of the device's
  fixed side and its minimum other side, and ``vol_n`` the larger of a node's ingress and its minimum egress.

Legend: E experts, D devices, N nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from themis_compile.planner.cost import bottleneck_time
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = [
    "SPAG",
    "SPRS",
    "CollectiveVolume",
    "chunk_bytes",
    "sparse_all_gather_volume",
    "sparse_reduce_scatter_volume",
    "lower_bound_time",
]

SPAG = "SparseAllGather"
SPRS = "SparseReduceScatter"


@dataclass(frozen=True)
class CollectiveVolume:
    """Bytes one sparse collective must move (§3.3), per device and per node.

    For SpAG ``recv_bytes_D`` is fixed by the placement and ``min_send_bytes_D`` is a lower bound on what a
    realization sends; for SpRS it is the other way round (``send_bytes_D`` fixed, ``min_recv_bytes_D`` a
    bound). The fixed side is exposed under both names through :attr:`fixed_bytes_D`.

    Attributes:
        collective: ``"SparseAllGather"`` or ``"SparseReduceScatter"``.
        total_bytes: ``|ΔP|·Ψ`` (Eq. 4), sent and received alike.
        recv_bytes_D: [D] bytes each device receives (SpAG: exact; SpRS: lower bound).
        send_bytes_D: [D] bytes each device sends (SpRS: exact; SpAG: lower bound).
        inter_node_bytes: bytes crossing node boundaries: Ψ per newly reached (chunk, node) pair.
        node_ingress_bytes_N: [N] bytes entering each node (SpAG: exact; SpRS: lower bound).
        node_egress_bytes_N: [N] bytes leaving each node (SpRS: exact; SpAG: lower bound).
    """

    collective: str
    total_bytes: int
    recv_bytes_D: tuple[int, ...]
    send_bytes_D: tuple[int, ...]
    inter_node_bytes: int
    node_ingress_bytes_N: tuple[int, ...]
    node_egress_bytes_N: tuple[int, ...]

    @property
    def fixed_bytes_D(self) -> tuple[int, ...]:
        """The per-device side the placement fixes: received bytes in SpAG, sent bytes in SpRS."""
        return self.recv_bytes_D if self.collective == SPAG else self.send_bytes_D

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly view."""
        return {
            "collective": self.collective,
            "total_bytes": self.total_bytes,
            "recv_bytes_D": list(self.recv_bytes_D),
            "send_bytes_D": list(self.send_bytes_D),
            "inter_node_bytes": self.inter_node_bytes,
            "node_ingress_bytes_N": list(self.node_ingress_bytes_N),
            "node_egress_bytes_N": list(self.node_egress_bytes_N),
        }


def chunk_bytes(spec: Sequence[tuple[Sequence[int], Any]]) -> int:
    """Ψ of one expert: the byte size of its parameter list, given as ``[(shape, dtype), ...]``.

    ``dtype`` may be a ``torch.dtype`` or anything ``numpy.dtype`` accepts.
    """
    total = 0
    for shape, dtype in spec:
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:                              # a torch.dtype
            itemsize = dtype.itemsize
        total += int(np.prod(tuple(shape), dtype=np.int64)) * int(itemsize)
    return total


def _psi_E(psi: int | Sequence[int] | np.ndarray, num_experts: int) -> np.ndarray:
    psi_E = np.asarray(psi, dtype=np.int64)
    if psi_E.ndim == 0:
        psi_E = np.full(num_experts, int(psi_E), dtype=np.int64)
    if psi_E.shape != (num_experts,):
        raise ValueError(f"psi must be a scalar or one byte size per expert ({num_experts}), got shape "
                         f"{psi_E.shape}")
    if (psi_E < 0).any():
        raise ValueError(f"psi must be >= 0 bytes, got {psi_E.tolist()}")
    return psi_E


def _checked(shard: Placement, placement: Placement, topology: Topology) -> None:
    shard.require_shard_placement("the shard placement P")
    if not shard.issubset(placement):
        raise ValueError("the ephemeral placement P' must contain the shard placement P (P ⊆ P')")
    topology.validate(shard.num_devices)


def _volumes(shard: Placement, placement: Placement, psi: int | Sequence[int] | np.ndarray,
             topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(fixed_D, min_other_D, entering_N, min_leaving_N, inter) for SpAG; SpRS swaps directions."""
    _checked(shard, placement, topology)
    E, D = shard.shape
    psi_E = _psi_E(psi, E)
    delta_ED = placement.mask & ~shard.mask
    fixed_D = (delta_ED * psi_E[:, None]).sum(axis=0).astype(np.int64)        # |ΔP_d|·Ψ
    owners_E = shard.owners() if E else np.zeros(0, dtype=np.int64)
    replicated_E = delta_ED.any(axis=1)
    min_other_D = np.zeros(D, dtype=np.int64)
    np.add.at(min_other_D, owners_E[replicated_E], psi_E[replicated_E])        # Ψ per owned replicated chunk
    new_EN = placement.new_node_entries(shard, topology)                       # [E, N]
    entering_N = (new_EN * psi_E[:, None]).sum(axis=0).astype(np.int64)
    reaches_other_E = new_EN.any(axis=1)
    min_leaving_N = np.zeros(topology.num_nodes, dtype=np.int64)
    np.add.at(min_leaving_N, topology.node_ids[owners_E[reaches_other_E]], psi_E[reaches_other_E])
    inter = int(entering_N.sum())
    return fixed_D, min_other_D, entering_N, min_leaving_N, inter


def _tup(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def sparse_all_gather_volume(shard: Placement, placement: Placement, psi: int | Sequence[int] | np.ndarray,
                             topology: Topology) -> CollectiveVolume:
    """The §3.3 volume of SpAG(P=shard, P'=placement) with chunks of ``psi`` bytes (scalar or [E])."""
    fixed_D, min_other_D, entering_N, min_leaving_N, inter = _volumes(shard, placement, psi, topology)
    return CollectiveVolume(SPAG, int(fixed_D.sum()), _tup(fixed_D), _tup(min_other_D), inter,
                            _tup(entering_N), _tup(min_leaving_N))


def sparse_reduce_scatter_volume(placement: Placement, shard: Placement,
                                 psi: int | Sequence[int] | np.ndarray, topology: Topology) -> CollectiveVolume:
    """The §3.3 volume of SpRS(P'=placement, P=shard): the mirror image of SpAG(P, P')."""
    fixed_D, min_other_D, entering_N, min_leaving_N, inter = _volumes(shard, placement, psi, topology)
    return CollectiveVolume(SPRS, int(fixed_D.sum()), _tup(min_other_D), _tup(fixed_D), inter,
                            _tup(min_leaving_N), _tup(entering_N))


def lower_bound_time(shard: Placement, placement: Placement, psi: int | Sequence[int] | np.ndarray,
                     topology: Topology, *, device_bw: float | None = None,
                     inter_node_bw: float | None = None) -> float:
    """Seconds no realization of SpAG(P, P') (or SpRS(P', P), the same by symmetry) can beat (§3.3).

    ``max(max_d vol_d / device_bw, max_n vol_n / inter_node_bw)`` where ``vol_d`` is the larger of device
    d's fixed side (|ΔP_d|·Ψ) and its minimum other side (Ψ per owned replicated chunk), and ``vol_n`` the
    larger of node n's ingress (Ψ per chunk newly reaching n) and minimum egress (on one node both are
    zero). Bandwidths (bytes/s) default to the topology's.

    The time formula is the planner's `bottleneck_time`; this bound adds the owners' side to the
    receiving side that `planner.cost.sparse_transfer_time` (what calibration weighs and the simulator
    charges) counts, so it is never below that one. Measured collectives are rated against it.
    """
    vol = sparse_all_gather_volume(shard, placement, psi, topology)
    device_D = np.maximum(vol.recv_bytes_D, vol.send_bytes_D)
    node_N = np.maximum(vol.node_ingress_bytes_N, vol.node_egress_bytes_N)
    return bottleneck_time(device_D, node_N, topology, device_bw=device_bw, inter_node_bw=inter_node_bw)
