"""benchmarks/models/real_scale.py: the bytes bound it computes from a model (checked against the issue's
figures for the 1B, 3B and 8B shapes, built on the meta device), the 2:4 model it makes from a
directory written by make_models.py, and one eager decode row rendered with its targets. The timed
runs themselves are benchmarks, not tests."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")


@pytest.fixture
def scripts(benchmark_script):
    return benchmark_script("make_models"), benchmark_script("real_scale")


# (bound fp32, bound bf16, resident fp32, resident bf16): the figures, to two decimals
EXPECTED = {"1b": (1.58, 1.53, 0.63, 0.66), "3b": (1.70, 1.62, 0.59, 0.62), "8b": (1.77, 1.69, 0.59, 0.62)}


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_the_bound_from_the_shapes(scripts, shape):
    make_models, real_scale = scripts
    got = []
    for dtype in (torch.float32, torch.bfloat16):
        meta = real_scale.meta_model(make_models.config_for(make_models.SHAPES[shape]), dtype)
        dense, sparse = real_scale.weight_bytes(meta), real_scale.expected_24(meta, dtype)
        got.append((dense["per_token"] / sparse["per_token"], sparse["resident"] / dense["resident"]))
        if shape == "8b" and dtype == torch.bfloat16:
            assert round(sparse["resident"] / 1e9, 2) == 9.95
    (bf32, rf32), (bbf, rbf) = got
    assert [bf32, bbf, rf32, rbf] == pytest.approx(EXPECTED[shape], abs=0.006)  # the two decimals


def test_tokens_read_count_one_row_of_an_untied_embedding(scripts):
    make_models, real_scale = scripts
    shape = make_models.SHAPES["8b"]
    meta = real_scale.meta_model(make_models.config_for(shape), torch.bfloat16)
    counts = real_scale.weight_bytes(meta)
    assert counts["resident"] - counts["per_token"] == (shape.vocab - 1) * shape.hidden * 2


@pytest.mark.slow
def test_the_24_model_and_an_eager_decode_row(scripts, tmp_path):
    """load_24 packs every decoder linear and nothing else, its bytes are the expected ones; a decode
    row (eager variants, no compile) has its bound, speed-up and targets, and renders."""
    make_models, real_scale = scripts
    from nmcompile.kernels import cpu24

    if not cpu24.status().available:
        pytest.skip(f"the 2:4 CPU kernel is not available here: {cpu24.status().reason}")
    path = str(tmp_path / "tiny")
    make_models.write_model(path, "tiny", log=lambda line: None)
    model, info = real_scale.load_24(path, torch.float32)
    assert info["packed"] == 7 * make_models.SHAPES["tiny"].layers and info["finalized"] == info["packed"]
    assert info["left_dense"] == ["model.embed_tokens.weight"]  # the tied head with it
    meta = real_scale.meta_model(path, torch.float32)
    assert real_scale.weight_bytes(model) == {k: int(v) for k, v in real_scale.expected_24(meta, torch.float32).items()}

    rows = real_scale.decode(path, ["fp32"], [1], new_tokens=4, prompt=8, runs=1, slow=3.0, max_gb=8.0,
                             sparse_modes=("eager",), dense_modes=("eager",))
    row = rows[0]
    assert set(row["variants"]) == {"2:4 eager 1t", "dense eager 1t"} and row["timing"] == "interleaved"
    assert row["bound"] == pytest.approx(row["bound_expected"]) and row["bound"] > 1
    assert row["resident_ratio"] == pytest.approx(row["resident_ratio_expected"])
    assert row["speedup"] > 0 and row["gbps_24"] > 0 and all(row["same tokens 2:4"].values())
    result = {"shape": "tiny", "machine": {"cpu": "x", "threads": 1, "isa": ["avx2"], "torch": "t", "nmcompile": "c"},
              "model": {"parameters": 1, "layers": 2, "tied": True}, "decode": json.loads(json.dumps(rows))}
    text = real_scale.render(result)
    assert "| dense eager 1t" in text and "bytes bound" in text and "resident parameters within 0.02" in text


def test_prune_targets_judge_the_sequential_time_and_peak(scripts):
    """The prune rows of the target table: sequential against one pass's time (at most 1.3x), and the
    sequential peak against the model's bf16 bytes plus 3 GB."""
    _, real_scale = scripts
    result = {"model": {"parameters": 1_000_000_000}, "prune": {"runs": [
        {"mode": "one pass", "wall_s": 100.0, "peak_rss_mb": 9000.0},
        {"mode": "sequential", "wall_s": 125.0, "peak_rss_mb": 4700.0}]}}
    rows = real_scale.targets(result)
    assert any("1.25x | met" in row for row in rows) and any("4700 MB | met" in row for row in rows)
    result["prune"]["runs"][1].update(wall_s=140.0, peak_rss_mb=4800.0)  # limit: 5e9 bytes = 4768 MB
    rows = real_scale.targets(result)
    assert any("1.40x | **missed**" in row for row in rows) and any("4800 MB | **missed**" in row for row in rows)
    result.update(shape="3b")  # 14 GB = 13351 MB, whatever the model's bytes
    assert any("<= 14 GB (13351 MB) | 4800 MB | met" in row for row in real_scale.targets(result))
    result["prune"]["runs"][1].update(peak_rss_mb=13400.0)
    assert any("13400 MB | **missed**" in row for row in real_scale.targets(result))
    result["prune"]["runs"][1].update(rc=2, error="nmcompile prune: [Errno 28] No space left on device")
    rows = real_scale.targets(result)  # a run that did not finish fails, whatever its memory
    assert any("finishes | exit status 2: nmcompile prune: [Errno 28]" in row and "**failed**" in row for row in rows)
    assert "| sequential (failed, exit status 2) |" in real_scale.render(
        {**result, "machine": {"cpu": "x", "threads": 2, "isa": ["avx2"], "torch": "t", "nmcompile": "c"},
         "model": {"parameters": 1, "layers": 2, "tied": True}, "prune": {"recipe": "wanda:2:4", "samples": 8,
                                                                           "seq_len": 512, **result["prune"]}})
    result["prune"]["runs"] = [{"mode": "one pass", "wall_s": 100.0, "peak_rss_mb": 9000.0}]
    assert real_scale.targets(result) == []
