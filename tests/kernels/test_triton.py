"""Triton kernels under Triton's CPU interpreter == torch reference == naive Python loops.

The kernels are built as ``InterpretedFunction``s explicitly for CPU tensors, so no ``TRITON_INTERPRET``
environment variable is needed (nor set) and other tests that use Triton are unaffected. Block sizes are
shrunk so that tiny inputs still span several counting-sort blocks, several scan steps and several
hidden chunks with a ragged tail.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import naive
from tests.kernels.test_reference import CASES
from themis_compile import kernels

triton_kernels = pytest.importorskip("themis_compile.kernels.triton_kernels")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(triton_kernels, "BLOCK_PAIRS", 16)
    monkeypatch.setattr(triton_kernels, "SCAN_BLOCKS", 2)
    monkeypatch.setattr(triton_kernels, "SCAN_GROUPS", 8)
    monkeypatch.setattr(triton_kernels, "MAX_BLOCK_H", 16)


def _both(fn, *args):
    """(triton result, reference result) of a public kernels function."""
    with kernels.use_backend("triton"):
        got = fn(*args)
    with kernels.use_backend("torch"):
        want = fn(*args)
    return got, want


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}D{}H{}idle{}".format(*c))
def test_routing_kernels_match(case):
    num_tokens, top_k, num_experts, num_dests, _, idle = case
    gen = torch.Generator().manual_seed(sum(case))
    expert_ids_TK, splits_ED = naive.random_routing(num_tokens, top_k, num_experts, num_dests, gen, idle)
    dest_TK, dest_ref_TK = _both(kernels.assign_destinations, expert_ids_TK, splits_ED)
    assert torch.equal(dest_TK, dest_ref_TK)
    assert torch.equal(dest_TK, naive.assign_destinations(expert_ids_TK, splits_ED))
    got, want = _both(kernels.routing_metadata, expert_ids_TK, dest_TK, num_experts, num_dests)
    loops = naive.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
    for g, w, n in zip(got, want, loops):
        assert g.dtype == torch.int64 and torch.equal(g, w) and torch.equal(g, n)


def test_routing_metadata_many_blocks_and_groups():
    # 300 pairs over 19 blocks of 16 and 4 * 37 groups, most of them empty: exercises the block scan.
    gen = torch.Generator().manual_seed(3)
    expert_ids_TK = torch.randint(0, 37, (100, 3), generator=gen)
    dest_TK = torch.randint(0, 4, (100, 3), generator=gen)
    got, want = _both(kernels.routing_metadata, expert_ids_TK, dest_TK, 37, 4)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _grads(backend, x_TH, dst_row_TK, grad_send_NH, y_NH, weights_TK, grad_out_TH, out_dtype=None):
    with kernels.use_backend(backend):
        x_TH = x_TH.detach().requires_grad_()
        y_NH = y_NH.detach().requires_grad_()
        weights_TK = weights_TK.detach().requires_grad_()
        send_NH = kernels.permute(x_TH, dst_row_TK, out_dtype=out_dtype)
        (grad_x_TH,) = torch.autograd.grad(send_NH, x_TH, grad_send_NH.to(send_NH.dtype))
        out_TH = kernels.unpermute_combine(y_NH, dst_row_TK, weights_TK)
        grad_y_NH, grad_w_TK = torch.autograd.grad(out_TH, (y_NH, weights_TK), grad_out_TH)
    return send_NH, grad_x_TH, out_TH, grad_y_NH, grad_w_TK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}D{}H{}idle{}".format(*c))
def test_permute_combine_kernels_match(case, dtype):
    num_tokens, top_k, num_experts, num_dests, hidden, idle = case
    gen = torch.Generator().manual_seed(11 * sum(case))
    expert_ids_TK, splits_ED = naive.random_routing(num_tokens, top_k, num_experts, num_dests, gen, idle)
    dest_TK = naive.assign_destinations(expert_ids_TK, splits_ED)
    _, dst_row_TK, _ = naive.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
    num_rows = dst_row_TK.numel()
    x_TH = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    grad_send_NH = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    y_NH = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    weights_TK = torch.rand(dst_row_TK.shape, generator=gen)
    grad_out_TH = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    args = (x_TH, dst_row_TK, grad_send_NH, y_NH, weights_TK, grad_out_TH)
    send, grad_x, out, grad_y, grad_w = _grads("triton", *args)
    send_r, grad_x_r, out_r, grad_y_r, grad_w_r = _grads("torch", *args)

    # Pure copies are bit-exact; fp32-accumulated sums agree to rounding of the output dtype.
    assert torch.equal(send, send_r) and torch.equal(send, naive.permute(x_TH, dst_row_TK))
    for got, want in ((grad_x, grad_x_r), (out, out_r), (grad_y, grad_y_r), (grad_w, grad_w_r)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_x.double(), naive.permute_grad(grad_send_NH, dst_row_TK), **tol)
    torch.testing.assert_close(out.double(), naive.unpermute_combine(y_NH, dst_row_TK, weights_TK), **tol)
    want_y, want_w = naive.combine_grads(grad_out_TH, y_NH, dst_row_TK, weights_TK)
    torch.testing.assert_close(grad_y.double(), want_y, **tol)
    torch.testing.assert_close(grad_w.double(), want_w, **tol)


def test_permute_cast_and_padding_rows():
    gen = torch.Generator().manual_seed(5)
    x_TH = torch.randn(7, 37, generator=gen)
    dst_row_TK = torch.randperm(21, generator=gen).view(7, 3)
    got, want = _both(kernels.permute, x_TH, dst_row_TK, 25, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (25, 37)
    assert torch.equal(got[21:], torch.zeros(4, 37, dtype=torch.bfloat16))
    # Triton's interpreter rounds fp32 -> bf16 toward zero (CUDA rounds to nearest): allow one ulp.
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=0)
    y_NH = torch.randn(25, 37, generator=gen)
    weights_TK = torch.rand(7, 3, generator=gen)
    grad_out_TH = torch.randn(7, 37, generator=gen)
    with kernels.use_backend("triton"):
        grad_y_NH, grad_w_TK = torch.ops.themis.unpermute_combine_backward(grad_out_TH, y_NH, dst_row_TK, weights_TK)
    with kernels.use_backend("torch"):
        grad_y_r, grad_w_r = torch.ops.themis.unpermute_combine_backward(grad_out_TH, y_NH, dst_row_TK, weights_TK)
    assert torch.equal(grad_y_NH[21:], torch.zeros(4, 37))
    torch.testing.assert_close(grad_y_NH, grad_y_r)
    torch.testing.assert_close(grad_w_TK, grad_w_r)


def test_kernel_offsets_are_int64():
    # row * H can exceed 2**31 (16k tokens * top-8 * 7168 hidden); the interpreter computes addresses in
    # int64 whatever the kernel does, so this is checked on the source: every program id is widened first.
    import inspect
    import re

    kernels_src = [
        inspect.getsource(getattr(triton_kernels, name)) for name in dir(triton_kernels) if name.endswith("_kernel")
    ]
    assert len(kernels_src) == 7
    for src in kernels_src:
        ids = re.findall(r"tl\.program_id\(\d\)(\.to\(tl\.int64\))?", src)
        assert ids and all(ids), src.splitlines()[0]
