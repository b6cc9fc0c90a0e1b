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
scatter; only replicated experts go through the split. Besides the full plan, `dispatch_rows` gives the
rows R[:, d, :] of chosen sources (what one rank needs to route its own tokens) and
`dispatch_device_load` the tokens every device computes, both without building the [E, D, D] plan.

Sparse totals (`dispatch_traffic`, `dispatch_expert_load`; what the simulator charges at any size): the
[E, D, D] plan is O(E·D²) — 32 GiB at 1,024 devices with 4 experts each — but its nonzero entries are
few and regular, so the totals a cost model needs come straight from T and P' in O(E·D) time and memory:

* an expert with one holder o sends every source's tokens to o: a source's traffic is one [E, D]
  reduction, and the tokens o receives from its own node are T[e, :] summed over o's node (a gather of
  E × devices-per-node entries);
* for a replicated expert, the sources that share a target list (l.10 or l.12) and a link node form a
  group; the targets of a list are a contiguous run of the expert's ascending holders, the targets on
  one node a contiguous run inside it, and a source's remainder tokens a cyclic interval of the list
  (positions ``(e + d) mod k, ..., (e + d + r - 1) mod k``). So what each target receives is the
  group's Σ q plus how many intervals cover it (a difference array, then a cumulative sum), and what a
  source sends to its own node is ``q·a`` plus the overlap of its interval with the node's run: O(1)
  per source and O(k) per group, no [X, D, D] array.

Both are bit-identical to totals of `topology_aware_dispatch`'s plan (integers throughout;
tests/planner/test_dispatch.py checks them against `DispatchTraffic.from_plan` of the dense plan and of
`planner.reference`'s).

Backends: when the compiled core ``themis_compile.planner._cplan`` is in use (`planner/backend.py`
chooses), the three functions fill their numpy output through it, bit-identical to the numpy code kept
here; both are checked against the readable reference `planner.reference.topology_aware_dispatch`.

Legend: E experts, D devices (d source, d2 destination), N nodes, X replicated experts, S planned
sources, U the nodes of the planned sources; in the sparse totals H the (replicated expert, holder)
pairs, S their sending (expert, source) pairs, G groups of sources, Y the target slots of the groups,
J the devices of a node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import numpy as np

from themis_compile.planner.backend import compiled_core, planner_backend
from themis_compile.planner.placement import Placement
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["topology_aware_dispatch", "dispatch_rows", "dispatch_device_load", "even_dispatch", "check_tokens",
           "own_row_entries", "DispatchTraffic", "dispatch_traffic", "dispatch_expert_load",
           "planner_backend"]


def _c_tokens(tokens_ED: object, placement: Placement, topology: Topology) -> np.ndarray:
    """``tokens_ED`` as the compiled core reads it: an int64 [E, D] array, any strides (the core checks
    signs and orphans itself); anything else goes through `check_tokens` first."""
    if type(tokens_ED) is np.ndarray and tokens_ED.dtype == np.int64 and tokens_ED.shape == placement.mask.shape:
        return tokens_ED
    return _checked(placement, tokens_ED, topology)[0]


def _run_core(core_fn, placement: Placement, tokens_ED: object, topology: Topology, *args: object,
              out: np.ndarray) -> np.ndarray:
    """Run an Alg. 3 entry point of the compiled core, which writes ``out`` entirely; inputs it rejects
    get the numpy path's precise ValueError."""
    tokens_C = _c_tokens(tokens_ED, placement, topology)
    if core_fn(topology.core_layout, placement.mask, tokens_C, *args, out) == 0:
        return out
    _checked(placement, tokens_ED, topology)            # raises the precise ValueError
    raise AssertionError("compiled Alg. 3 rejected inputs that pass validation")


def check_tokens(tokens_ED: np.ndarray, num_experts: int, num_devices: int) -> np.ndarray:
    """Return the token counts as int64 [E, D]; ValueError for a wrong shape, fractions or negatives."""
    arr = np.asarray(tokens_ED)
    if arr.shape != (num_experts, num_devices):
        raise ValueError(f"tokens must have shape [E, D] = [{num_experts}, {num_devices}], got {arr.shape}")
    if arr.dtype == np.int64:   # the common case: one reduction
        if arr.size and arr.min() < 0:
            raise ValueError("tokens contain negative counts")
        return arr
    if arr.dtype.kind == "f":
        if not np.isfinite(arr).all() or (arr != np.floor(arr)).any():
            raise ValueError("tokens must be whole numbers")
    elif arr.dtype.kind not in "iub":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    tokens_ED = arr.astype(np.int64, copy=False)
    if (tokens_ED < 0).any():
        raise ValueError("tokens contain negative counts")
    return tokens_ED


