"""The ``themis::*`` custom ops for token dispatch and combine, and the backend switch.

Each public function is ONE opaque ``torch.library.custom_op`` node under
``torch.compile(fullgraph=True)``: a fake implementation gives the output shapes (all static: N = T * K),
and ``register_autograd`` routes the backward through further custom ops. The body picks an
implementation, chosen per call (``backend=``, a string argument of the op, so a compiled graph
carries it) or, without one, from the process default (`set_backend`):

- ``"torch"``: the eager reference in ``reference.py`` (the CPU fast path);
- ``"triton"``: the kernels in ``triton_kernels.py`` -- compiled on CUDA tensors, run by Triton's
  interpreter on CPU tensors (slow; for tests);
- ``"auto"`` (default): Triton on CUDA tensors when Triton is installed, the reference otherwise.

Shape suffix legend:
    T = tokens, K = top-k, H = hidden, E = experts, D = destinations (ranks), N = T * K send-buffer rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import Tensor

from themis_compile.kernels import reference

__all__ = [
    "BACKENDS",
    "get_backend",
    "set_backend",
    "use_backend",
    "routing_metadata",
    "assign_destinations",
    "permute",
    "unpermute_combine",
]

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton", "auto")
_backend = "auto"


def get_backend() -> str:
    """The current implementation choice: ``"torch"``, ``"triton"`` or ``"auto"``."""
    return _backend


def set_backend(name: str) -> None:
    """Set the process default behind the ``themis::*`` ops: what a call without ``backend=`` runs.

    A model's runtime does not need it (it passes its ``ThemisConfig.kernels`` per call); benchmarks and
    tests use it (mostly as `use_backend`) to run whole code paths on one implementation.

    ``"triton"`` on CPU tensors runs the kernels under Triton's interpreter (built explicitly, so the
    ``TRITON_INTERPRET`` environment variable is not needed and other users of Triton are unaffected).
    """
    global _backend
    _backend = _checked(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager form of :func:`set_backend`; restores the previous choice on exit."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


_triton_module: ModuleType | None = None
_triton_checked = False


def _triton_available() -> bool:
    global _triton_checked, _triton_module
    if not _triton_checked:
        _triton_checked = True
        try:
            from themis_compile.kernels import triton_kernels

            _triton_module = triton_kernels
        except ImportError as exc:  # triton is an optional dependency
            logger.info("triton unavailable, dispatch kernels use the torch reference: %s", exc)
    return _triton_module is not None


def _resolve(backend: str | None) -> str:
    """``backend`` checked, or the process default (`set_backend`) when it is None."""
    return _backend if backend is None else _checked(backend)


def _checked(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; choose from {BACKENDS}")
    if backend == "triton" and not _triton_available():
        raise ValueError("kernels backend 'triton' requested but the triton package is not installed")
    return backend


def _impl(tensor: Tensor, backend: str) -> ModuleType:
    """The module (``reference`` or ``triton_kernels``) that runs an op on ``tensor``'s device."""
    if backend == "torch":
        return reference
    if backend == "triton" or (tensor.is_cuda and _triton_available()):
        if _triton_available():
            return _triton_module  # type: ignore[return-value]
    return reference


# ----------------------------------------------------------------------------------------------------
# themis::routing_metadata and themis::assign_destinations (integer outputs, no autograd)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("themis::routing_metadata", mutates_args=())
def _routing_metadata_op(
    expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int, backend: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    return _impl(expert_ids_TK, backend).routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)


