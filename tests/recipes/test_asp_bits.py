"""ASP with ``bits=8``/``bits=4``: the forward weight is the masked weight rounded onto the packed formats' grids
(checked against the grids' definitions), the gradient passes straight through the rounding and is masked, the
compiled graph computes the same values, finalize bakes them and records their grids, and the packed model serves
exactly the values that were trained."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nmcompile
from nmcompile.recipes import parse

from reference import int4_groups, int8_rows, topn_mask


def _reference(w, bits, group, dim):
    """The masked weight ``w`` rounded to its grids, from the definitions in ``reference.py``."""
    rows = w if dim == 1 else w.t()
    if bits == 8:
        codes, s = int8_rows(rows)
        out = codes * s[:, None]
    else:
        codes, d = int4_groups(rows, group)
        out = codes * d.repeat_interleave(group, dim=1)
    out = out.to(w.dtype)
    return out if dim == 1 else out.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 128)])
def test_the_forward_weight_is_the_masked_weight_on_its_grid_and_the_gradient_is_masked(bits, group, dim, dtype):
    torch.manual_seed(0)
    w = (torch.randn(48, 256) if dim == 1 else torch.randn(256, 48)).to(dtype)
    w[3] = 0  # a row (dim 1) or column (dim 0) of zeros: scale 1 or 0, codes 0
    w.requires_grad_(True)
    recipe = parse(f"asp:2:4,permute=0,bits={bits},group={group}")
    (mask,) = recipe.init_state(w.detach(), dim).values()
    out = recipe.project(w, mask, dim=dim)
    expected = _reference(w.detach() * topn_mask(w.detach().float(), 2, 4, dim).to(dtype), bits, group, dim)
    assert out.dtype == dtype and torch.equal(out.detach(), expected)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert torch.equal(w.grad, upstream * mask.to(dtype))  # straight through the rounding, masked
    grid = recipe.grid(w.detach(), mask, dim=dim)
    rows = w.shape[0] if dim == 1 else w.shape[1]
    assert grid.shape == ((rows,) if bits == 8 else (rows, 256 // group))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bits", [8, 4])
def test_trained_values_are_the_values_the_packed_model_serves(bits, inner):
    """Compiled training rounds as the eager recipe does; finalize bakes the rounded weight and records its grid;
    ``pack_weights`` keeps that grid (no second rounding) and the packed model computes what the trained one did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))
    nmcompile.annotate(model, f"asp:2:4,permute=0,bits={bits}")
    compiled = torch.compile(model, backend="nmsparse", options={"inner": inner})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 128)
    for _ in range(3):
        loss = compiled(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        trained = compiled(x)
        layer = model[0]
        eager = parse(f"asp:2:4,permute=0,bits={bits}").project(layer.weight, layer.weight_nm_mask, dim=1)
    report = nmcompile.finalize(model)
    assert "bits=" + str(bits) in str(report)
    assert torch.equal(model[0].weight.detach(), eager)
    assert torch.allclose(model(x), trained, atol=1e-6, rtol=0)
    baked = [m.weight.detach().clone() for m in (model[0], model[2])]
    if bits == 4 and "avx2" not in nmcompile.kernels.cpu24.isas():
        pytest.skip("4-bit packed weights need the avx2 kernel")
    if not nmcompile.kernels.cpu24.status().available:
        pytest.skip("the 2:4 CPU kernel is not built here")
    decisions = nmcompile.deploy.pack_weights(model)
    width = "int8" if bits == 8 else "4-bit"
    assert all(f"the recorded {width} grid" in d.reason for d in decisions.values())
    for m, w in zip((model[0], model[2]), baked):
        assert m.weight.quantized and torch.equal(m.weight.dense().float(), w)
    # int8 values run with float activations; 4-bit values only on the int8-activation route (activations rounded
    # to int8 in blocks of 32: about 1% of a product)
    tol = 1e-4 if bits == 8 else 3e-2
    assert torch.allclose(model(x), trained, atol=tol, rtol=tol)


def test_weights_the_grids_cannot_hold_are_named_and_bad_keys_refused():
    model = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 64))
    report = nmcompile.annotate(model, "asp:2:4,permute=0,bits=4")
    assert list(report.annotated) == ["1.weight"]
    assert "bits=4 needs its reduction length (96) to be a multiple of group=64" in report.skipped["0.weight"]
    with pytest.raises(ValueError, match=r"asp: bits=3 is not supported; bits=8 puts"):
        parse("asp:2:4,bits=3")
    with pytest.raises(ValueError, match=r"asp: group=32 is not supported; a 4-bit scale covers 64 or 128"):
        parse("asp:2:4,bits=4,group=32")
    experts = parse("asp:2:4,bits=8")
    assert "bits=8 rounds output rows of a 2-D weight; this one is 3-D" in experts.fits(torch.randn(2, 8, 64), 2)
