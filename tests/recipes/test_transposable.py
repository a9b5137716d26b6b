"""Transposable N:M masks, checked against references computed here from scratch.

Optima come from brute force over all valid 4x4 patterns (2:4) and, where scipy is installed, from
a linear program over the b-matching polytope, whose vertices are integral.
"""

import copy
import functools
import itertools

import numpy as np
import pytest
import torch

import nmcompile
from nmcompile.masks import transposable as tp
from nmcompile.masks import transposable_exact as tpx
from nmcompile.masks.transposable import is_transposable, tile_counts, transposable_mask

try:
    from scipy.optimize import linprog
except ImportError:  # pragma: no cover - scipy comes with scikit-learn in the dev extras
    linprog = None

needs_scipy = pytest.mark.skipif(linprog is None, reason="scipy is not installed")

METHODS = ["exact", "greedy", "auto"]


# ----------------------------------------------------------------------------- independent helpers


def tiles_of(x, m):
    """The m x m tiles of x (axes 0, 1), each [m, m], trailing axes flattened into the tile list."""
    r, c = x.shape[:2]
    flat = x.reshape(r, c, -1)
    corners = itertools.product(range(0, r, m), range(0, c, m), range(flat.shape[2]))
    return [flat[i : i + m, j : j + m, k] for i, j, k in corners]


def kept(w, mask, m):
    """Kept magnitude per tile, float64."""
    values = [(a.double().abs() * k).sum().item() for a, k in zip(tiles_of(w, m), tiles_of(mask, m))]
    return torch.tensor(values, dtype=torch.float64)


def assert_valid(mask, n, m):
    assert mask.dtype == torch.bool
    r, c, *rest = mask.shape
    grid = mask.reshape(r // m, m, c // m, m, *rest).long()
    assert (grid.sum(1) == n).all(), "a tile column does not hold exactly n"
    assert (grid.sum(3) == n).all(), "a tile row does not hold exactly n"


@functools.lru_cache(maxsize=None)
def two_per_line_4x4():
    """Every 8-of-16 subset of a 4x4 grid with two cells in each row and column, [P, 16] float64."""
    found = []
    for cells in itertools.combinations(range(16), 8):
        flat = [1.0 if k in cells else 0.0 for k in range(16)]
        rows_ok = all(sum(flat[4 * i : 4 * i + 4]) == 2 for i in range(4))
        if rows_ok and all(sum(flat[j::4]) == 2 for j in range(4)):
            found.append(flat)
    return torch.tensor(found, dtype=torch.float64)


def brute_force_2_4(tile):
    """(kept magnitude, mask) of every valid 2:4 tile pattern, best first."""
    patterns = two_per_line_4x4()
    scores = patterns @ tile.double().abs().reshape(16)
    order = scores.argsort(descending=True, stable=True)
    return [(scores[k].item(), patterns[k].reshape(4, 4).bool()) for k in order]


def lp_optimum(tile, n):
    """max sum |w| x over 0 <= x <= 1 with n per row and column (HiGHS): value and rounded x."""
    a = tile.double().abs().numpy()
    m = a.shape[0]
    eq = np.zeros((2 * m, m * m))
    for i in range(m):
        eq[i, i * m : (i + 1) * m] = 1  # row i
        eq[m + i, i::m] = 1  # column i
    res = linprog(-a.reshape(-1), A_eq=eq, b_eq=np.full(2 * m, n), bounds=(0, 1), method="highs")
    assert res.status == 0
    return -res.fun, np.round(res.x).reshape(m, m)


def plain_greedy(tile, n):
    """Decreasing |w| (row-major on ties), take while row and column hold fewer than n; no repair."""
    m = tile.shape[0]
    a = tile.abs().reshape(-1).tolist()
    order = sorted(range(m * m), key=lambda k: (-a[k], k))
    keep = torch.zeros(m, m, dtype=torch.bool)
    for k in order:
        i, j = divmod(k, m)
        if keep[i].sum() < n and keep[:, j].sum() < n:
            keep[i, j] = True
    return keep


def weights(kind, shape, gen):
    if kind == "normal":
        return torch.randn(shape, generator=gen)
    if kind == "heavy":  # magnitudes over many orders of magnitude
        return torch.randn(shape, generator=gen).mul(3).exp()
    if kind == "ties":
        return torch.randint(-2, 3, shape, generator=gen).float()
    if kind == "sparse":
        return torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.3)
    raise AssertionError(kind)