@_routing_metadata_op.register_fake
def _(expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int,
      backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    counts_DE = expert_ids_TK.new_empty((num_dests, num_experts), dtype=torch.int64)
    dst_row_TK = expert_ids_TK.new_empty(expert_ids_TK.shape, dtype=torch.int64)
    src_pair_N = expert_ids_TK.new_empty((expert_ids_TK.numel(),), dtype=torch.int64)
    return counts_DE, dst_row_TK, src_pair_N


@torch.library.custom_op("themis::assign_destinations", mutates_args=())
def _assign_destinations_op(expert_ids_TK: Tensor, splits_ED: Tensor, backend: str = "auto") -> Tensor:
    return _impl(expert_ids_TK, backend).assign_destinations(expert_ids_TK, splits_ED)


@_assign_destinations_op.register_fake
def _(expert_ids_TK: Tensor, splits_ED: Tensor, backend: str = "auto") -> Tensor:
    return expert_ids_TK.new_empty(expert_ids_TK.shape, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------
# themis::permute (+ backward)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("themis::permute", mutates_args=())
def _permute_op(x_TH: Tensor, dst_row_TK: Tensor, num_rows: int, out_dtype: torch.dtype | None,
                backend: str = "auto") -> Tensor:
    return _impl(x_TH, backend).permute(x_TH, dst_row_TK, num_rows, out_dtype)


@_permute_op.register_fake
def _(x_TH: Tensor, dst_row_TK: Tensor, num_rows: int, out_dtype: torch.dtype | None, backend: str = "auto") -> Tensor:
    return x_TH.new_empty((num_rows, x_TH.shape[1]), dtype=x_TH.dtype if out_dtype is None else out_dtype)


@torch.library.custom_op("themis::permute_backward", mutates_args=())
def _permute_backward_op(grad_send_NH: Tensor, dst_row_TK: Tensor, x_dtype: torch.dtype,
                         backend: str = "auto") -> Tensor:
    return _impl(grad_send_NH, backend).permute_backward(grad_send_NH, dst_row_TK, x_dtype)


@_permute_backward_op.register_fake
def _(grad_send_NH: Tensor, dst_row_TK: Tensor, x_dtype: torch.dtype, backend: str = "auto") -> Tensor:
    return grad_send_NH.new_empty((dst_row_TK.shape[0], grad_send_NH.shape[1]), dtype=x_dtype)


def _permute_setup_context(ctx, inputs, output) -> None:
    x_TH, dst_row_TK, _num_rows, _out_dtype, backend = inputs
    ctx.save_for_backward(dst_row_TK)
    ctx.x_dtype = x_TH.dtype
    ctx.backend = backend


def _permute_backward(ctx, grad_send_NH: Tensor):
    (dst_row_TK,) = ctx.saved_tensors
    grad_x_TH = _permute_backward_op(_dense(grad_send_NH), dst_row_TK, ctx.x_dtype, ctx.backend)
    return grad_x_TH, None, None, None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup_context)


# ----------------------------------------------------------------------------------------------------
# themis::unpermute_combine (+ backward)
# ----------------------------------------------------------------------------------------------------


@torch.library.custom_op("themis::unpermute_combine", mutates_args=())
def _unpermute_combine_op(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor, backend: str = "auto") -> Tensor:
    return _impl(y_NH, backend).unpermute_combine(y_NH, dst_row_TK, weights_TK)


@_unpermute_combine_op.register_fake
def _(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor, backend: str = "auto") -> Tensor:
    return y_NH.new_empty((dst_row_TK.shape[0], y_NH.shape[1]))


@torch.library.custom_op("themis::unpermute_combine_backward", mutates_args=())
def _unpermute_combine_backward_op(
    grad_out_TH: Tensor, y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    return _impl(y_NH, backend).unpermute_combine_backward(grad_out_TH, y_NH, dst_row_TK, weights_TK)


@_unpermute_combine_backward_op.register_fake
def _(grad_out_TH: Tensor, y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor,
      backend: str = "auto") -> tuple[Tensor, Tensor]:
    return torch.empty_like(y_NH), torch.empty_like(weights_TK)


def _combine_setup_context(ctx, inputs, output) -> None:
    y_NH, dst_row_TK, weights_TK, backend = inputs
    ctx.save_for_backward(y_NH, dst_row_TK, weights_TK)
    ctx.backend = backend


def _combine_backward(ctx, grad_out_TH: Tensor):
    y_NH, dst_row_TK, weights_TK = ctx.saved_tensors
    grad_y_NH, grad_weights_TK = _unpermute_combine_backward_op(_dense(grad_out_TH), y_NH, dst_row_TK, weights_TK,
                                                                ctx.backend)
    return grad_y_NH, None, grad_weights_TK, None


_unpermute_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# ----------------------------------------------------------------------------------------------------
# Public API (input checks that need no device sync, then one op each)
# ----------------------------------------------------------------------------------------------------


def _dense(t: Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Tensor:
    """``t`` as a contiguous tensor of ``dtype`` on ``device``; no graph node when it already is one."""
    if (dtype is not None and t.dtype != dtype) or (device is not None and t.device != device):
        t = t.to(device=device, dtype=dtype)
    return t if t.is_contiguous() else t.contiguous()


def _check_index(name: str, t: Tensor, ndim: int) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an integer tensor (int32/int64), got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def routing_metadata(
    expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int, *, backend: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Counts, send-buffer rows and their inverse for dispatching (token, expert) pairs.

    The send buffer is ordered by (destination, expert) and, inside one group, by the flattened pair
    index ``t * K + k`` (stable).

    Args:
        expert_ids_TK: int64 [T, K] expert of each pair (top-k router output).
        dest_TK: int64 [T, K] destination rank of each pair (see :func:`assign_destinations`).
        num_experts: E. num_dests: D.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` for this call (a model's runtime passes its
            ``ThemisConfig.kernels``); None uses the process default (`set_backend`, ``"auto"``).
    Returns:
        ``counts_DE`` int64 [D, E]: pairs per (destination, expert); ``counts_DE.sum(1)`` are the
        all-to-all send split sizes (the only value a caller needs on the host).
        ``dst_row_TK`` int64 [T, K]: row of each pair in the send buffer.
        ``src_pair_N`` int64 [N]: the inverse, flattened pair index of each row.
    """
    _check_index("expert_ids_TK", expert_ids_TK, 2)
    _check_index("dest_TK", dest_TK, 2)
    if expert_ids_TK.shape != dest_TK.shape:
        raise ValueError(f"expert_ids_TK {tuple(expert_ids_TK.shape)} and dest_TK {tuple(dest_TK.shape)} differ")
    if num_experts < 1 or num_dests < 1:
        raise ValueError(f"num_experts ({num_experts}) and num_dests ({num_dests}) must be positive")
    return _routing_metadata_op(
        _dense(expert_ids_TK, torch.int64), _dense(dest_TK, torch.int64, expert_ids_TK.device), num_experts, num_dests,
        _resolve(backend),
    )


def assign_destinations(expert_ids_TK: Tensor, splits_ED: Tensor, *, backend: str | None = None) -> Tensor:
    """Destination of each (token, expert) pair from this rank's dispatch plan row (Alg. 3).

    For expert e, the pairs routed to e, in flattened pair order, go to destination 0 for the first
    ``splits_ED[e, 0]`` of them, then destination 1 for the next ``splits_ED[e, 1]``, and so on.
    ``splits_ED[e].sum()`` must equal the number of pairs routed to e; the reference (CPU) path raises
    ``ValueError`` otherwise, the Triton path does not check (a check would cost a device sync) and
    clamps pairs beyond the splits to the last destination.

    Args:
        expert_ids_TK: int64 [T, K] expert of each pair.
        splits_ED: int64 [E, D] how many of this rank's pairs for expert e go to destination d.
        backend: as in :func:`routing_metadata`.
    Returns:
        ``dest_TK`` int64 [T, K].
    """
    _check_index("expert_ids_TK", expert_ids_TK, 2)
    _check_index("splits_ED", splits_ED, 2)
    return _assign_destinations_op(
        _dense(expert_ids_TK, torch.int64), _dense(splits_ED, torch.int64, expert_ids_TK.device), _resolve(backend)
    )


def permute(
    x_TH: Tensor, dst_row_TK: Tensor, num_rows: int | None = None, out_dtype: torch.dtype | None = None, *,
    backend: str | None = None,
) -> Tensor:
    """Gather token rows into the send buffer: ``send[dst_row[t, k]] = x[t]`` (duplicated for top-k).

    Args:
        x_TH: [T, H] token activations.
        dst_row_TK: int64 [T, K] from :func:`routing_metadata` (must be injective).
        num_rows: rows of the send buffer, default N = T * K (dropless); rows no pair references are zero.
        out_dtype: cast fused into the copy (e.g. bf16 for the wire), default x's dtype.
        backend: as in :func:`routing_metadata` (the backward runs on the same one).
    Returns:
        ``send_NH`` [num_rows, H]. Differentiable w.r.t. ``x_TH``: ``grad_x[t] = sum_k grad_send[dst_row[t, k]]``.
    """
    if x_TH.dim() != 2:
        raise ValueError(f"x_TH must be [T, H], got shape {tuple(x_TH.shape)}")
    _check_index("dst_row_TK", dst_row_TK, 2)
    if dst_row_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"dst_row_TK has {dst_row_TK.shape[0]} tokens, x_TH has {x_TH.shape[0]}")
    if num_rows is None:
        num_rows = dst_row_TK.numel()
    elif num_rows < dst_row_TK.numel():
        raise ValueError(f"num_rows ({num_rows}) is smaller than the number of pairs ({dst_row_TK.numel()})")
    return _permute_op(_dense(x_TH), _dense(dst_row_TK, torch.int64), num_rows, out_dtype, _resolve(backend))


def unpermute_combine(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor, *,
                      backend: str | None = None) -> Tensor:
    """Weighted sum of the returned expert outputs back into token order.

    ``out[t] = sum_k weights[t, k] * y[dst_row[t, k]]``, accumulated in fp32, returned in y's dtype.
    Differentiable w.r.t. ``y_NH`` and ``weights_TK``.

    Args:
        y_NH: [N, H] expert outputs in send-buffer order.
        dst_row_TK: int64 [T, K] from :func:`routing_metadata`.
        weights_TK: [T, K] gate weights.
        backend: as in :func:`routing_metadata` (the backward runs on the same one).
    Returns:
        ``out_TH`` [T, H].
    """
    if y_NH.dim() != 2:
        raise ValueError(f"y_NH must be [N, H], got shape {tuple(y_NH.shape)}")
    _check_index("dst_row_TK", dst_row_TK, 2)
    if weights_TK.shape != dst_row_TK.shape:
        raise ValueError(f"weights_TK {tuple(weights_TK.shape)} and dst_row_TK {tuple(dst_row_TK.shape)} differ")
    if y_NH.shape[0] < dst_row_TK.numel():
        raise ValueError(f"y_NH has {y_NH.shape[0]} rows, fewer than the {dst_row_TK.numel()} pairs")
    return _unpermute_combine_op(_dense(y_NH), _dense(dst_row_TK, torch.int64), _dense(weights_TK),
                                 _resolve(backend))
