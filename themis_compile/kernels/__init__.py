"""Fused token dispatch/combine kernels (issue 7): one ``themis::*`` custom op each.

    counts_DE, dst_row_TK, src_pair_N = routing_metadata(expert_ids_TK, dest_TK, E, D)
    send_NH = permute(x_TH, dst_row_TK, out_dtype=torch.bfloat16)       # -> all-to-all -> experts
    out_TH = unpermute_combine(y_NH, dst_row_TK, weights_TK)            # <- all-to-all <- experts

Triton kernels on CUDA tensors, the torch reference on CPU (``set_backend`` / ``use_backend`` override).
"""

from __future__ import annotations

from themis_compile.kernels.ops import (
    BACKENDS,
    assign_destinations,
    get_backend,
    permute,
    routing_metadata,
    set_backend,
    unpermute_combine,
    use_backend,
)

__all__ = [
    "BACKENDS",
    "assign_destinations",
    "get_backend",
    "permute",
    "routing_metadata",
    "set_backend",
    "unpermute_combine",
    "use_backend",
]
