"""benchmarks/gpu/gpu_tile.py (the tile experiment): without CUDA it says so and exits 0; its comparisons run
here on the CPU stand-in for cuSPARSELt (tests/_gpu_contracts.py) with a stand-in tile op built from
the emulation, so that a GPU's minutes are not spent on a Python error, and so that its answers can
tell a wrong metadata layout from a re-pruned mask."""

import json
from unittest import mock

import pytest
import torch

SHAPES = [(128, 128), (256, 128)]


@pytest.fixture(scope="module")
def gpu_tile(benchmark_script):
    return benchmark_script("gpu_tile")


def stand_in_tile(scramble_meta: bool = False):
    """The tile op as the emulation says it selects, compressed by the stand-in ``_cslt_compress``;
    ``scramble_meta`` flips metadata bits (the layout question, with the values right)."""
    from benchmarks.gpu import tile_emulation as emu

    def compress(t):
        buf = torch._cslt_compress(t).clone()
        if scramble_meta:
            half = t.numel() // 2
            buf[half:].view(torch.int16).bitwise_xor_(0x5)
        return buf

    def tile(w, algorithm="", use_cutlass=True):
        assert use_cutlass is False
        keep = emu.tile_keep(w, algorithm)
        kept = w * keep
        return compress(kept), None, compress(kept.t().contiguous()), None, keep

    return tile


def run_cases(gpu_tile, scramble_meta=False, **kw):
    from _gpu_contracts import emulated_gpu

    with emulated_gpu(), \
            mock.patch.object(torch, "_sparse_semi_structured_tile", stand_in_tile(scramble_meta), create=True), \
            mock.patch.object(torch, "_sparse_semi_structured_apply_dense", lambda x, masks: x * masks, create=True):
        return gpu_tile.tile_rows(SHAPES, "cpu", tokens=16, **kw)


def test_right_tile_op_every_answer_agrees(gpu_tile):
    saved = []
    rows = run_cases(gpu_tile, on_shape=lambda done: saved.append(len(done)))
    per_shape = len(gpu_tile.MASKS) * len(gpu_tile.ALGORITHMS)
    assert len(rows) == len(SHAPES) * per_shape and saved == [per_shape, 2 * per_shape]
    for row in rows:
        assert "error" not in row, row
        assert row["layout"]["values_equal"] and row["layout"]["meta_equal"], row["layout"]
        assert row["layout_t"]["values_equal"] and row["layout_t"]["meta_equal"], row["layout_t"]
        assert row["layout"]["numel"][0] == row["layout"]["expected_numel"]
        assert row["tile_products_right"], row["products"]
        assert row["kept"]["emulation_tiles_equal"]["last"] == 1.0
        assert row["kept"]["emulation_tiles_equal"]["last_nonzero"] == 1.0
        if row["algorithm"] == "largest_abs_values_greedy" and row["mask"] == "transposable":  # all non-zeros fit
            assert row["kept"]["emulation_tiles_equal"]["first_nonzero"] == 1.0
        assert len(row["products"]) == 8
    by = {(tuple(r["weight"]), r["mask"], r["algorithm"]): r for r in rows}
    exact = by[((128, 128), "transposable", "largest_abs_values_greedy")]
    assert exact["kept"]["exactly"] and exact["kept"]["share"] == 1.0
    assert exact["products"]["tile forward"]["vs_weight"] < 2e-2
    signed = by[((128, 128), "rowwise", '""')]
    assert signed["kept"]["share"] < 0.7 and not signed["kept"]["exactly"]
    # the products are right for what the op kept, and far from the weight the recipe meant
    assert signed["products"]["tile forward transpose_result"]["vs_weight"] > 0.1
    assert json.loads(json.dumps(rows)) == rows  # the JSON holds plain values only
    assert "kept" in gpu_tile.markdown({"cases": rows})


def test_a_wrong_metadata_layout_is_told_from_the_values(gpu_tile):
    rows = run_cases(gpu_tile, scramble_meta=True, masks=("transposable",), algorithms=("largest_abs_values_greedy",))
    for row in rows:
        assert row["layout"]["values_equal"] and row["layout"]["values_row_major"] == {"tile": True, "cslt": True}
        assert not row["layout"]["meta_equal"] and not row["layout_t"]["meta_equal"]
        assert not row["tile_products_right"]
        assert row["products"]["cslt_compress forward"]["right"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(gpu_tile, tmp_path, capsys):
    out = tmp_path / "tile.json"
    assert gpu_tile.main(["--out", str(out)]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert "nothing measured" in json.loads(out.read_text())["skipped"]
