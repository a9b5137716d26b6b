"""Projection kernels shared by weight signature (options={"projections": ...})."""

import pytest
import torch
from torch import fx, nn

import nmcompile
from nmcompile import ops
from nmcompile.backends import shared_projections as shared_kernels
from nmcompile.backends.inner import Inner


def _cases():
    torch.manual_seed(0)
    for shape in [(16, 32), (16, 8, 3, 3)]:
        w = torch.randn(shape)
        w.view(-1)[:8] = 0.5  # ties
        for dim in range(2):
            perm = torch.randperm(shape[1 - dim])  # over the output axis: the one not reduced
            yield "prune", (w, 2, 4, dim)
            yield "prune", (w, 1, 4, dim)
            yield "prune", (w, 4, 8, dim)
            yield "prune_decay", (w, 2, 4, dim, 0.1)
            yield "prune_when", (w, torch.tensor(True), 2, 4, dim, 0.1)
            yield "prune_when", (w, torch.tensor(False), 2, 4, dim, 0.1)
            yield "soft_threshold", (w, torch.tensor(0.75), 2, 4, dim)
            if len(shape) == 2 or dim == 1:
                yield "backward_mask_weight", (ops.prune(w, 2, 4, dim), perm, 2, 4, dim)


@pytest.mark.slow
@pytest.mark.parametrize("name, args", list(_cases()))
def test_shared_kernel_computes_the_op_body(name, args):
    body = ops.DECOMPOSITIONS[getattr(torch.ops.nmsparse, name).default]
    twin = getattr(torch.ops.nmsparse, f"shared_{name}").default
    torch.testing.assert_close(twin(*args), body(*args), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_shared_kernel_ops_pass_opcheck():
    w = torch.randn(8, 16)
    torch.library.opcheck(torch.ops.nmsparse.shared_prune.default, (w, 2, 4, 1))
    torch.library.opcheck(torch.ops.nmsparse.shared_soft_threshold.default, (w, torch.tensor(1.5), 2, 4, 1))
    torch.library.opcheck(torch.ops.nmsparse.shared_backward_mask_weight.default, (w, torch.randperm(8), 2, 4, 1))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 16))


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("projections, kernels", [("shared", 2), ("auto", 1), ("inline", 0)])
def test_one_kernel_per_weight_signature(projections, kernels):
    """Three [32, 32] weights and one [16, 32]: "shared" compiles a kernel per shape, "auto" one for the
    shape that three weights share (the other is inlined), "inline" none; all compute what eager does."""
    results = {}
    for how in (projections, "eager"):
        model = _model()
        nmcompile.annotate(model, "mdgf:2:4")
        options = {"inner": "eager"} if how == "eager" else {"projections": how}
        compiled = torch.compile(model, backend="nmsparse", options=options)
        shared_kernels._compiled.cache_clear()
        x = torch.randn(8, 32)
        out = compiled(x)
        out.square().mean().backward()
        results[how] = (out.detach(), [p.grad for p in model.parameters()])
        if how != "eager":
            assert shared_kernels._compiled.cache_info().currsize == kernels
    (out, grads), (ref_out, ref_grads) = results[projections], results["eager"]
    torch.testing.assert_close(out, ref_out)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref)


def _projections(shapes):
    graph = fx.Graph()
    outs = []
    for i, shape in enumerate(shapes):
        w = graph.placeholder(f"w{i}")
        w.meta["example_value"] = torch.zeros(shape)
        outs.append(graph.call_function(torch.ops.nmsparse.prune, (w, 2, 4, 1)))
    graph.output(tuple(outs))
    return fx.GraphModule({}, graph)


def test_auto_shares_repeated_signatures_on_the_cpu_without_inductor_settings():
    gm = _projections([(32, 32), (16, 32), (32, 32), (16, 32), (32, 32)])
    cpu, other = [torch.zeros(2)], [torch.zeros(2), torch.zeros(2, device="meta")]
    repeated = shared_kernels.repeated_signatures(gm)
    assert [sig[1][1] for sig in repeated] == [(32, 32)]
    assert Inner().shared_projections(gm, cpu) == tuple(repeated)
    assert Inner().shared_projections(_projections([(32, 32), (16, 32), (32, 32)]), cpu) is None
    assert Inner().shared_projections(gm, other) is None
    assert Inner(patches={"epilogue_fusion": False}).shared_projections(gm, cpu) is None
    assert Inner(patches={"epilogue_fusion": False}, projections="shared").shared_projections(gm, other) == "all"
    assert Inner(projections="inline").shared_projections(gm, cpu) is None
    assert Inner("aot_eager", projections="shared").shared_projections(gm, cpu) is None
