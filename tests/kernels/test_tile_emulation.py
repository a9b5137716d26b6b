"""benchmarks/gpu/tile_emulation.py: which entries ``torch._sparse_semi_structured_tile`` keeps, emulated on
the CPU from its CUDA source. What it says about nmcompile's masks decides where the one-kernel
compressor may stand in for ``torch._cslt_compress`` (a GPU run checks the emulation against the op)."""


import pytest
import torch

from nmcompile.masks import count_violations, is_transposable

@pytest.fixture(scope="module")
def emu(benchmark_script):
    return benchmark_script("tile_emulation")


@pytest.fixture
def weight():
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(0))


def test_reproduces_pytorchs_own_example_with_later_ties_first(emu):
    # the 4x4 example in the docstring of SparseSemiStructuredTensorCUSPARSELT.prune_dense_static_sort
    t = torch.tensor([[9.0, 1, 7, 4], [1, 2, 3, 0], [8, 3, 5, 4], [1, 2, 6, 2]])
    expected = torch.tensor([[9.0, 0, 7, 0], [0, 2, 0, 0], [8, 0, 0, 4], [0, 0, 6, 2]])
    assert torch.equal(t * emu.tile_keep(t, ""), expected)
    # the other tie order picks the other of two equal 2s in the last row
    assert not torch.equal(t * emu.tile_keep(t, "", ties="first"), expected)


@pytest.mark.parametrize("ties", ["last", "first"])
def test_signed_ranking_reprunes_a_rowwise_mask_zeros_outrank_kept_negatives(emu, weight, ties):
    w = emu.rowwise_24(weight)
    assert bool((w < 0).any())
    keep = emu.tile_keep(w, "", ties=ties)
    share = emu.kept_share(w, keep)
    assert share < 0.65, share  # far from 1.0: the op would drop a third or more of the kept weights
    positives, negatives = emu.kept_share(w.clamp(min=0), keep), emu.kept_share(w.clamp(max=0), keep)
    assert positives > 0.9 and negatives < 0.3, (positives, negatives)
    # it is the sign: the same pattern with every value made positive loses only what abs ranking loses
    magnitude = w.abs()
    assert emu.kept_share(magnitude, emu.tile_keep(magnitude, "", ties=ties)) == pytest.approx(
        emu.kept_share(w, emu.tile_keep(w, "largest_abs_values_greedy", ties=ties)))


@pytest.mark.parametrize("ties", ["last", "first"])
def test_signed_ranking_reprunes_a_transposable_mask_too(emu, weight, ties):
    w = emu.transposable_24(weight)
    assert emu.kept_share(w, emu.tile_keep(w, "", ties=ties)) < 0.7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", ["last", "first"])
def test_abs_greedy_keeps_a_transposable_mask_exactly(emu, weight, dtype, ties):
    w = emu.transposable_24(weight.to(dtype))
    keep = emu.tile_keep(w, "largest_abs_values_greedy", ties=ties)
    assert torch.equal(w * keep, w)
    assert emu.kept_share(w, keep) == 1.0


@pytest.mark.parametrize("make", ["rowwise_24", "random_rowwise_24"])
def test_abs_greedy_does_not_keep_a_rowwise_only_mask(emu, weight, make):
    w = getattr(emu, make)(weight)
    assert count_violations(w, 2, 4, 1)[0] == 0  # 2:4 along the rows (the forward GEMM's operand) ...
    assert count_violations(w, 2, 4, 0)[0] > 0  # ... but not along the columns (the input gradient's)
    keep = emu.tile_keep(w, "largest_abs_values_greedy")
    share = emu.kept_share(w, keep)
    assert 0.7 < share < 0.9, share  # it re-prunes to what both orientations allow
    kept = w * keep
    assert count_violations(kept, 2, 4, 1)[0] == 0 and count_violations(kept, 2, 4, 0)[0] == 0


def test_any_input_gives_at_most_two_per_row_and_column_of_every_tile(emu, weight):
    for algorithm in emu.ALGORITHMS:
        keep = emu.tile_keep(weight, algorithm)
        assert count_violations(keep, 2, 4, 1)[0] == 0 and count_violations(keep, 2, 4, 0)[0] == 0
    # the greedy choice can get stuck below 8 in a tile (the source says so): then it is not a
    # transposable mask in nmcompile's sense (exactly 2 per row and column)
    per_tile = emu.tile_keep(weight, "largest_abs_values_greedy").reshape(64, 4, 64, 4).sum((1, 3))
    assert int(per_tile.max()) == 8 and int(per_tile.min()) < 8
    assert not is_transposable(emu.tile_keep(weight, "largest_abs_values_greedy"), 2, 4)


def test_refuses_what_it_does_not_emulate(emu):
    with pytest.raises(ValueError, match="causal1122"):
        emu.tile_keep(torch.randn(8, 8), "causal1122")
    with pytest.raises(ValueError, match="multiples of 4"):
        emu.tile_keep(torch.randn(8, 6), "")
    with pytest.raises(ValueError, match="ties"):
        emu.tile_keep(torch.randn(8, 8), "", ties="random")
