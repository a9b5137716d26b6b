"""One-shot calibration of a bf16 model computed in float32 one piece at a time
(nmcompile.oneshot.compute_dtype): the model stays bf16 in its own storage, calibration sees float32
arithmetic, and the choice is made from the CPU's flags and reported."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import nmcompile
from nmcompile.oneshot import compute_dtype as cd

from models import tiny_llama

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:nmsparse. recipe state for")


def _bf16_llama(seed=0):
    torch.manual_seed(seed)
    return tiny_llama(transformers, hidden=64, intermediate=128, layers=2, vocab=128).to(torch.bfloat16).eval()


def _storages(model):
    return {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}


def test_raised_writes_back_into_the_same_storage():
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    before = lin.weight.untyped_storage().data_ptr()
    with cd.raised(lin, torch.float32):
        assert lin.weight.dtype == torch.float32 and lin.bias.dtype == torch.float32
        with torch.no_grad():
            lin.weight.fill_(1.5)
    assert lin.weight.dtype == torch.bfloat16
    assert lin.weight.untyped_storage().data_ptr() == before
    assert bool((lin.weight == 1.5).all())


def test_raised_restores_after_an_error():
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        with cd.raised(lin, torch.float32):
            raise RuntimeError("boom")
    assert lin.weight.dtype == torch.bfloat16


def test_per_module_forward_is_float32_arithmetic_and_leaves_bf16():
    model = _bf16_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model).float()  # the same bf16 values, in float32
    storages = _storages(model)
    with torch.no_grad():
        want = ref(ids).logits
        plain = model(ids).logits.float()
        with cd.raised_per_module(model, torch.float32):
            got = model(ids).logits
    assert got.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert _storages(model) == storages
    # float32 arithmetic: far closer to the float32 model than the bf16 forward is
    err, err_bf16 = (got - want).abs().max().item(), (plain - want).abs().max().item()
    assert err < 1e-2 * err_bf16 + 1e-6, (err, err_bf16)


class _LinearWeights(torch.overrides.TorchFunctionMode):
    """The number of weight elements of every float32 ``F.linear`` call made inside it."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and args[1].dtype == torch.float32:
            self.sizes.append(args[1].numel())
        return func(*args, **(kwargs or {}))


def test_a_linear_too_large_to_raise_whole_runs_in_row_chunks(monkeypatch):
    """The output head (vocab 128 x width 64 = 8192 weights) over a limit of 2048 float32 weights is
    computed 32 rows at a time: the same float32 logits, never more than the limit raised at once."""
    model = _bf16_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), cd.raised_per_module(model, torch.float32):
        whole = model(ids).logits
    monkeypatch.setattr(cd, "CHUNK_BYTES", 2048 * 4)
    storages = _storages(model)
    seen = _LinearWeights()
    with torch.no_grad(), cd.raised_per_module(model, torch.float32), seen:
        chunked = model(ids).logits
    lin = torch.nn.Linear(64, 100, dtype=torch.bfloat16)  # a bias, and rows that do not divide evenly
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = F.linear(x, lin.weight.float(), lin.bias.float())
        got = cd.linear_in_chunks(x, lin.weight, lin.bias, torch.float32)
    assert chunked.dtype == torch.float32 and chunked.shape == whole.shape
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert max(seen.sizes) <= 2048 and seen.sizes.count(32 * 64) >= 4  # the head alone: 4 chunks of 32 rows
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and _storages(model) == storages


def test_compute_dtype_follows_the_cpu_flags(monkeypatch):
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    monkeypatch.setattr(cd, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    dtype, why = cd.compute_dtype(model)
    assert dtype == torch.float32 and "avx512_bf16" in why and "bfloat16" in why
    monkeypatch.setattr(cd, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert cd.compute_dtype(model)[0] == torch.bfloat16
    assert cd.compute_dtype(model, torch.bfloat16)[0] == torch.bfloat16
    assert cd.compute_dtype(torch.nn.Linear(8, 8))[0] == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("sequential", [True, False])
def test_bf16_model_calibrated_in_float32_stays_bf16(sequential):
    model = _bf16_llama()
    ref = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(0, 128, (4, 16), generator=g), "use_cache": False} for _ in range(3)]
    for m in (model, ref):
        nmcompile.annotate(m, "sparsegpt:2:4")
    report = nmcompile.finalize(model, calibration=batches, sequential=sequential, compute_dtype=torch.float32)
    nmcompile.finalize(ref, calibration=batches, sequential=sequential)
    assert "computed in float32, as asked" in report.calibration
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert nmcompile.check(model).ok
    names = [n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2]
    agree = [float(((p != 0) == (ref.get_parameter(n) != 0)).float().mean()) for n, p in model.named_parameters()
             if n in names]
    # the same solve on the same float32 values: masks agree but for near-ties the bf16 rotary tables move
    assert min(agree) > 0.97, agree
    for n in names:
        torch.testing.assert_close(model.get_parameter(n).float(), ref.get_parameter(n).to(torch.bfloat16).float(),
                                   atol=0.05, rtol=0.05)
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        assert F.cosine_similarity(model(ids).logits.float().flatten(), ref(ids).logits.flatten(), dim=0) > 0.99