_FLAT_BASE_CACHE: dict[tuple, np.ndarray] = {}    # index tables per shape (small, bounded below)


def _flat_base(num_experts: int, num_devices: int) -> np.ndarray:
    """[E, D] int64 flat offsets ``e·D·D + d·D`` of the rows R[e, d, :] (cached per shape, read-only)."""
    key = (num_experts, num_devices)
    base_ED = _FLAT_BASE_CACHE.get(key)
    if base_ED is None:
        D = num_devices
        base_ED = (np.arange(num_experts, dtype=np.int64)[:, None] * (D * D)
                   + np.arange(D, dtype=np.int64)[None, :] * D)
        base_ED.setflags(write=False)
        if len(_FLAT_BASE_CACHE) > 64:
            _FLAT_BASE_CACHE.clear()
        _FLAT_BASE_CACHE[key] = base_ED
    return base_ED


def _expert_plus_source(experts_X: np.ndarray, num_devices: int) -> np.ndarray:
    """[X, D] int64 ``e + d`` (the remainder rotation before the modulo) from a cached [E, D] table."""
    E = int(experts_X.max()) + 1
    table_ED = _FLAT_BASE_CACHE.get(("e+d", num_devices))
    if table_ED is None or table_ED.shape[0] < E:
        rows = max(E, 256)
        table_ED = np.arange(rows, dtype=np.int64)[:, None] + np.arange(num_devices, dtype=np.int64)
        table_ED.setflags(write=False)
        _FLAT_BASE_CACHE[("e+d", num_devices)] = table_ED
    return table_ED[experts_X]


def _split_replicated(holds_XD: np.ndarray, tokens_XD: np.ndarray, experts_X: np.ndarray,
                      copies_X: np.ndarray, topology: Topology,
                      sources_S: np.ndarray | None = None) -> np.ndarray:
    """Alg. 3 l.6-12 for experts with several holders: [X, S (source), D (destination)] token counts of
    the sources that do not hold the expert (rows of holders are zero: the caller writes R[e, d, d]).
    ``sources_S``: the source devices to plan (all D when None). The integer dtype is the narrowest that
    holds the counts; the caller stores them into its int64 array.

    A source's targets depend only on its node (l.7-12), so target sets and target positions are built
    per (expert, node of a planned source) — [X, U, D] — and gathered per source (``node_S`` then
    indexes those U nodes). The remainder rule ``(j - (e + d)) mod k < r`` is evaluated without an
    integer modulo: with ``u = j - offset`` in (-k, k), ``u mod k`` is ``min(u, u + k)`` in unsigned
    arithmetic (a negative u wraps to a huge value). Non-targets get a position far out of range, so no
    remainder lands there.
    """
    D = holds_XD.shape[1]
    upos = np.uint16 if 4 * D < 2 ** 16 else np.uint64
    if sources_S is None:
        nodes_U, node_S = np.arange(topology.num_nodes), topology.node_ids   # every node, every source
        e_plus_d_XS = _expert_plus_source(experts_X, D)
    else:   # only the nodes of the requested sources
        node_S = topology.node_ids[sources_S]
        nodes_U, node_S = (node_S, np.zeros(1, dtype=np.int64)) if node_S.size == 1 else \
            np.unique(node_S, return_inverse=True)
        e_plus_d_XS = experts_X[:, None] + sources_S
    holders_XU = np.add.reduceat(holds_XD, topology.node_offsets[:-1], axis=1, dtype=np.int64)[:, nodes_U]
    has_local_XU = holders_XU > 0                                          # l.8-9: D^elocal ≠ ∅
    local_XUD = holds_XD[:, None, :] & topology.same_node[topology.node_offsets[nodes_U]][None, :, :]
    targets_XUD = np.where(has_local_XU[:, :, None], local_XUD, holds_XD[:, None, :])   # l.10 / l.12
    k_XU = np.where(has_local_XU, holders_XU, copies_X[:, None])
    # j + 1 at targets (position among the source's targets, ascending device id); far off elsewhere.
    pos_XUD = np.where(targets_XUD, np.cumsum(targets_XUD, axis=2), 4 * D).astype(upos)
    if sources_S is not None:
        holds_XD, tokens_XD = holds_XD[:, sources_S], tokens_XD[:, sources_S]
    k_XS = k_XU[:, node_S]
    q_XS, r_XS = np.divmod(np.where(holds_XD, 0, tokens_XD), k_XS)
    offset1_XS = (e_plus_d_XS % k_XS + 1).astype(upos)                      # offset + 1
    u_XSD = pos_XUD[:, node_S]
    u_XSD -= offset1_XS[:, :, None]                                        # u = j - offset (wrapping)
    extra_XSD = np.minimum(u_XSD, u_XSD + k_XS.astype(upos)[:, :, None]) < r_XS.astype(upos)[:, :, None]
    qmax = int(q_XS.max(initial=0))
    qtype = np.int16 if qmax < 2 ** 15 - 1 else np.int32 if qmax < 2 ** 31 - 1 else np.int64
    R_XSD = q_XS.astype(qtype)[:, :, None] * targets_XUD[:, node_S]
    R_XSD += extra_XSD
    return R_XSD


