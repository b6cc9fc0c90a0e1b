"""Alg. 3 topology-aware token dispatching (§4.4).

Input: the materialized placement P' and the gate's token counts T[e, d] (tokens on device d routed to
expert e). Output: the integer plan R[e, d, d2], the tokens device d sends to expert e's copy on d2.

Pseudo-code (Alg. 3)::

    1  R ← 0
    2  for e in E:
    3      D^e ← devices holding e in P'
    4      for d in D^e:
    5          R[e, d, d] ← T[e, d]                         # local: no communication
    6      for d in D \\ D^e:
    7          D^local ← devices on d's node
    8          D^elocal ← D^e ∩ D^local
    9          if D^elocal ≠ ∅:
    10             R[e, d, :] ← evenly dispatch T[e, d] to D^elocal   # intra-node
    11         else:
    12             R[e, d, :] ← evenly dispatch T[e, d] to D^e        # inter-node
    13 return R

Even split with a deterministic remainder: with k targets listed by ascending device id and
``q, r = divmod(T[e, d], k)``, the target at position j (0-based) receives ``q + 1`` when
``(j - (e + d)) mod k < r`` and ``q`` otherwise. The offset ``e + d`` rotates the remainder over
sources and experts so that no holder is systematically favoured. Hence Σ_d2 R[e, d, d2] = T[e, d]
exactly, and only holders of e receive tokens.

The implementation is vectorized: experts with a single holder (all but at most t of them) are one
scatter; only replicated experts go through the split.

Legend: E experts, D devices (d source, d2 destination), N nodes, X replicated experts.
"""

from __future__ import annotations

import logging

import numpy as np

from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["topology_aware_dispatch", "even_dispatch", "check_tokens"]


def check_tokens(tokens_ED: np.ndarray, num_experts: int, num_devices: int) -> np.ndarray:
    """Return the token counts as int64 [E, D]; ValueError for a wrong shape, fractions or negatives."""
    arr = np.asarray(tokens_ED)
    if arr.shape != (num_experts, num_devices):
        raise ValueError(f"tokens must have shape [E, D] = [{num_experts}, {num_devices}], got {arr.shape}")
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.floor(arr)).any():
            raise ValueError("tokens must be whole numbers")
    elif arr.dtype.kind not in "iub":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    tokens_ED = arr.astype(np.int64, copy=False)
    if (tokens_ED < 0).any():
        raise ValueError("tokens contain negative counts")
    return tokens_ED


def _split_evenly(targets_XDD: np.ndarray, tokens_XD: np.ndarray, experts_X: np.ndarray) -> np.ndarray:
    """Split tokens_XD[x, d] evenly over the True entries of targets_XDD[x, d, :] with the module's
    remainder rule; returns int64 [X, D, D]."""
    k_XD = targets_XDD.sum(axis=2, dtype=np.int64)
    k_safe_XD = np.maximum(k_XD, 1)
    q_XD, r_XD = np.divmod(tokens_XD, k_safe_XD)
    pos_XDD = np.cumsum(targets_XDD, axis=2, dtype=np.int64) - 1   # position j among the targets
    D = tokens_XD.shape[1]
    offset_XD = (experts_X[:, None] + np.arange(D, dtype=np.int64)[None, :]) % k_safe_XD
    extra_XDD = ((pos_XDD - offset_XD[:, :, None]) % k_safe_XD[:, :, None]) < r_XD[:, :, None]
    return (q_XD[:, :, None] + extra_XDD) * targets_XDD


def topology_aware_dispatch(placement: Placement, tokens_ED: np.ndarray, topology: Topology) -> np.ndarray:
    """Alg. 3: the dispatch plan R[e, d, d2] (int64) for placement P' and gate counts T[e, d].

    Guarantees Σ_d2 R[e, d, d2] == T[e, d]; R[e, d, d2] > 0 only where d2 holds e; a source holding e
    keeps all its tokens for e (local first); otherwise tokens stay on the source's node when a holder
    is there. ValueError when an expert with tokens has no holder or shapes do not match.
    """
    E, D = placement.shape
    topology.validate(D)
    tokens_ED = check_tokens(tokens_ED, E, D)
    mask_ED = placement.mask
    copies_E = mask_ED.sum(axis=1)
    if (copies_E == 0).any():
        orphan = np.flatnonzero(copies_E == 0)
        if tokens_ED[orphan].any():
            raise ValueError(f"expert {int(orphan[tokens_ED[orphan].any(axis=1)][0])} has tokens but no holder")
    R_EDD = np.zeros((E, D, D), dtype=np.int64)
    # Experts with one holder: every token goes to it (l.5 for the holder, l.12 for everyone else).
    single_S = np.flatnonzero(copies_E == 1)
    if single_S.size:
        owner_S = np.argmax(mask_ED[single_S], axis=1)
        R_EDD[single_S[:, None], np.arange(D)[None, :], owner_S[:, None]] = tokens_ED[single_S]
    # Replicated experts: l.4-12 vectorized over [X, D (source), D (destination)].
    rep_X = np.flatnonzero(copies_E > 1)
    if rep_X.size:
        holds_XD = mask_ED[rep_X]
        same_DD = topology.same_node
        local_XDD = holds_XD[:, None, :] & same_DD[None, :, :]                 # l.7-8: D^elocal
        has_local_XD = local_XDD.any(axis=2)
        targets_XDD = np.where(has_local_XD[:, :, None], local_XDD, holds_XD[:, None, :])  # l.9-12
        # l.4-5: a source that holds e sends only to itself.
        eye_DD = np.eye(D, dtype=bool)
        targets_XDD = np.where(holds_XD[:, :, None], eye_DD[None, :, :], targets_XDD)
        R_EDD[rep_X] = _split_evenly(targets_XDD, tokens_ED[rep_X], rep_X.astype(np.int64))
    return R_EDD


def even_dispatch(placement: Placement, tokens_ED: np.ndarray) -> np.ndarray:
    """Topology-unaware dispatch used by baselines: a source holding e keeps its tokens, every other
    source splits evenly over all holders of e (same remainder rule as Alg. 3)."""
    return topology_aware_dispatch(placement, tokens_ED, Topology.single_node(placement.num_devices))
