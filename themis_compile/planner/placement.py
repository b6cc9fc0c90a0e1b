"""Chunk placements (§3.1): which devices hold which expert chunks of one MoE layer.

A chunk placement P ⊆ C × D is an E × D boolean matrix ``mask_ED``: ``mask_ED[e, d]`` is True when
device d holds the chunk (parameters) of expert e. It is held in one of two forms, the same value either
way: the dense matrix, or its pairs as ascending flat ids ``e·D + d`` (`Placement.from_pairs`,
`Placement.from_owners`). The runtime builds its placements from pairs — a shard placement has E, a
materialized one E + |ΔP| — and what it asks of them (owners, holder counts, ΔP, subsets, digests) is
answered from the pairs; the [E, D] matrix (4 MB at 1,024 ranks, 64 MB at 4,096) is built only when
something reads `Placement.mask`. A *shard placement* gives every chunk
exactly one owner (the device that keeps its optimizer state); an *ephemeral placement* P' ⊇ P adds
replicas for one iteration, and ΔP = P' \\ P is exactly what SparseAllGather moves (Eq. 4).

Placements are immutable and hashable so that plans can be cached, compared and cross-checked across
ranks with `Placement.digest`.

Legend: E experts, D devices, N nodes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = ["Placement", "merge_sorted", "run_starts", "sorted_members"]


class Placement:
    """An immutable E × D chunk matrix (§3.1).

    Args:
        mask_ED: boolean-like array of shape [E, D]; copied and made read-only.
    """

    __slots__ = ("_mask_ED", "_flat_X", "_shape", "_hash", "_digest", "_owners_E", "_is_shard", "_copies_E",
                 "_node_masks", "_over")

    def __init__(self, mask_ED: np.ndarray) -> None:
        mask_ED = np.asarray(mask_ED)
        if mask_ED.ndim != 2:
            raise ValueError(f"a placement mask must be 2-D [E, D], got shape {mask_ED.shape}")
        if mask_ED.dtype != np.bool_:
            if not np.isin(mask_ED, (0, 1)).all():
                raise ValueError("a placement mask must be boolean (or 0/1)")
            mask_ED = mask_ED.astype(np.bool_)
        if mask_ED.shape[1] < 1:
            raise ValueError("a placement needs at least one device")
        mask_ED = np.array(mask_ED, dtype=np.bool_, order="C", copy=True)
        mask_ED.setflags(write=False)
        self._init(mask_ED, None, mask_ED.shape, None)

    def _init(self, mask_ED: np.ndarray | None, flat_X: np.ndarray | None, shape: tuple[int, int],
              copies_E: np.ndarray | None) -> None:
        self._mask_ED = mask_ED              # the dense form, or None until `mask` is read
        self._flat_X = flat_X                # the pairs, ascending flat ids, or None until asked for
        self._shape = (int(shape[0]), int(shape[1]))
        self._hash: int | None = None
        self._digest: str | None = None
        self._owners_E: np.ndarray | None = None
        self._is_shard: bool | None = None
        if copies_E is not None:
            copies_E.setflags(write=False)
        self._copies_E = copies_E
        self._node_masks: dict[tuple[int, ...], np.ndarray] = {}     # per topology (node sizes)
        # Per base placement (by digest): (base ⊆ self, ΔP's flat ids or None). A layer step asks both of
        # P' and its shard several times (the SpAG and SpRS plans, their checks, calibration).
        self._over: dict[str, tuple[bool, np.ndarray | None]] = {}

    @classmethod
    def adopt(cls, mask_ED: np.ndarray, copies_E: np.ndarray | None = None) -> Placement:
        """Take over a freshly built C-contiguous bool [E, D] array without copying or validating it
        (the planner's builders); the array is made read-only and must not be written afterwards.
        ``copies_E``: its per-expert holder counts when the builder already knows them."""
        obj = cls.__new__(cls)
        mask_ED.setflags(write=False)
        obj._init(mask_ED, None, mask_ED.shape, copies_E)
        return obj

    @classmethod
    def from_pairs(cls, flat_X: np.ndarray, num_experts: int, num_devices: int,
                   copies_E: np.ndarray | None = None) -> Placement:
        """The placement of the pairs ``flat_X`` (int64 flat ids ``e·D + d``, strictly ascending), held
        sparse: no [E, D] matrix is built until `mask` is read. ``flat_X`` is taken over (made read-only)
        and checked in O(|P|); ``copies_E``: its holder counts where the builder knows them."""
        E, D = int(num_experts), int(num_devices)
        if D < 1 or E < 0:
            raise ValueError(f"need num_experts >= 0 and num_devices >= 1, got {E}, {D}")
        flat_X = np.asarray(flat_X, dtype=np.int64).reshape(-1)
        if flat_X.size and (flat_X[0] < 0 or flat_X[-1] >= E * D or (flat_X.size > 1 and
                                                                      not (flat_X[1:] > flat_X[:-1]).all())):
            raise ValueError(f"pairs must be strictly ascending flat ids in [0, {E * D})")
        flat_X.setflags(write=False)
        obj = cls.__new__(cls)
        obj._init(None, flat_X, (E, D), copies_E)
        return obj

    # ----------------------------------------------------------------------------------- constructors
    @classmethod
    def from_owners(cls, owners_E: Sequence[int] | np.ndarray, num_devices: int) -> Placement:
        """The shard placement in which expert e is owned by device ``owners_E[e]``."""
        owners_E = np.asarray(owners_E, dtype=np.int64).reshape(-1)
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if owners_E.size and (owners_E.min() < 0 or owners_E.max() >= num_devices):
            raise ValueError(f"owners must lie in [0, {num_devices}), got {owners_E.tolist()}")
        D = int(num_devices)
        obj = cls.from_pairs(np.arange(owners_E.size, dtype=np.int64) * D + owners_E, owners_E.size, D,
                             np.ones(owners_E.size, dtype=np.int64))
        obj._is_shard = True
        owners_E = owners_E.copy()
        owners_E.setflags(write=False)
        obj._owners_E = owners_E
        return obj

    def extended(self, added_X: np.ndarray, copies_E: np.ndarray | None = None) -> Placement:
        """self ∪ ΔP, held as pairs, for ``added_X`` the ascending flat ids of pairs self does not hold
        (not checked: the planner's builders, like `adopt`); ``copies_E``: the result's holder counts
        when the builder knows them. ΔP is merged into self's pairs (no sort of the union), and the
        result remembers it: `added_over` and `issubset` of self — and of every base whose ΔP self
        remembers (P' over its shard when P'' = P'.extended(...)) — are answered without a pass over
        the pairs."""
        added_X = np.asarray(added_X, dtype=np.int64).reshape(-1)
        if not added_X.size:
            return self
        E, D = self._shape
        if copies_E is None:
            copies_E = self.copy_counts() + np.bincount(added_X // D, minlength=E)
        flat_X = merge_sorted(self.flat_ids(), added_X)
        flat_X.setflags(write=False)
        obj = Placement.__new__(Placement)
        obj._init(None, flat_X, self._shape, copies_E)
        added_X = added_X.view()
        added_X.setflags(write=False)
        obj._remember(self, True, added_X)
        for digest, (subset, known_X) in self._over.items():      # at most 5: bounded by _remember
            if subset and known_X is not None:
                merged_X = merge_sorted(known_X, added_X)
                merged_X.setflags(write=False)
                obj._over[digest] = (True, merged_X)
        return obj

    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int) -> Placement:
        """Static EP (homogeneous) sharding: ranks own contiguous runs of experts.

        When E is not a multiple of D the first ``E % D`` ranks own one expert more; when E < D the last
        ranks own none.
        """
        if num_experts < 0 or num_devices < 1:
            raise ValueError(f"need num_experts >= 0 and num_devices >= 1, got {num_experts}, {num_devices}")
        base, extra = divmod(int(num_experts), int(num_devices))
        counts_D = np.full(num_devices, base, dtype=np.int64)
        counts_D[:extra] += 1
        owners_E = np.repeat(np.arange(num_devices, dtype=np.int64), counts_D)
        return cls.from_owners(owners_E, num_devices)

    @classmethod
    def empty(cls, num_experts: int, num_devices: int) -> Placement:
        """The placement holding nothing."""
        return cls.from_pairs(np.zeros(0, dtype=np.int64), num_experts, num_devices)

    @classmethod
    def full(cls, num_experts: int, num_devices: int) -> Placement:
        """Every chunk on every device (what dense FSDP materializes)."""
        return cls.adopt(np.ones((int(num_experts), int(num_devices)), dtype=np.bool_))

    # ----------------------------------------------------------------------------------- basic views
    @property
    def mask(self) -> np.ndarray:
        """[E, D] bool, read-only (built on first use where the placement is held as pairs)."""
        if self._mask_ED is None:
            mask_ED = np.zeros(self._shape, dtype=np.bool_)
            mask_ED.reshape(-1)[self._flat_X] = True
            mask_ED.setflags(write=False)
            self._mask_ED = mask_ED
        return self._mask_ED

    @property
    def is_sparse(self) -> bool:
        """True while the placement is held as pairs only (no [E, D] matrix built)."""
        return self._mask_ED is None

    def flat_ids(self) -> np.ndarray:
        """[|P|] int64, read-only: the pairs as ascending flat ids ``e·D + d``."""
        if self._flat_X is None:
            flat_X = np.flatnonzero(self._mask_ED).astype(np.int64, copy=False)
            flat_X.setflags(write=False)
            self._flat_X = flat_X
        return self._flat_X

    @property
    def num_experts(self) -> int:
        return self._shape[0]

    @property
    def num_devices(self) -> int:
        return self._shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def num_pairs(self) -> int:
        """|P|: the number of (chunk, device) pairs."""
        if self._flat_X is not None:
            return int(self._flat_X.size)
        return int(np.count_nonzero(self._mask_ED))

    def __len__(self) -> int:
        return self.num_pairs()

    def copies(self) -> np.ndarray:
        """[E] int64: how many devices hold each chunk."""
        return self.copy_counts().copy()

    def copy_counts(self) -> np.ndarray:
        """[E] int64 holder counts, computed once and shared: read-only (`copies` gives a writable copy)."""
        if self._copies_E is None:
            if self._mask_ED is None:
                copies_E = np.bincount(self._flat_X // self.num_devices, minlength=self.num_experts)
            else:
                copies_E = self._mask_ED.sum(axis=1, dtype=np.int64)
            copies_E.setflags(write=False)
            self._copies_E = copies_E
        return self._copies_E

    def slots(self) -> np.ndarray:
        """[D] int64: how many chunks each device holds."""
        if self._mask_ED is None:
            return np.bincount(self._flat_X % self.num_devices, minlength=self.num_devices)
        return self._mask_ED.sum(axis=0, dtype=np.int64)

    def is_shard_placement(self) -> bool:
        """True when every chunk has exactly one owner (§3.1). Cached: the mask is immutable."""
        if self._is_shard is None:
            self._is_shard = bool((self.copy_counts() == 1).all())
        return self._is_shard

    def require_shard_placement(self, what: str = "placement") -> None:
        """Raise ValueError naming the offending experts unless this is a shard placement."""
        if self.is_shard_placement():
            return
        copies_E = self.copy_counts()
        bad_E = np.flatnonzero(copies_E != 1)
        if bad_E.size:
            e = int(bad_E[0])
            raise ValueError(f"{what} is not a shard placement: expert {e} has {int(copies_E[e])} owners "
                             f"({bad_E.size} experts without exactly one owner)")

    def owners(self) -> np.ndarray:
        """[E] int64: the owner of every expert (read-only). ValueError unless a shard placement."""
        if self._owners_E is None:
            self.require_shard_placement()
            if self._mask_ED is None:      # one pair per expert, in expert order
                owners_E = self._flat_X % self.num_devices
            else:
                owners_E = np.argmax(self._mask_ED, axis=1).astype(np.int64)
            owners_E.setflags(write=False)
            self._owners_E = owners_E
        return self._owners_E

    def holders(self, e: int) -> np.ndarray:
        """Sorted device ids holding expert ``e``."""
        if self._mask_ED is None:
            D = self.num_devices
            lo, hi = np.searchsorted(self._flat_X, [e * D, (e + 1) * D])
            return self._flat_X[lo:hi] - e * D
        return np.flatnonzero(self._mask_ED[e]).astype(np.int64)

    def experts_on(self, d: int) -> np.ndarray:
        """Sorted expert ids held by device ``d``."""
        if self._mask_ED is None:
            D = self.num_devices
            return self._flat_X[self._flat_X % D == d] // D
        return np.flatnonzero(self._mask_ED[:, d]).astype(np.int64)

    def node_mask(self, topology: Topology) -> np.ndarray:
        """[E, N] bool: node n holds expert e on at least one of its devices."""
        topology.validate(self.num_devices)
        key = topology.devices_per_node
        cached = self._node_masks.get(key)
        if cached is None:
            E, D = self.shape
            if self._mask_ED is None:           # [E, N] from the pairs, no [E, D] matrix
                cached = np.zeros((E, topology.num_nodes), dtype=np.bool_)
                cached[self._flat_X // D, topology.node_ids[self._flat_X % D]] = True
            elif topology.is_uniform and E:        # equal nodes: a reshape, no reduceat
                cached = self._mask_ED.reshape(E, topology.num_nodes, D // topology.num_nodes).any(axis=2)
            else:
                cached = np.logical_or.reduceat(self._mask_ED, topology.node_offsets[:-1], axis=1)
            cached.setflags(write=False)
            if len(self._node_masks) > 8:
                self._node_masks.clear()
            self._node_masks[key] = cached
        return cached

    # ----------------------------------------------------------------------------------- set algebra
    def _check_same_shape(self, other: Placement) -> None:
        if not isinstance(other, Placement):
            raise TypeError(f"expected a Placement, got {type(other).__name__}")
        if other.shape != self.shape:
            raise ValueError(f"placements have different shapes {self.shape} and {other.shape}")

    def _both_dense(self, other: Placement) -> bool:
        return self._mask_ED is not None and other._mask_ED is not None

    def issubset(self, other: Placement) -> bool:
        """P ⊆ other."""
        self._check_same_shape(other)
        known = other._over.get(self.digest())
        if known is not None:
            return known[0]
        if self._both_dense(other):
            subset = not bool((self._mask_ED & ~other._mask_ED).any())
        elif other._mask_ED is not None:
            subset = bool(other._mask_ED.reshape(-1)[self.flat_ids()].all())
        else:
            subset = bool(sorted_members(self.flat_ids(), other.flat_ids()).all())
        other._remember(self, subset, None)
        return subset

    def _remember(self, base: Placement, subset: bool, added_X: np.ndarray | None) -> None:
        if len(self._over) > 4:
            self._over.clear()
        self._over[base.digest()] = (subset, added_X)

    def added_over(self, base: Placement) -> np.ndarray:
        """ΔP = self \\ base as ascending flat ids, read from the pairs (no [E, D] matrix); ``base ⊆ self``
        is not checked (`delta` checks it)."""
        self._check_same_shape(base)
        known = self._over.get(base.digest())
        if known is not None and known[1] is not None:
            return known[1]
        if self._both_dense(base):
            added_X = np.flatnonzero(self._mask_ED & ~base._mask_ED).astype(np.int64, copy=False)
            subset = base.issubset(self)
        else:
            flat_X = self.flat_ids()
            in_base_X = sorted_members(flat_X, base.flat_ids())
            added_X = flat_X[~in_base_X]
            subset = int(np.count_nonzero(in_base_X)) == base.num_pairs()     # pairs are unique
        added_X.setflags(write=False)
        self._remember(base, subset, added_X)
        return added_X

    def __le__(self, other: Placement) -> bool:
        return self.issubset(other)

    def __ge__(self, other: Placement) -> bool:
        return other.issubset(self)

    def union(self, other: Placement) -> Placement:
        """P ∪ other."""
        self._check_same_shape(other)
        if self._both_dense(other):
            return Placement.adopt(self._mask_ED | other._mask_ED)
        return Placement.from_pairs(np.union1d(self.flat_ids(), other.flat_ids()), *self.shape)

    def __or__(self, other: Placement) -> Placement:
        return self.union(other)

    def delta(self, base: Placement) -> Placement:
        """ΔP = self \\ base, the pairs SparseAllGather(base, self) delivers (§3.1, Eq. 4).

        Raises ValueError unless ``base ⊆ self`` (SpAG's post-condition must contain its pre-condition).
        """
        if not base.issubset(self):
            raise ValueError("delta: the base placement is not a subset of this placement")
        if self._both_dense(base):
            return Placement.adopt(self._mask_ED & ~base._mask_ED)
        return Placement.from_pairs(self.added_over(base), *self.shape)

    def receive_counts(self, base: Placement) -> np.ndarray:
        """[D] int64: chunks each device receives in SpAG(base, self) (= sends in SpRS(self, base))."""
        return self.delta(base).slots()

    def new_node_entries(self, base: Placement, topology: Topology) -> np.ndarray:
        """[E, N] bool: nodes that chunk e newly reaches in SpAG(base, self) (§3.3: one inter-node
        transfer per newly reached node, then a broadcast inside it)."""
        if not base.issubset(self):
            raise ValueError("new_node_entries: the base placement is not a subset of this placement")
        return self.node_mask(topology) & ~base.node_mask(topology)

    # ----------------------------------------------------------------------------------- identity
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        if self is other:
            return True
        if self.shape != other.shape:
            return False
        if self._both_dense(other):
            return bool(np.array_equal(self._mask_ED, other._mask_ED))
        return self.num_pairs() == other.num_pairs() and bool(np.array_equal(self.flat_ids(), other.flat_ids()))

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self.shape, self.digest()))
        return self._hash

    def digest(self) -> str:
        """A stable hex digest of the placement (same on every rank, in every process and for either form):
        sha256 of the shape and the pairs' flat ids (little-endian int64). Cached: the placement is
        immutable, and plan caches key on it several times per layer step."""
        if self._digest is None:
            h = hashlib.sha256()
            h.update(f"placement:{self.num_experts}x{self.num_devices}:".encode())
            h.update(np.ascontiguousarray(self.flat_ids(), dtype="<i8").data)     # (no bytes copy)
            self._digest = h.hexdigest()[:32]
        return self._digest

    def __repr__(self) -> str:
        E, D = self.shape
        return f"Placement(E={E}, D={D}, pairs={self.num_pairs()}, shard={self.is_shard_placement()})"

    def to_text(self) -> str:
        """A small ASCII picture (rows = experts, columns = devices), for logs and inspection."""
        return "\n".join("".join("#" if x else "." for x in row) for row in self.mask)


def merge_sorted(sorted_X: np.ndarray, sorted_Y: np.ndarray) -> np.ndarray:
    """The ascending union of two ascending int64 arrays with no common entry (a shard's pairs and ΔP),
    as a new array: the two runs concatenated and merged by a stable sort, which finds them in one pass
    (several times faster than ``np.insert`` at searchsorted positions)."""
    out = np.concatenate([sorted_X, sorted_Y]).astype(np.int64, copy=False)
    out.sort(kind="stable")
    return out


def sorted_members(flat_X: np.ndarray, sorted_Y: np.ndarray) -> np.ndarray:
    """[X] bool: which of ``flat_X`` occur in the ascending ``sorted_Y``."""
    if not sorted_Y.size:
        return np.zeros(flat_X.size, dtype=np.bool_)
    at_X = np.minimum(np.searchsorted(sorted_Y, flat_X), sorted_Y.size - 1)
    return sorted_Y[at_X] == flat_X


def run_starts(keys_X: np.ndarray) -> np.ndarray:
    """Positions where a run of equal values of the non-decreasing ``keys_X`` starts (pairs grouped by
    expert, or by expert and node, read off their sorted flat ids)."""
    if not keys_X.size:
        return np.zeros(0, dtype=np.int64)
    starts_X = np.empty(keys_X.size, dtype=np.bool_)         # (no np.r_: its index machinery costs more)
    starts_X[0] = True
    np.not_equal(keys_X[1:], keys_X[:-1], out=starts_X[1:])
    return np.flatnonzero(starts_X)