# ----------------------------------------------------------------------------- the 2:4 table


def test_2_4_table_is_all_90_patterns():
    table = tpx.pattern_table(2, 4)
    assert table.shape == (90, 16)
    rows = {tuple(p.tolist()) for p in table.int()}
    assert len(rows) == 90, "patterns repeat"
    grid = table.reshape(-1, 4, 4).int()
    assert (grid.sum(1) == 2).all() and (grid.sum(2) == 2).all()
    # independently: every 8-of-16 subset with two per row and column
    expected = {tuple(int(v) for v in p.tolist()) for p in two_per_line_4x4()}
    assert len(expected) == 90
    assert rows == expected


def test_2_4_exact_reaches_every_pattern():
    # a tile equal to a pattern has that pattern as its unique optimum (8 against at most 7)
    table = tpx.pattern_table(2, 4).reshape(-1, 4, 4)
    w = torch.cat(list(table.float()), dim=1)  # [4, 4 * 90]
    got = transposable_mask(w, 2, 4, "exact")
    assert torch.equal(got, w.bool())


# ----------------------------------------------------------------------------- validity


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4), (2, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse"])
def test_every_tile_keeps_n_per_row_and_column(n, m, method, kind):
    gen = torch.Generator().manual_seed(1)
    for shape in [(2 * m, 3 * m), (16, 16, 3, 3)]:
        w = weights(kind, shape, gen)
        mask = transposable_mask(w, n, m, method)
        assert mask.shape == w.shape and mask.device == w.device
        assert_valid(mask, n, m)
        assert is_transposable(mask, n, m)


@pytest.mark.parametrize("method", METHODS)
def test_all_zero_and_low_precision_weights(method):
    for n, m in [(2, 4), (4, 8), (3, 8)]:
        zero = torch.zeros(2 * m, 2 * m)
        assert_valid(transposable_mask(zero, n, m, method), n, m)
        w = torch.randn(2 * m, 4 * m, generator=torch.Generator().manual_seed(2))
        for dtype in (torch.float16, torch.bfloat16):
            low = w.to(dtype)  # same values in float32 give the same mask
            mask = transposable_mask(low, n, m, method)
            assert_valid(mask, n, m)
            assert torch.equal(mask, transposable_mask(low.float(), n, m, method))


def test_ties_are_broken_the_documented_way():
    zero = torch.zeros(4, 4)
    # exact: the first table pattern, rows taking columns (0, 1), (0, 1), (2, 3), (2, 3)
    first = tpx.pattern_table(2, 4)[0].reshape(4, 4)
    assert torch.equal(transposable_mask(zero, 2, 4, "exact"), first)
    assert first[:, :2].all(1).tolist() == [True, True, False, False]
    # greedy: row-major visiting order, the same picture
    assert torch.equal(transposable_mask(zero, 2, 4, "greedy"), first)
    w = torch.randint(0, 3, (32, 32), generator=torch.Generator().manual_seed(3)).float()
    for method in METHODS:
        assert torch.equal(transposable_mask(w, 4, 8, method), transposable_mask(w.clone(), 4, 8, method))


# ----------------------------------------------------------------------------- optimality


def test_2_4_exact_equals_brute_force():
    gen = torch.Generator().manual_seed(4)
    cases = [torch.randn(8, 12, generator=gen), torch.randn(4, 8, 3, generator=gen)]
    cases.append(weights("heavy", (8, 8), gen))
    for w in cases:
        mask = transposable_mask(w, 2, 4, "exact")
        assert torch.equal(mask, transposable_mask(w, 2, 4, "auto"))
        for tile, got in zip(tiles_of(w, 4), tiles_of(mask, 4)):
            ranked = brute_force_2_4(tile)
            best, best_mask = ranked[0]
            value = (tile.double().abs() * got).sum().item()
            assert value == pytest.approx(best, rel=1e-9)
            if best - ranked[1][0] > 1e-6 * best:  # unique optimum: the same mask
                assert torch.equal(got, best_mask)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_flow_solver_equals_table_on_4x4(n):
    # the general solver against the enumeration, with ties (integer weights) and without
    gen = torch.Generator().manual_seed(5)
    for a in [torch.rand(400, 4, 4, generator=gen), torch.randint(0, 3, (400, 4, 4), generator=gen).float()]:
        flow, table = tpx._exact_by_flow(a, n), tpx._exact_by_table(a, n)
        assert (flow.sum(1) == n).all() and (flow.sum(2) == n).all()
        kept_flow, kept_table = (a.double() * flow).sum((1, 2)), (a.double() * table).sum((1, 2))
        torch.testing.assert_close(kept_flow, kept_table, rtol=1e-12, atol=0)


@needs_scipy
@pytest.mark.parametrize("n,m", [(4, 8), (2, 8), (3, 6), (1, 8), (6, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties"])
def test_exact_equals_lp_optimum(n, m, kind):
    w = weights(kind, (3 * m, 2 * m), torch.Generator().manual_seed(6))
    mask = transposable_mask(w, n, m, "exact")
    assert_valid(mask, n, m)
    got = kept(w, mask, m)
    for tile, value in zip(tiles_of(w, m), got.tolist()):
        optimum, vertex = lp_optimum(tile, n)
        assert value == pytest.approx(optimum, rel=1e-7, abs=1e-9)  # HiGHS is accurate to ~1e-7
        if (vertex.sum(0) == n).all() and (vertex.sum(1) == n).all():  # the integral vertex itself
            assert value >= (tile.double().abs().numpy() * vertex).sum() * (1 - 1e-12)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (2, 8), (3, 6), (8, 16)], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "sparse"])
def test_greedy_keeps_at_least_half_of_the_optimum(n, m, kind):
    gen = torch.Generator().manual_seed(7)
    w = weights(kind, (4 * m, 4 * m) if m < 16 else (2 * m, 2 * m), gen)
    greedy, exact = transposable_mask(w, n, m, "greedy"), transposable_mask(w, n, m, "exact")
    assert_valid(greedy, n, m)
    g, e = kept(w, greedy, m), kept(w, exact, m)
    tol = 1e-9 * e.clamp_min(1e-30)
    assert (g >= 0.5 * e - tol).all()
    assert (g <= e + tol).all()  # the exact mask is at least as good, tile by tile


def test_greedy_repairs_a_stuck_tile():
    # rows 0-2 x columns 0-2 hold a 6-cycle of large entries, (3, 3) comes next: the plain
    # greedy fills rows/columns 0-2 and leaves row 3 and column 3 with one entry each
    w = torch.tensor(
        [
            [16.0, 15.0, 1.0, 2.0],
            [3.0, 14.0, 13.0, 4.0],
            [11.0, 5.0, 12.0, 6.0],
            [7.0, 8.0, 9.0, 10.0],
        ]
    )
    stuck = plain_greedy(w, 2)
    assert stuck.sum(0).tolist() == [2, 2, 2, 1] and stuck.sum(1).tolist() == [2, 2, 2, 1]
    mask = transposable_mask(w, 2, 4, "greedy")
    assert_valid(mask, 2, 4)
    best = brute_force_2_4(w)[0][0]
    assert 0.5 * best <= (w * mask).sum().item() <= best
    # a 2:4 tile and a 4:8 tile cut from larger random weights get stuck as well, and are repaired
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    for n, m in [(2, 4), (4, 8)]:
        assert any((plain_greedy(t, n).sum(0) < n).any() for t in tiles_of(w, m))
        assert_valid(transposable_mask(w, n, m, "greedy"), n, m)


def test_weak_repair_falls_back_to_exact(monkeypatch):
    # sabotage the repair (the lightest valid mask instead); the half-optimum check must catch it
    def lightest(a, keep, row_used, col_used, n):
        return tp.exact_tiles(a.amax((1, 2), keepdim=True) - a, n)

    monkeypatch.setattr(tp, "_repair", lightest)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(9))
    greedy, exact = transposable_mask(w, 4, 8, "greedy"), transposable_mask(w, 4, 8, "exact")
    assert_valid(greedy, 4, 8)
    g, e = kept(w, greedy, 8), kept(w, exact, 8)
    assert (g >= 0.5 * e * (1 - 1e-9)).all()


