"""Each public kernels function is one ``themis::*`` node under ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import operator

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from themis_compile import kernels

THEMIS = torch.ops.themis


def _dynamo_graph(fn, *args, dynamic=False):
    """Compile ``fn`` with a backend that records the single dynamo graph; return (graph module, output)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=record, fullgraph=True, dynamic=dynamic)(*args)
    assert len(graphs) == 1
    return graphs[0], out


def _calls(gm) -> list:
    """Targets of the tensor-producing calls (size arithmetic on symbolic shapes and getitem left out)."""

    def makes_tensor(node) -> bool:
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else (value,)
        return any(isinstance(v, torch.Tensor) for v in values)

    return [
        n.target
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and n.target is not operator.getitem
        and makes_tensor(n)
    ]


def _routing_inputs():
    expert_ids_TK = torch.tensor([[2, 0], [1, 2], [0, 3]])
    splits_ED = torch.tensor([[1, 1], [0, 1], [2, 0], [0, 1]])
    return expert_ids_TK, splits_ED


@pytest.mark.parametrize("dynamic", [False, True])
def test_each_op_is_one_node(dynamic):
    expert_ids_TK, splits_ED = _routing_inputs()
    gm, dest_TK = _dynamo_graph(kernels.assign_destinations, expert_ids_TK, splits_ED, dynamic=dynamic)
    assert _calls(gm) == [THEMIS.assign_destinations.default]
    assert torch.equal(dest_TK, kernels.assign_destinations(expert_ids_TK, splits_ED))

    def routing(e, d):
        return kernels.routing_metadata(e, d, 4, 2)

    gm, (counts_DE, dst_row_TK, _) = _dynamo_graph(routing, expert_ids_TK, dest_TK, dynamic=dynamic)
    assert _calls(gm) == [THEMIS.routing_metadata.default]
    assert torch.equal(counts_DE.T, splits_ED)

    x_TH = torch.randn(3, 5)
    gm, send_NH = _dynamo_graph(lambda x, r: kernels.permute(x, r, out_dtype=torch.bfloat16), x_TH, dst_row_TK,
                                dynamic=dynamic)
    assert _calls(gm) == [THEMIS.permute.default]
    assert send_NH.dtype == torch.bfloat16 and send_NH.shape == (6, 5)

    weights_TK = torch.rand(3, 2)
    gm, out_TH = _dynamo_graph(kernels.unpermute_combine, send_NH.float(), dst_row_TK, weights_TK, dynamic=dynamic)
    assert _calls(gm) == [THEMIS.unpermute_combine.default]
    torch.testing.assert_close(out_TH, kernels.unpermute_combine(send_NH.float(), dst_row_TK, weights_TK))


def _dispatch_combine(x_TH, expert_ids_TK, splits_ED, weights_TK, scale_H):
    dest_TK = kernels.assign_destinations(expert_ids_TK, splits_ED)
    _, dst_row_TK, _ = kernels.routing_metadata(expert_ids_TK, dest_TK, 4, 2)
    send_NH = kernels.permute(x_TH, dst_row_TK)
    return kernels.unpermute_combine(torch.tanh(send_NH * scale_H), dst_row_TK, weights_TK)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_backward_graph_calls_backward_ops(impl):
    fw_graphs, bw_graphs = [], []

    def compiler(graphs):
        def fn(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return fn

    backend = aot_autograd(fw_compiler=compiler(fw_graphs), bw_compiler=compiler(bw_graphs))
    expert_ids_TK, splits_ED = _routing_inputs()
    x_TH = torch.randn(3, 5, requires_grad=True)
    weights_TK = torch.rand(3, 2, requires_grad=True)
    scale_H = torch.randn(5)
    torch._dynamo.reset()
    with kernels.use_backend(impl):  # the op bodies run the interpreted Triton kernels for "triton"
        out_TH = torch.compile(_dispatch_combine, backend=backend, fullgraph=True)(
            x_TH, expert_ids_TK, splits_ED, weights_TK, scale_H
        )
        grads = torch.autograd.grad(out_TH.square().sum(), (x_TH, weights_TK))
    eager_out = _dispatch_combine(x_TH, expert_ids_TK, splits_ED, weights_TK, scale_H)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), (x_TH, weights_TK))
    torch.testing.assert_close(out_TH, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)

    def count(graphs, op):
        return sum(n.target is op for gm in graphs for n in gm.graph.nodes)

    for op in ("assign_destinations", "routing_metadata", "permute", "unpermute_combine"):
        assert count(fw_graphs, getattr(THEMIS, op).default) == 1, op
    assert count(bw_graphs, THEMIS.permute_backward.default) == 1
    assert count(bw_graphs, THEMIS.unpermute_combine_backward.default) == 1


def test_inductor_matches_eager():
    expert_ids_TK, splits_ED = _routing_inputs()
    x_TH = torch.randn(3, 5, requires_grad=True)
    weights_TK = torch.rand(3, 2, requires_grad=True)
    scale_H = torch.randn(5)
    torch._dynamo.reset()
    compiled = torch.compile(_dispatch_combine, backend="inductor", fullgraph=True)
    out_TH = compiled(x_TH, expert_ids_TK, splits_ED, weights_TK, scale_H)
    grads = torch.autograd.grad(out_TH.sum(), (x_TH, weights_TK))
    eager_out = _dispatch_combine(x_TH, expert_ids_TK, splits_ED, weights_TK, scale_H)
    eager_grads = torch.autograd.grad(eager_out.sum(), (x_TH, weights_TK))
    torch.testing.assert_close(out_TH, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


def _opcheck_cases():
    expert_ids_TK, splits_ED = _routing_inputs()
    dest_TK = kernels.assign_destinations(expert_ids_TK, splits_ED)
    _, dst_row_TK, _ = kernels.routing_metadata(expert_ids_TK, dest_TK, 4, 2)
    x_TH = torch.randn(3, 5, requires_grad=True)
    y_NH = torch.randn(6, 5, requires_grad=True)
    weights_TK = torch.rand(3, 2, requires_grad=True)
    return [
        (THEMIS.assign_destinations.default, (expert_ids_TK, splits_ED)),
        (THEMIS.routing_metadata.default, (expert_ids_TK, dest_TK, 4, 2)),
        (THEMIS.permute.default, (x_TH, dst_row_TK, 6, None)),
        (THEMIS.permute.default, (x_TH, dst_row_TK, 8, torch.bfloat16)),
        (THEMIS.permute_backward.default, (y_NH.detach(), dst_row_TK, torch.float32)),
        (THEMIS.unpermute_combine.default, (y_NH, dst_row_TK, weights_TK)),
        (THEMIS.unpermute_combine_backward.default, (x_TH.detach(), y_NH.detach(), dst_row_TK, weights_TK.detach())),
    ]


@pytest.mark.parametrize("index", range(7))
def test_opcheck(index):
    op, args = _opcheck_cases()[index]
    torch.library.opcheck(op, args)