def _checked(placement: Placement, tokens_ED: np.ndarray, topology: Topology,
             tokens_checked: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Validate the inputs of Alg. 3; returns (int64 tokens [E, D], holder counts [E]). ``tokens_checked``:
    ``tokens_ED`` is already `check_tokens`' result for this shape (only the orphans are checked)."""
    E, D = placement.shape
    topology.validate(D)
    if not (tokens_checked and type(tokens_ED) is np.ndarray and tokens_ED.dtype == np.int64
            and tokens_ED.shape == (E, D)):
        tokens_ED = check_tokens(tokens_ED, E, D)
    copies_E = placement.copy_counts()
    if E and copies_E.min() == 0:
        orphan = np.flatnonzero(copies_E == 0)
        if tokens_ED[orphan].any():
            raise ValueError(f"expert {int(orphan[tokens_ED[orphan].any(axis=1)][0])} has tokens but no holder")
    return tokens_ED, copies_E


def topology_aware_dispatch(placement: Placement, tokens_ED: np.ndarray, topology: Topology) -> np.ndarray:
    """Alg. 3: the dispatch plan R[e, d, d2] (int64) for placement P' and gate counts T[e, d].

    Guarantees Σ_d2 R[e, d, d2] == T[e, d]; R[e, d, d2] > 0 only where d2 holds e; a source holding e
    keeps all its tokens for e (local first); otherwise tokens stay on the source's node when a holder
    is there. ValueError when an expert with tokens has no holder or shapes do not match.
    """
    core = compiled_core()
    if core is not None:
        E, D = placement.shape
        return _run_core(core.dispatch, placement, tokens_ED, topology, E, out=np.empty((E, D, D), dtype=np.int64))
    tokens_ED, copies_E = _checked(placement, tokens_ED, topology)
    E, D = placement.shape
    mask_ED = placement.mask
    R_EDD = np.zeros((E, D, D), dtype=np.int64)
    # Experts with one holder: every token goes to it (l.5 for the holder, l.12 for everyone else).
    # Written for every expert at once; the rows of replicated experts are overwritten below (and an
    # expert without holders has no tokens).
    if E:
        R_EDD.reshape(-1)[_flat_base(E, D) + np.argmax(mask_ED, axis=1)[:, None]] = tokens_ED
    # Replicated experts: l.4-12 vectorized over [X, D (source), D (destination)].
    rep_X = np.flatnonzero(copies_E > 1)
    if rep_X.size:
        holds_XD = mask_ED[rep_X]
        tokens_XD = tokens_ED[rep_X]
        R_EDD[rep_X] = _split_replicated(holds_XD, tokens_XD, rep_X, copies_E[rep_X], topology)
        # l.4-5: a source that holds e keeps all its tokens (R[e, d, d]).
        hx_H, hd_H = np.nonzero(holds_XD)
        R_EDD.reshape(-1)[_flat_base(E, D)[rep_X[hx_H], hd_H] + hd_H] = tokens_XD[hx_H, hd_H]
    return R_EDD


def _check_sources(sources: int | np.ndarray, num_devices: int) -> np.ndarray:
    """``sources`` as a contiguous int64 [S]; ValueError unless every entry is a device id."""
    sources_S = np.ascontiguousarray(np.atleast_1d(np.asarray(sources, dtype=np.int64)))
    if sources_S.ndim != 1 or (sources_S.size and (sources_S.min() < 0 or sources_S.max() >= num_devices)):
        raise ValueError(f"sources must be device ids in [0, {num_devices}), got {sources!r}")
    return sources_S


def dispatch_rows(placement: Placement, tokens_ED: np.ndarray, topology: Topology,
                  sources: int | np.ndarray) -> np.ndarray:
    """Rows of the Alg. 3 plan for some source devices: ``R[:, sources, :]`` as int64 [E, S, D]
    (``sources`` an int gives [E, D]), bit-identical to slicing `topology_aware_dispatch`'s plan.

    What one rank needs to route its own tokens (R[:, rank, :]) at a fraction of the cost of the full
    [E, D, D] plan: only the requested sources are split.
    """
    core = compiled_core()
    if core is not None:
        E, D = placement.shape
        if type(sources) is int and 0 <= sources < D:      # one rank's own row: the runtime's call
            src, R_out = sources, np.empty((E, D), dtype=np.int64)   # written entirely
        else:
            try:
                src = _check_sources(sources, D)
            except ValueError:
                _checked(placement, tokens_ED, topology)    # bad tokens are reported first, as below
                raise
            R_out = np.empty((E, src.size, D), dtype=np.int64)
        R_out = _run_core(core.dispatch_rows, placement, tokens_ED, topology, E, src, out=R_out)
        return R_out[:, 0, :] if R_out.ndim == 3 and np.ndim(sources) == 0 else R_out
    tokens_ED, copies_E = _checked(placement, tokens_ED, topology)
    E, D = placement.shape
    sources_S = _check_sources(sources, D)
    S = sources_S.size
    mask_ED = placement.mask
    R_ESD = np.zeros((E, S, D), dtype=np.int64)
    if E and S:
        base_ES = (np.arange(E, dtype=np.int64)[:, None] * (S * D) + np.arange(S, dtype=np.int64) * D)
        R_ESD.reshape(-1)[base_ES + np.argmax(mask_ED, axis=1)[:, None]] = tokens_ED[:, sources_S]
        rep_X = np.flatnonzero(copies_E > 1)
        if rep_X.size:
            holds_XD = mask_ED[rep_X]
            tokens_XD = tokens_ED[rep_X]
            R_ESD[rep_X] = _split_replicated(holds_XD, tokens_XD, rep_X, copies_E[rep_X], topology, sources_S)
            hx_H, hs_H = np.nonzero(holds_XD[:, sources_S])
            R_ESD[rep_X[hx_H], hs_H, sources_S[hs_H]] = tokens_XD[hx_H, sources_S[hs_H]]
    return R_ESD[:, 0, :] if np.ndim(sources) == 0 else R_ESD


def dispatch_device_load(placement: Placement, tokens_ED: np.ndarray, topology: Topology) -> np.ndarray:
    """[D] int64 tokens each device computes under the Alg. 3 plan, i.e.
    ``cost.device_compute_load(topology_aware_dispatch(...))``, without building the [E, D, D] plan
    (numpy: `dispatch_traffic`'s ``load_D``)."""
    core = compiled_core()
    if core is not None:
        return _run_core(core.dispatch_device_load, placement, tokens_ED, topology, placement.num_experts,
                         out=np.empty(placement.num_devices, dtype=np.int64))
    # numpy: the sparse totals (no [X, D, D] split of the replicated experts).
    return dispatch_traffic(placement, tokens_ED, topology).load_D


def even_dispatch(placement: Placement, tokens_ED: np.ndarray) -> np.ndarray:
    """Topology-unaware dispatch used by baselines: a source holding e keeps its tokens, every other
    source splits evenly over all holders of e (same remainder rule as Alg. 3)."""
    return topology_aware_dispatch(placement, tokens_ED, Topology.single_node(placement.num_devices))


# =========================================================================================== sparse totals
@dataclass(frozen=True, eq=False)
class DispatchTraffic:
    """Token totals of an Alg. 3 plan per device, split by link (every field [D] int64):

    * ``load_D``: tokens each device computes, Σ_e Σ_d R[e, d, d2] (`cost.device_compute_load`);
    * ``kept_D``: tokens a device routes to itself, Σ_e R[e, d, d] (they do not move);
    * ``intra_out_D`` / ``intra_in_D``: tokens a device sends to / receives from the other devices of its
      node;
    * ``inter_out_D`` / ``inter_in_D``: tokens a device sends to / receives from devices on other nodes.

    Nodes are those of the topology the traffic is classified on (``links`` of `dispatch_traffic`).
    """

    load_D: np.ndarray
    kept_D: np.ndarray
    intra_out_D: np.ndarray
    intra_in_D: np.ndarray
    inter_out_D: np.ndarray
    inter_in_D: np.ndarray

    @classmethod
    def from_plan(cls, R_EDD: np.ndarray, links: Topology) -> DispatchTraffic:
        """The totals of a dense plan R[e, d, d2]: the definition `dispatch_traffic` is held to."""
        flow_DD = np.asarray(R_EDD).sum(axis=0, dtype=np.int64)
        load_D = flow_DD.sum(axis=0)
        kept_D = np.diagonal(flow_DD).copy()
        np.fill_diagonal(flow_DD, 0)
        intra_DD = np.where(links.same_node, flow_DD, 0)
        inter_DD = flow_DD - intra_DD
        return cls(load_D, kept_D, intra_DD.sum(axis=1), intra_DD.sum(axis=0), inter_DD.sum(axis=1),
                   inter_DD.sum(axis=0))

    def sent(self) -> int:
        """Tokens that leave their source device (the dispatch all-to-all; the combine mirrors it)."""
        return int(self.intra_out_D.sum()) + int(self.inter_out_D.sum())

    def inter_node_sent(self) -> int:
        """The part of `sent` that crosses nodes."""
        return int(self.inter_out_D.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DispatchTraffic):
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))