# ----------------------------------------------------------------------------- counts and errors


def test_tile_counts_by_hand():
    mask = torch.zeros(4, 8, 2, dtype=torch.bool)
    mask[0, 1, 0] = mask[0, 2, 0] = mask[3, 1, 0] = mask[1, 5, 1] = True
    rows, cols = tile_counts(mask, 4)
    assert rows.shape == (4, 2, 2) and cols.shape == (1, 8, 2)
    assert rows[0, 0, 0] == 2 and rows[3, 0, 0] == 1 and rows[1, 1, 1] == 1 and rows.sum() == 4
    assert cols[0, 1, 0] == 2 and cols[0, 2, 0] == 1 and cols[0, 5, 1] == 1 and cols.sum() == 4
    assert not is_transposable(mask, 2, 4)
    assert is_transposable(transposable_mask(torch.randn(4, 8, 2), 2, 4), 2, 4)
    assert not is_transposable(torch.ones(4, 4), 2, 4)


def test_bad_shapes_name_the_shape_and_m():
    with pytest.raises(ValueError, match=r"\(6, 8\).*M=4"):
        transposable_mask(torch.randn(6, 8), 2, 4)
    with pytest.raises(ValueError, match=r"\(8, 12\).*M=8"):
        transposable_mask(torch.randn(8, 12), 4, 8)
    with pytest.raises(ValueError, match=r"\(16,\).*at least 2 dims"):
        transposable_mask(torch.randn(16), 2, 4)
    with pytest.raises(ValueError, match=r"\(4, 6, 3\).*M=4"):
        tile_counts(torch.ones(4, 6, 3), 4)
    with pytest.raises(ValueError, match=r"\(4, 6\).*M=4"):
        is_transposable(torch.ones(4, 6), 2, 4)


