"""The torch reference path (the CPU default) against naive Python loops, plus input validation."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import naive
from themis_compile import kernels
from themis_compile.kernels import reference

# (T, K, E, D, H, idle experts): top-k 1..8, experts and destinations with zero tokens, one token, no token.
CASES = [
    (1, 1, 4, 2, 5, 0),
    (0, 2, 4, 3, 6, 0),
    (9, 2, 6, 3, 17, 2),
    (23, 4, 10, 4, 40, 3),
    (13, 8, 12, 2, 33, 2),
    (31, 3, 5, 5, 24, 1),
    (17, 6, 9, 3, 9, 0),
    (11, 5, 7, 2, 18, 1),
    (6, 7, 8, 3, 20, 0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}D{}H{}idle{}".format(*c))
def test_routing_matches_naive(case):
    num_tokens, top_k, num_experts, num_dests, _, idle = case
    gen = torch.Generator().manual_seed(sum(case))
    expert_ids_TK, splits_ED = naive.random_routing(num_tokens, top_k, num_experts, num_dests, gen, idle)
    dest_TK = kernels.assign_destinations(expert_ids_TK, splits_ED)
    assert torch.equal(dest_TK, naive.assign_destinations(expert_ids_TK, splits_ED))
    got = kernels.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
    want = naive.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and torch.equal(g, w)
    counts_DE = got[0]
    assert torch.equal(counts_DE.sum(0), torch.bincount(expert_ids_TK.flatten(), minlength=num_experts))
    assert torch.equal(counts_DE.T, torch.stack([splits_ED[:, d] for d in range(num_dests)], 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}D{}H{}idle{}".format(*c))
def test_permute_combine_forward_backward_match_naive(case, dtype):
    num_tokens, top_k, num_experts, num_dests, hidden, idle = case
    gen = torch.Generator().manual_seed(7 * sum(case))
    expert_ids_TK, splits_ED = naive.random_routing(num_tokens, top_k, num_experts, num_dests, gen, idle)
    dest_TK = naive.assign_destinations(expert_ids_TK, splits_ED)
    _, dst_row_TK, _ = naive.routing_metadata(expert_ids_TK, dest_TK, num_experts, num_dests)
    k_eff = dst_row_TK.shape[1]
    x_TH = torch.randn(num_tokens, hidden, generator=gen).to(dtype).requires_grad_()
    send_NH = kernels.permute(x_TH, dst_row_TK)
    assert torch.equal(send_NH, naive.permute(x_TH.detach(), dst_row_TK))
    grad_send_NH = torch.randn(send_NH.shape, generator=gen).to(dtype)
    (grad_x_TH,) = torch.autograd.grad(send_NH, x_TH, grad_send_NH)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_x_TH.double(), naive.permute_grad(grad_send_NH, dst_row_TK), **tol)

    y_NH = torch.randn(num_tokens * k_eff, hidden, generator=gen).to(dtype).requires_grad_()
    weights_TK = torch.rand(num_tokens, k_eff, generator=gen).requires_grad_()
    out_TH = kernels.unpermute_combine(y_NH, dst_row_TK, weights_TK)
    assert out_TH.dtype == dtype
    want_TH = naive.unpermute_combine(y_NH.detach(), dst_row_TK, weights_TK.detach())
    torch.testing.assert_close(out_TH.double(), want_TH, **tol)
    grad_out_TH = torch.randn(out_TH.shape, generator=gen).to(dtype)
    grad_y_NH, grad_w_TK = torch.autograd.grad(out_TH, (y_NH, weights_TK), grad_out_TH)
    want_y, want_w = naive.combine_grads(grad_out_TH, y_NH.detach(), dst_row_TK, weights_TK.detach())
    torch.testing.assert_close(grad_y_NH.double(), want_y, **tol)
    torch.testing.assert_close(grad_w_TK.double(), want_w, **tol)


def test_permute_casts_and_pads_extra_rows():
    x_TH = torch.randn(3, 4)
    dst_row_TK = torch.tensor([[4, 0], [1, 2], [3, 5]])
    send_NH = kernels.permute(x_TH, dst_row_TK, num_rows=8, out_dtype=torch.bfloat16)
    assert send_NH.shape == (8, 4) and send_NH.dtype == torch.bfloat16
    assert torch.equal(send_NH[6:], torch.zeros(2, 4, dtype=torch.bfloat16))
    assert torch.equal(send_NH[:6], naive.permute(x_TH, dst_row_TK, torch.bfloat16))
    # Combine reads only the referenced rows; the gradient of unreferenced rows is zero.
    y_NH = torch.randn(8, 4, requires_grad=True)
    out_TH = kernels.unpermute_combine(y_NH, dst_row_TK, torch.ones(3, 2))
    out_TH.sum().backward()
    assert torch.equal(y_NH.grad[6:], torch.zeros(2, 4)) and torch.equal(y_NH.grad[:6], torch.ones(6, 4))


def test_permute_gradient_returns_input_dtype():
    x_TH = torch.randn(5, 3, requires_grad=True)
    dst_row_TK = torch.randperm(10).view(5, 2)
    send_NH = kernels.permute(x_TH, dst_row_TK, out_dtype=torch.bfloat16)
    send_NH.float().sum().backward()
    assert x_TH.grad.dtype == torch.float32 and torch.equal(x_TH.grad, torch.full((5, 3), 2.0))


def test_assign_destinations_rejects_inconsistent_splits():
    expert_ids_TK = torch.tensor([[0, 1], [1, 2]])
    splits_ED = torch.tensor([[1, 0], [1, 0], [0, 0]])  # expert 1 has 2 pairs, expert 2 has 1
    with pytest.raises(ValueError, match="experts \\[1, 2\\]"):
        kernels.assign_destinations(expert_ids_TK, splits_ED)


def test_public_api_rejects_bad_shapes_and_dtypes():
    x_TH, rows_TK = torch.randn(3, 4), torch.arange(6).view(3, 2)
    with pytest.raises(ValueError, match="integer"):
        kernels.permute(x_TH, rows_TK.float())
    with pytest.raises(ValueError, match="tokens"):
        kernels.permute(x_TH, rows_TK[:2])
    with pytest.raises(ValueError, match="num_rows"):
        kernels.permute(x_TH, rows_TK, num_rows=5)
    with pytest.raises(ValueError, match="differ"):
        kernels.unpermute_combine(torch.randn(6, 4), rows_TK, torch.ones(3, 3))
    with pytest.raises(ValueError, match="fewer"):
        kernels.unpermute_combine(torch.randn(5, 4), rows_TK, torch.ones(3, 2))
    with pytest.raises(ValueError, match="differ"):
        kernels.routing_metadata(rows_TK, rows_TK[:, :1], 4, 2)
    with pytest.raises(ValueError, match="positive"):
        kernels.routing_metadata(rows_TK, rows_TK, 0, 2)


def test_backend_selection(monkeypatch):
    assert kernels.get_backend() == "auto"
    with pytest.raises(ValueError, match="unknown"):
        kernels.set_backend("cuda")
    with kernels.use_backend("torch"):
        assert kernels.get_backend() == "torch"
    assert kernels.get_backend() == "auto"
    # "auto" on CPU tensors runs the reference, never the (interpreted) Triton kernels.
    from themis_compile.kernels import triton_kernels

    def boom(*args, **kwargs):
        raise AssertionError("triton path taken on CPU under 'auto'")

    monkeypatch.setattr(triton_kernels, "permute", boom)
    x_TH, rows_TK = torch.randn(2, 3), torch.tensor([[1], [0]])
    assert torch.equal(kernels.permute(x_TH, rows_TK), x_TH.flip(0))
    with kernels.use_backend("triton"), pytest.raises(AssertionError, match="triton path"):
        kernels.permute(x_TH, rows_TK)
    assert torch.equal(reference.permute(x_TH, rows_TK, 2), x_TH.flip(0))


def test_backend_per_call_overrides_the_process_default(monkeypatch):
    """``backend=`` picks the implementation of one call, forward and backward, whatever the process
    default is: a model's runtime passes its ThemisConfig.kernels and needs no global setter."""
    from themis_compile.kernels import triton_kernels

    taken = []
    for name in ("permute", "permute_backward", "unpermute_combine", "unpermute_combine_backward"):
        def spy(*args, _name=name, _real=getattr(reference, name), **kwargs):
            taken.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(triton_kernels, name, spy)
    x_TH = torch.randn(3, 4, requires_grad=True)
    rows_TK = torch.tensor([[1, 4], [0, 5], [2, 3]])
    weights_TK = torch.rand(3, 2, requires_grad=True)

    def run(**kw):
        send_NH = kernels.permute(x_TH, rows_TK, **kw)
        out_TH = kernels.unpermute_combine(torch.tanh(send_NH), rows_TK, weights_TK, **kw)
        return torch.autograd.grad(out_TH.square().sum(), (x_TH, weights_TK))

    want = run()                                            # "auto" on CPU: the reference
    assert taken == []
    got = run(backend="triton")                             # the triton path, both directions
    assert sorted(taken) == ["permute", "permute_backward", "unpermute_combine", "unpermute_combine_backward"]
    torch.testing.assert_close(got, want)
    taken.clear()
    with kernels.use_backend("triton"):                     # the call's choice wins over the default
        run(backend="torch")
    assert taken == []
    with pytest.raises(ValueError, match="unknown"):
        kernels.permute(x_TH, rows_TK, backend="cuda")
    with pytest.raises(ValueError, match="unknown"):
        kernels.set_backend(None)