def _overlap(a: np.ndarray | int, b: np.ndarray, c: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Length of [a, b) ∩ [c, d), elementwise (0 when they do not meet)."""
    return np.maximum(np.minimum(b, d) - np.maximum(a, c), 0)


def _replicated_slots(holds_XD: np.ndarray, tokens_XD: np.ndarray, experts_X: np.ndarray, topology: Topology,
                      links: Topology) -> tuple[np.ndarray, ...]:
    """Alg. 3 l.6-12 for the experts ``experts_X`` (several holders each) in sparse form (see the module
    docstring): what every target receives and what every source sends, without the [X, D, D] plan.

    Returns ``(x_Y, dest_Y, recv_Y, intra_Y, src_S, intra_S, tokens_S)``: per target slot the expert's
    position in ``experts_X``, the holder, the tokens it receives from one group of sources and whether
    they come from its own node of ``links``; per sending (expert, source) pair the source, the tokens it
    sends to its own node of ``links`` and all the tokens it sends. Holders keep their own tokens (l.4-5)
    and appear in neither.
    """
    X, D = holds_XD.shape
    # Step 1: the holders, ascending: those of x are H[first_X[x] : first_X[x] + c_X[x]], and those on
    # plan node p the run of h_XP[x, p] from start_XP[x, p] (devices of a node are contiguous ids).
    hx_H, hd_H = np.nonzero(holds_XD)
    c_X = np.bincount(hx_H, minlength=X)
    first_X = np.cumsum(c_X) - c_X
    h_XP = np.add.reduceat(holds_XD, topology.node_offsets[:-1], axis=1, dtype=np.int64)
    start_XP = first_X[:, None] + np.cumsum(h_XP, axis=1) - h_XP
    # Step 2: the sending pairs (a source with tokens for x that it does not hold) and their target lists.
    sx_S, src_S = np.nonzero(~holds_XD & (tokens_XD > 0))
    tokens_S = tokens_XD[sx_S, src_S]
    p_S = topology.node_ids[src_S]
    h_S = h_XP[sx_S, p_S]
    local_S = h_S > 0                                                        # l.8-9: D^elocal ≠ ∅
    k_S = np.where(local_S, h_S, c_X[sx_S])                                  # l.10 / l.12
    list_S = np.where(local_S, start_XP[sx_S, p_S], first_X[sx_S])           # the list's first holder in H
    # The list's targets on the source's own link node: list positions [u0, u1).
    l_S = links.node_ids[src_S]
    key_H = hx_H * D + hd_H                                                   # ascending
    u0_S = np.clip(np.searchsorted(key_H, sx_S * D + links.node_offsets[l_S]) - list_S, 0, k_S)
    u1_S = np.clip(np.searchsorted(key_H, sx_S * D + links.node_offsets[l_S + 1]) - list_S, 0, k_S)
    # Step 3: the even split; list positions s .. s + r - 1 (mod k) get one token more, s = (e + d) mod k.
    q_S, r_S = np.divmod(tokens_S, k_S)
    s_S = (experts_X[sx_S] + src_S) % k_S
    end_S = s_S + r_S
    extra_S = _overlap(s_S, np.minimum(end_S, k_S), u0_S, u1_S) + _overlap(0, np.maximum(end_S - k_S, 0), u0_S, u1_S)
    intra_S = q_S * (u1_S - u0_S) + extra_S
    # Step 4: groups of sources with one target list and one own-node run receive alike.
    order_S = np.lexsort((u1_S, u0_S, k_S, list_S))
    new_S = np.ones(order_S.size, dtype=bool)
    for key_S in (list_S, k_S, u0_S, u1_S):
        new_S[1:] |= key_S[order_S][1:] != key_S[order_S][:-1]
    g_S = np.empty(order_S.size, dtype=np.int64)
    g_S[order_S] = np.cumsum(new_S) - 1
    head_G = order_S[new_S]
    list_G, k_G, u0_G, u1_G = list_S[head_G], k_S[head_G], u0_S[head_G], u1_S[head_G]
    # Step 5: every target of a group gets the group's Σ q, plus one per remainder interval that covers it
    # (a difference array over the group's k slots and a sentinel that closes the intervals).
    base_G = np.cumsum(k_G + 1) - (k_G + 1)
    n_slots = int((k_G + 1).sum())
    q_G = np.zeros(head_G.size, dtype=np.int64)
    np.add.at(q_G, g_S, q_S)
    rem = r_S > 0
    b_R, s_R, end_R, k_R = base_G[g_S[rem]], s_S[rem], end_S[rem], k_S[rem]
    wrap_R = end_R > k_R
    plus = np.concatenate((b_R + s_R, b_R[wrap_R]))
    minus = np.concatenate((b_R + np.minimum(end_R, k_R), b_R[wrap_R] + end_R[wrap_R] - k_R[wrap_R]))
    cover = np.cumsum(np.bincount(plus, minlength=n_slots) - np.bincount(minus, minlength=n_slots))
    g_Y = np.repeat(np.arange(head_G.size, dtype=np.int64), k_G)
    j_Y = np.arange(g_Y.size, dtype=np.int64) - np.repeat(base_G - np.arange(head_G.size), k_G)
    recv_Y = q_G[g_Y] + cover[base_G[g_Y] + j_Y]
    dest_Y = hd_H[list_G[g_Y] + j_Y]
    intra_Y = (u0_G[g_Y] <= j_Y) & (j_Y < u1_G[g_Y])
    return hx_H[list_G[g_Y]], dest_Y, recv_Y, intra_Y, src_S, intra_S, tokens_S


def _first_holders(placement: Placement) -> np.ndarray:
    """[E] the lowest device holding each expert (0 for an expert without holders), what
    ``argmax(mask, axis=1)`` gives: a shard placement's cached owners; otherwise the mask's rows read
    eight devices a word (the first nonzero word, then its first nonzero byte) where they allow it."""
    if placement.is_shard_placement():
        return placement.owners()
    mask_ED = placement.mask
    E, D = mask_ED.shape
    if D % 8 or not mask_ED.flags.c_contiguous:
        return np.argmax(mask_ED, axis=1)
    words_EW = mask_ED.view(np.uint64)
    w_E = np.argmax(words_EW != 0, axis=1)
    word_E = np.ascontiguousarray(words_EW[np.arange(E), w_E])
    return 8 * w_E + np.argmax(word_E.view(np.uint8).reshape(E, 8) != 0, axis=1)


def _single_holder_traffic(placement: Placement, tokens_ED: np.ndarray, copies_E: np.ndarray, links: Topology,
                           t: DispatchTraffic) -> None:
    """Add the experts with one holder to ``t``: every source's tokens go to the holder o (l.5, l.12)."""
    mask_ED = placement.mask
    D = mask_ED.shape[1]
    single_O = np.flatnonzero(copies_E == 1)
    if not single_O.size:
        return
    first_holders = _first_holders(placement)
    # Row reductions of the whole [E, D] arrays, then indexed: no [O, D] copy.
    owner_O = first_holders[single_O]
    total_O = tokens_ED.sum(axis=1)[single_O]
    # The tokens of o's own node: T[e, offset + j] for the J devices of that node ([O, J] gather).
    node_O = links.node_ids[owner_O]
    J = max(links.devices_per_node)
    cols_OJ = links.node_offsets[node_O][:, None] + np.arange(J)
    on_node_OJ = cols_OJ < links.node_offsets[node_O + 1][:, None]
    local_OJ = np.where(on_node_OJ, tokens_ED[single_O[:, None], np.minimum(cols_OJ, D - 1)], 0)
    local_O = local_OJ.sum(axis=1)
    kept_O = tokens_ED[single_O, owner_O]
    np.add.at(t.load_D, owner_O, total_O)
    np.add.at(t.kept_D, owner_O, kept_O)
    np.add.at(t.intra_in_D, owner_O, local_O - kept_O)
    np.add.at(t.inter_in_D, owner_O, total_O - local_O)
    # Sources: what each device sends to holders on its node (the gathered blocks' columns, less what it
    # keeps) and to the others (the rest of its column sum over these experts).
    to_node_D = np.zeros(D, dtype=np.int64)
    np.add.at(to_node_D, cols_OJ[on_node_OJ], local_OJ[on_node_OJ])
    kept_D = np.zeros(D, dtype=np.int64)
    np.add.at(kept_D, owner_O, kept_O)
    others = np.flatnonzero(copies_E != 1)
    if others.size < single_O.size:                       # copy the smaller set of rows
        column_D = tokens_ED.sum(axis=0) - (tokens_ED[others].sum(axis=0) if others.size else 0)
    else:
        column_D = tokens_ED[single_O].sum(axis=0)
    t.intra_out_D[:] += to_node_D - kept_D
    t.inter_out_D[:] += column_D - to_node_D


def dispatch_traffic(placement: Placement, tokens_ED: np.ndarray, topology: Topology,
                     links: Topology | None = None, *, tokens_checked: bool = False) -> DispatchTraffic:
    """The per-device totals of the Alg. 3 plan, ``DispatchTraffic.from_plan(topology_aware_dispatch(
    placement, tokens_ED, topology), links)``, bit for bit, in O(E·D) without the [E, D, D] plan (see
    the module docstring).

    ``links``: the topology whose nodes classify the traffic as intra- or inter-node (default
    ``topology``). `even_dispatch`'s plan is ``topology = Topology.single_node(D)`` on the cluster's links.
    ``tokens_checked``: ``tokens_ED`` is `check_tokens`' result already (a policy checks its counts once
    per plan), so they are not read once more to be checked. ValueError as for `topology_aware_dispatch`.
    """
    tokens_ED, copies_E = _checked(placement, tokens_ED, topology, tokens_checked)
    links = topology if links is None else links
    E, D = placement.shape
    links.validate(D)
    t = DispatchTraffic(*(np.zeros(D, dtype=np.int64) for _ in range(6)))
    mask_ED = placement.mask
    # Step 1: experts with one holder.
    _single_holder_traffic(placement, tokens_ED, copies_E, links, t)
    # Step 2: replicated experts: holders keep their tokens (l.4-5), the others split (l.6-12).
    rep_X = np.flatnonzero(copies_E > 1)
    if rep_X.size:
        holds_XD, tokens_XD = mask_ED[rep_X], tokens_ED[rep_X]
        kept_D = np.where(holds_XD, tokens_XD, 0).sum(axis=0)
        _, dest_Y, recv_Y, intra_Y, src_S, intra_S, tokens_S = _replicated_slots(holds_XD, tokens_XD, rep_X,
                                                                                 topology, links)
        t.kept_D[:] += kept_D
        t.load_D[:] += kept_D
        np.add.at(t.load_D, dest_Y, recv_Y)
        np.add.at(t.intra_in_D, dest_Y[intra_Y], recv_Y[intra_Y])
        np.add.at(t.inter_in_D, dest_Y[~intra_Y], recv_Y[~intra_Y])
        np.add.at(t.intra_out_D, src_S, intra_S)
        np.add.at(t.inter_out_D, src_S, tokens_S - intra_S)
    for f in fields(t):
        getattr(t, f.name).setflags(write=False)
    return t


def dispatch_expert_load(placement: Placement, tokens_ED: np.ndarray, topology: Topology) -> np.ndarray:
    """[E, D] int64 tokens each device computes for each expert under the Alg. 3 plan,
    ``topology_aware_dispatch(...).sum(axis=1)``, bit for bit, in O(E·D) (see the module docstring)."""
    tokens_ED, copies_E = _checked(placement, tokens_ED, topology)
    E, D = placement.shape
    mask_ED = placement.mask
    load_ED = np.zeros((E, D), dtype=np.int64)
    single_O = np.flatnonzero(copies_E == 1)
    if single_O.size:
        load_ED[single_O, np.argmax(mask_ED[single_O], axis=1)] = tokens_ED[single_O].sum(axis=1)
    rep_X = np.flatnonzero(copies_E > 1)
    if rep_X.size:
        holds_XD, tokens_XD = mask_ED[rep_X], tokens_ED[rep_X]
        load_ED[rep_X] = np.where(holds_XD, tokens_XD, 0)
        x_Y, dest_Y, recv_Y, *_ = _replicated_slots(holds_XD, tokens_XD, rep_X, topology, topology)
        np.add.at(load_ED, (rep_X[x_Y], dest_Y), recv_Y)
    return load_ED


def own_row_entries(owners_E: np.ndarray, full_J: np.ndarray, replicas_X: np.ndarray, tokens_E: np.ndarray,
                    topology: Topology, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One rank's row R[:, rank, :] of Alg. 3 for P' = the shard of ``owners_E`` ∪ (``full_J`` × D) ∪
    ``replicas_X`` (`materialize.materialize_pairs`' sparse form), as entries.

    Args:
        owners_E: [E] int64, the shard owners.
        full_J: [F] int64, ascending: experts every device holds.
        replicas_X: [X] int64, ascending flat ids ``e·D + d``: the other added replicas.
        tokens_E: [E] int64, the rank's own gate counts T[:, rank] (its row depends on nothing else).
        topology: D devices.
        rank: the source device.

    Returns:
        ``(start_E, dest_Y, count_Y)``: expert e's tokens go to ``dest_Y[start_E[e]:start_E[e + 1]]``
        (ascending) in the counts ``count_Y`` (> 0) — the nonzero entries of `dispatch_rows`' row, bit
        for bit. With the compiled core: O(E + X), no [E, D] array.
    """
    owners_E = np.ascontiguousarray(owners_E, dtype=np.int64)
    full_J = np.ascontiguousarray(full_J, dtype=np.int64)
    replicas_X = np.ascontiguousarray(replicas_X, dtype=np.int64)
    E, D = owners_E.size, topology.num_devices
    if type(rank) is not int or not 0 <= rank < D:
        raise ValueError(f"rank must be a device id in [0, {D}), got {rank!r}")
    tokens_E = check_tokens(np.asarray(tokens_E).reshape(E, 1), E, 1)[:, 0]
    core = compiled_core()
    if core is not None:
        start_E = np.empty(E + 1, dtype=np.int64)
        dest_Y = np.empty(E + replicas_X.size, dtype=np.int64)
        count_Y = np.empty(E + replicas_X.size, dtype=np.int64)
        n = core.own_row(topology.core_layout, owners_E, full_J, replicas_X, tokens_E, rank, start_E, dest_Y,
                         count_Y)
        if n >= 0:
            return start_E, dest_Y[:n], count_Y[:n]
    # numpy (and the precise errors): the dense row of P' for a token matrix holding only the rank's column.
    if owners_E.size and (owners_E.min() < 0 or owners_E.max() >= D):
        raise ValueError(f"owners must lie in [0, {D})")
    if full_J.size and (full_J.min() < 0 or full_J.max() >= E or (np.diff(full_J) <= 0).any()):
        raise ValueError("full experts must be ascending expert ids in range")
    mask_ED = Placement.from_owners(owners_E, D).mask.copy()
    flat = mask_ED.reshape(-1)
    if replicas_X.size and (replicas_X.min() < 0 or replicas_X.max() >= E * D or (np.diff(replicas_X) <= 0).any()
                            or flat[replicas_X].any() or np.isin(replicas_X // D, full_J).any()):
        raise ValueError("replicas must be ascending flat ids e·D + d in range, none at an expert's owner "
                         "or in a full expert")
    flat[replicas_X] = True
    mask_ED[full_J] = True
    tokens_ED = np.zeros((E, D), dtype=np.int64)
    tokens_ED[:, rank] = tokens_E
    row_ED = dispatch_rows(Placement.adopt(mask_ED), tokens_ED, topology, rank)
    e_Y, dest_Y = np.nonzero(row_ED)
    start_E = np.zeros(E + 1, dtype=np.int64)
    np.cumsum(np.bincount(e_Y, minlength=E), out=start_E[1:])
    return start_E, dest_Y.astype(np.int64), row_ED[e_Y, dest_Y]
