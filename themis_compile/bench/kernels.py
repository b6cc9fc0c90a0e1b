"""`python -m themis_compile.bench kernels [--quick] [--no-check] [--iters N]`: dispatch/combine kernels.

Effective bandwidth (bytes that must move / time) of ``permute`` and ``unpermute_combine`` (forward and
backward) plus the time of ``routing_metadata``, Triton kernels against the torch eager reference
(index_select / index_copy / index_add), at DeepSeek-V3 sizes (H = 7168, 16k tokens, top-8, 256 experts)
and Qwen1.5-MoE sizes (H = 2048, top-4, 60 experts) in bf16 on CUDA. Before timing, a correctness check
compares the Triton path with the reference on small cases (forward, backward, torch.compile).

On CPU only the reference path is timed, at reduced sizes (``--quick``), and the check runs the Triton
kernels under the interpreter; the JSON says so in ``"path"``.

Shape suffix legend: T tokens, K top-k, H hidden, E experts, D destinations, N = T * K rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from themis_compile import kernels
from themis_compile.kernels import reference


@dataclass(frozen=True)
class KernelShape:
    name: str
    tokens: int
    top_k: int
    hidden: int
    experts: int
    dests: int = 8


FULL_SHAPES = [
    KernelShape("deepseek-v3", tokens=16384, top_k=8, hidden=7168, experts=256),
    KernelShape("qwen1.5-moe", tokens=16384, top_k=4, hidden=2048, experts=60),
]
QUICK_SHAPES = [
    KernelShape("deepseek-v3-quick", tokens=512, top_k=8, hidden=448, experts=256),
    KernelShape("qwen1.5-moe-quick", tokens=512, top_k=4, hidden=256, experts=60),
]

# Peak HBM bandwidth (GB/s) by device-name substring, from vendor data sheets.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "H800": 3350.0,
    "H20": 4000.0,
    "B200": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "RTX 4090": 1008.0,
}


def peak_bandwidth_gbps(device: torch.device) -> float | None:
    """Peak memory bandwidth of a CUDA device in GB/s, or None when unknown (or on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    try:
        from triton.testing import get_dram_gbps

        return float(get_dram_gbps(device.index or 0))
    except Exception:  # noqa: BLE001 - the driver query is best effort
        return None


def _time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=max(iters * 2, 20)))
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _routing(shape: KernelShape, device: torch.device, gen: torch.Generator):
    """Random top-k routing and a balanced dispatch plan row (each expert's pairs split over D ranks)."""
    scores_TE = torch.rand(shape.tokens, shape.experts, generator=gen, device=device)
    expert_ids_TK = scores_TE.topk(shape.top_k, dim=1).indices
    counts_E = torch.zeros(shape.experts, dtype=torch.int64, device=device)
    counts_E.scatter_add_(0, expert_ids_TK.flatten(), torch.ones_like(expert_ids_TK.flatten()))
    splits_ED = (counts_E[:, None] // shape.dests).repeat(1, shape.dests)
    splits_ED[:, 0] += counts_E - splits_ED.sum(1)
    return expert_ids_TK, splits_ED


def bench_shape(shape: KernelShape, device: torch.device, iters: int, impls: list[str], peak: float | None) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    expert_ids_TK, splits_ED = _routing(shape, device, gen)
    dest_TK = reference.assign_destinations(expert_ids_TK, splits_ED, validate=False)
    _, dst_row_TK, _ = reference.routing_metadata(expert_ids_TK, dest_TK, shape.experts, shape.dests)
    num_rows = dst_row_TK.numel()
    x_TH = torch.randn(shape.tokens, shape.hidden, generator=gen, device=device).to(dtype)
    y_NH = torch.randn(num_rows, shape.hidden, generator=gen, device=device).to(dtype)
    weights_TK = torch.rand(shape.tokens, shape.top_k, generator=gen, device=device)
    grad_out_TH = torch.randn(shape.tokens, shape.hidden, generator=gen, device=device).to(dtype)
    row_bytes, tok_bytes = num_rows * shape.hidden * 2, shape.tokens * shape.hidden * 2
    index_bytes = num_rows * 8
    ops: dict[str, tuple[int, Callable[[], object]]] = {
        # bytes that must move: read tokens once, write every row; gather rows, write tokens; ...
        "permute": (
            tok_bytes + row_bytes + index_bytes,
            lambda: torch.ops.themis.permute(x_TH, dst_row_TK, num_rows, None),
        ),
        "unpermute_combine": (
            row_bytes + tok_bytes + index_bytes + num_rows * 4,
            lambda: torch.ops.themis.unpermute_combine(y_NH, dst_row_TK, weights_TK),
        ),
        "permute_backward": (
            row_bytes + tok_bytes + index_bytes,
            lambda: torch.ops.themis.permute_backward(y_NH, dst_row_TK, dtype),
        ),
        "unpermute_combine_backward": (
            2 * row_bytes + tok_bytes + index_bytes + 2 * num_rows * 4,
            lambda: torch.ops.themis.unpermute_combine_backward(grad_out_TH, y_NH, dst_row_TK, weights_TK),
        ),
        "routing_metadata": (
            0,
            lambda: torch.ops.themis.routing_metadata(expert_ids_TK, dest_TK, shape.experts, shape.dests),
        ),
    }
    results: dict[str, dict] = {}
    for op, (nbytes, fn) in ops.items():
        entry: dict[str, float | int | None] = {"bytes": nbytes}
        for impl in impls:
            with kernels.use_backend(impl):
                ms = _time_ms(fn, device, iters)
            entry[f"{impl}_ms"] = round(ms, 4)
            if nbytes:
                entry[f"{impl}_GBps"] = round(nbytes / ms / 1e6, 3)
        if "triton" in impls:
            entry["speedup"] = round(entry["torch_ms"] / entry["triton_ms"], 2)
            if nbytes and peak:
                entry["triton_fraction_of_peak"] = round(entry["triton_GBps"] / peak, 3)
        results[op] = entry
    return {**asdict(shape), "dtype": "bfloat16", "rows": num_rows, "ops": results}


def check(device: torch.device, include_large: bool = False) -> dict:
    """Triton path == reference path on small cases: forward, backward and under torch.compile."""
    failures: list[str] = []
    cases = [(1, 1, 4, 2, 5), (0, 4, 8, 2, 64), (37, 2, 6, 3, 100), (9, 8, 16, 4, 1030)]
    if device.type == "cuda":  # the interpreter on CPU would take minutes for these
        cases += [(200, 6, 60, 8, 2048), (4096, 8, 256, 8, 7168)]
    gen = torch.Generator(device=device).manual_seed(1)
    for num_tokens, top_k, num_experts, num_dests, hidden in cases:
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"T{num_tokens}K{top_k}E{num_experts}D{num_dests}H{hidden}/{dtype}"
            shape = KernelShape(tag, num_tokens, top_k, hidden, num_experts, num_dests)
            expert_ids_TK, splits_ED = _routing(shape, device, gen)
            x_TH = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
            w_TK = torch.rand(num_tokens, top_k, generator=gen, device=device)
            outs = {}
            for impl in ("triton", "torch"):
                with kernels.use_backend(impl):
                    x = x_TH.clone().requires_grad_()
                    w = w_TK.clone().requires_grad_()
                    dest_TK = kernels.assign_destinations(expert_ids_TK, splits_ED)
                    meta = kernels.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
                    send_NH = kernels.permute(x, meta[1], out_dtype=torch.bfloat16)
                    out_TH = kernels.unpermute_combine(torch.tanh(send_NH.to(dtype)), meta[1], w)
                    out_TH.float().square().sum().backward()
                    outs[impl] = (dest_TK, *meta, send_NH, out_TH, x.grad, w.grad)
            names = ("dest", "counts", "dst_row", "src_pair", "send", "out", "grad_x", "grad_w")
            for name, got, want in zip(names, outs["triton"], outs["torch"]):
                if got.dtype == torch.int64 or (name == "send" and device.type == "cuda"):
                    ok = torch.equal(got, want)
                else:
                    # Relative error in norm: bf16 roundings (and, on CPU, the interpreter's round-toward-zero
                    # bf16 cast) shift individual elements but not the whole.
                    err = (got.detach().float() - want.float()).norm() / want.detach().float().norm().clamp_min(1e-12)
                    ok = got.shape == want.shape and float(err) < 2e-2
                if not ok:
                    failures.append(f"{tag}: {name}")
    try:
        with kernels.use_backend("triton"):
            x_TH = torch.randn(16, 64, device=device, requires_grad=True)
            expert_ids_TK, splits_ED = _routing(KernelShape("c", 16, 2, 64, 8, 2), device, gen)
            w_TK = torch.rand(16, 2, device=device, requires_grad=True)

            def layer(x, w):
                dest_TK = kernels.assign_destinations(expert_ids_TK, splits_ED)
                _, dst_row_TK, _ = kernels.routing_metadata(expert_ids_TK, dest_TK, 8, 2)
                return kernels.unpermute_combine(torch.tanh(kernels.permute(x, dst_row_TK)), dst_row_TK, w)

            backend = "inductor" if device.type == "cuda" else "aot_eager"
            compiled = torch.compile(layer, backend=backend, fullgraph=True)(x_TH, w_TK)
            grads = torch.autograd.grad(compiled.sum(), (x_TH, w_TK))
            eager = layer(x_TH, w_TK)
            eager_grads = torch.autograd.grad(eager.sum(), (x_TH, w_TK))
            if not torch.allclose(compiled, eager, atol=1e-5) or not all(
                torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, eager_grads)
            ):
                failures.append(f"torch.compile({backend}) differs from eager")
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        failures.append(f"torch.compile: {type(exc).__name__}: {exc}")
    if include_large:
        # row * H beyond 2**31 elements: the last rows must land where the reference puts them.
        num_tokens, top_k, hidden = 40000, 8, 7168
        x_TH = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
        dst_row_TK = torch.randperm(num_tokens * top_k, device=device).view(num_tokens, top_k)
        with kernels.use_backend("triton"):
            send_NH = kernels.permute(x_TH, dst_row_TK)
        tail_rows = dst_row_TK[-4:].flatten()
        if not torch.equal(send_NH[tail_rows], x_TH[-4:].repeat_interleave(top_k, 0)):
            failures.append("int64 offsets: permute rows beyond 2**31 elements are wrong")
        del send_NH, x_TH
    return {"cases": len(cases) * 2 + 1 + int(include_large), "passed": not failures, "failures": failures}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m themis_compile.bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes (the default on CPU)")
    parser.add_argument("--no-check", action="store_true", help="skip the Triton-vs-reference correctness check")
    parser.add_argument("--iters", type=int, default=None, help="timed repetitions (CPU) / rep budget (CUDA)")
    args = parser.parse_args([] if argv is None else argv)

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    quick = args.quick or not on_cuda
    try:
        from themis_compile.kernels import triton_kernels  # noqa: F401

        have_triton = True
    except ImportError:
        have_triton = False
    impls = ["torch", "triton"] if (on_cuda and have_triton) else ["torch"]
    peak = peak_bandwidth_gbps(device)
    iters = args.iters or (3 if quick else 50)
    result: dict = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "path": "triton vs torch reference" if "triton" in impls else "torch reference only (no CUDA); reduced sizes",
        "quick": quick,
        "peak_bandwidth_GBps": peak,
        "torch": torch.__version__,
    }
    if not args.no_check and have_triton:
        result["check"] = check(device, include_large=on_cuda and not args.quick)
    result["shapes"] = [
        bench_shape(shape, device, iters, impls, peak) for shape in (QUICK_SHAPES if quick else FULL_SHAPES)
    ]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