@pytest.mark.parametrize("n,m", [(0, 4), (4, 4), (5, 4), (-1, 4), (1, 1), (2, 0)])
def test_bad_n_m(n, m):
    with pytest.raises(ValueError, match=rf"{n}:{m}.*1 <= N < M"):
        transposable_mask(torch.randn(8, 8), n, m)
    with pytest.raises(ValueError, match="1 <= N < M"):
        is_transposable(torch.ones(8, 8), n, m)


def test_bad_method_and_types():
    with pytest.raises(ValueError, match="unknown transposable mask method 'optimal'.*exact"):
        transposable_mask(torch.randn(8, 8), 2, 4, "optimal")
    with pytest.raises(TypeError, match="n must be an int"):
        transposable_mask(torch.randn(8, 8), 2.0, 4)
    with pytest.raises(TypeError, match="m must be an int"):
        transposable_mask(torch.randn(8, 8), 2, True)


@pytest.mark.gpu
def test_cuda_gives_the_cpu_masks():
    w = torch.randn(64, 64, 3, generator=torch.Generator().manual_seed(10))
    for n, m in [(2, 4), (4, 8)]:
        for method in METHODS:
            cuda = transposable_mask(w.cuda().half(), n, m, method)
            assert cuda.is_cuda
            assert_valid(cuda.cpu(), n, m)
            assert torch.equal(cuda.cpu(), transposable_mask(w.half(), n, m, method))


# ----------------------------------------------------------------------------- the fused 2:4 kernel, the recipe


