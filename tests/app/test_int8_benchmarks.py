"""The int8 per-layer benchmark runs, and every format it times computes the same layer (it refuses otherwise)."""

import pytest

from nmcompile.kernels import cpu24

pytestmark = pytest.mark.skipif(not cpu24.status().available, reason=f"no 2:4 CPU kernel here: {cpu24.status().reason}")


def test_int8_layers_times_every_format_on_the_same_product(benchmark_script, tmp_path):
    script = benchmark_script("int8_layers")
    out = tmp_path / "int8.json"
    result = script.main(["--size", "256", "--layers", "2", "--tokens", "1", "3", "--threads", "1", "--rounds", "2",
                          "--out", str(out)])
    assert out.exists()
    variants = {row["variant"] for row in result["rows"]}
    assert {"dense bf16", "dense fp32", "torch int8 weight-only", "2:4 bf16", "2:4+int8"} <= variants
    assert result["relative_error"]["2:4+int8"] < 0.02 and result["relative_error"]["2:4 bf16"] < 0.01
    if "avx2" in cpu24.isas():  # and the route with int8 activations: their rounding on top
        assert script.A8 in variants and result["relative_error"][script.A8] < 0.03
    # the bytes each format reads: 2:4+int8 is 5 bits a weight plus a scale a row, 0.31x of bf16 at this width
    ratio = result["bytes_per_pass"]["2:4+int8"] / result["bytes_per_pass"]["dense bf16"]
    assert ratio == pytest.approx((0.5 + 1 / 8 + 4 / 256) / 2)
    assert len(result["rows"]) == 2 * len(variants)