@pytest.mark.slow  # compiles the Inductor kernel for several shapes and dtypes
def test_fused_2_4_kernel_makes_the_table_choices():
    gen = torch.Generator().manual_seed(11)
    cases = [weights(kind, (16, 64), gen) for kind in ("normal", "heavy", "ties", "sparse")]
    cases += [torch.zeros(32, 32), weights("normal", (16, 16, 4), gen).half(), torch.randn(64, 16, generator=gen)]
    cases[-1][0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # counted as 0, max, max
    for w in cases:
        table = tp._from_tiles(tpx._exact_by_table(tp._to_tiles(tp._magnitudes(w), 4), 2), w.shape, 4)
        assert torch.equal(tp._fused_mask(w), table)  # all cases have 64 tiles: one compile


def brute_mask(w):
    """The best transposable 2:4 mask of every 4x4 tile of ``w`` by brute force (2by4 pre-training's rule)."""
    mask = torch.zeros(w.shape, dtype=torch.bool)
    for i, j in itertools.product(range(0, w.shape[0], 4), range(0, w.shape[1], 4)):
        mask[i : i + 4, j : j + 4] = brute_force_2_4(w[i : i + 4, j : j + 4].detach())[0][1]
    return mask


def t_sr_ste_reference(model, opt, batches, decay, every):
    """T-SR-STE by its equations: forward with W~ = W * m; dW = dL/dW~ (straight through) + decay * (1 - m) * W;
    optimizer step; every ``every`` steps m = the exact transposable mask of the current W. The masks per step."""
    linears = [mod for mod in model if isinstance(mod, torch.nn.Linear)]
    masks, seen = {mod: brute_mask(mod.weight) for mod in linears}, []
    for step, (x, y) in enumerate(batches, 1):
        kept = {mod: (mod.weight * masks[mod]).detach().requires_grad_() for mod in linears}
        for mod in model:
            x = torch.nn.functional.linear(x, kept[mod], mod.bias) if mod in kept else mod(x)
        opt.zero_grad()
        torch.nn.functional.mse_loss(x, y).backward()
        for mod in linears:
            mod.weight.grad = kept[mod].grad + decay * (~masks[mod]) * mod.weight.detach()
        opt.step()
        if step % every == 0:
            masks = {mod: brute_mask(mod.weight) for mod in linears}
        seen.append([masks[mod] for mod in linears])
    return seen


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("name,kw", [("SGD", {"lr": 0.5, "momentum": 0.9}), ("Adam", {"lr": 0.05})])
def test_compiled_training_follows_the_t_sr_ste_reference(name, kw, every):
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    ref, batches = copy.deepcopy(model), [(torch.randn(32, 16), torch.randn(32, 8)) for _ in range(5)]
    expected = t_sr_ste_reference(ref, getattr(torch.optim, name)(ref.parameters(), **kw), batches, 0.05, every)
    nmcompile.annotate(model, f"transposable:2:4,decay=0.05,every={every}")
    run, opt = torch.compile(model, backend="nmsparse"), getattr(torch.optim, name)(model.parameters(), **kw)
    for (x, y), masks in zip(batches, expected):
        opt.zero_grad()
        torch.nn.functional.mse_loss(run(x), y).backward()
        opt.step()
        assert all(torch.equal(model[i].weight_nm_mask.bool(), mask) for i, mask in zip((0, 2), masks))
        if every == 1:  # refreshed after every step, from the weights as they are now
            assert torch.equal(model[0].weight_nm_mask.bool(), brute_mask(model[0].weight))
    assert not all(torch.equal(masks[0], expected[0][0]) for masks in expected[1:]), "no mask ever changed"
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option", ["decay=-1e-5", "decay=nan", "decay=inf", "every=0"])
def test_bad_options_name_the_recipe_and_the_option(option):
    with pytest.raises(ValueError, match=f"transposable: {option.split('=')[0]}"):
        nmcompile.recipe(f"transposable:2:4,{option}")
    with pytest.raises(ValueError, match="transposable: decay"):
        nmcompile.recipes.Transposable(decay=-1.0)
    assert nmcompile.recipe("transposable:2:4").decay == 6e-5  # T-SR-STE's alpha for GPT-2 124M
