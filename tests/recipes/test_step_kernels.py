"""STEP's fused optimizer-time kernels agree with their eager definitions."""

import pytest
import torch

from nmcompile.recipes import step_kernels as K


def tensors(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen).to(dtype)
    v = (torch.rand(shape, generator=gen) * 1e-2).to(dtype)
    v.view(-1)[::7] = 0  # entries no gradient ever reached
    return v, g


@pytest.mark.parametrize("z_option", [1, 2])
@pytest.mark.parametrize("shape", [(64, 48), (8, 4, 3, 3)])
def test_change_sum_matches_eager(z_option, shape):
    v, g = tensors(shape)
    g.view(-1)[::7] = 0  # a dead unit: g = v = 0 exactly, the floor path of option 2
    fused = K.change_sum(v, g, z_option, 1e-5)
    eager = K.change_sum_eager(v, g, z_option, 1e-5)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6)
    # first step: no second moment yet
    torch.testing.assert_close(K.change_sum(None, g, z_option, 1e-5), K.change_sum_eager(None, g, z_option, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_update_matches_eager(dtype):
    v, g = tensors((96, 64), dtype)
    frozen = (torch.rand(96, 64) * 1e-2)
    frozen[::5] = 0  # rows that use Adam's live moment
    p = torch.randn(96, 64).to(dtype)
    m = (torch.randn(96, 64) * 1e-2).to(dtype)
    fused = [t.clone() for t in (p, g, m, v)]
    eager = [t.float() for t in (p, g, m, v)]  # bf16: the reference runs in float32 (no double rounding)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, bias1=1 - 0.9**7, bias2=1 - 0.999**7, eps=1e-8)
    for lr in (1e-2, 3e-3):  # a schedule changes lr: same compiled kernel, new value
        hyper["lr"] = lr
        K.frozen_update(*fused[:2], fused[2], fused[3], frozen, **hyper)
        K.frozen_update_eager(*eager[:2], eager[2], eager[3], frozen, *hyper.values())
    rtol, atol = (1e-6, 1e-8) if dtype == torch.float32 else (2e-2, 1e-4)  # bf16: about 2 units in the last place
    for a, b in zip(fused, eager):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, rtol=rtol, atol=atol)
    assert not torch.equal(fused[0], p)  # it did update in place
    versions = [t._version for t in fused]
    K.frozen_update(*fused[:2], fused[2], fused[3], frozen, **hyper)
    assert [t._version > v for t, v in zip(fused, versions)] == [True, False, True, True]  # p, m, v written


def test_non_contiguous_tensors_take_the_eager_path():
    v, g = tensors((32, 16))
    p, m, frozen = torch.randn(16, 32).t(), torch.zeros(32, 16), torch.rand(32, 16)
    before = p.clone()
    K.frozen_update(p, g, m, v, frozen, lr=0.1, beta1=0.9, beta2=0.999, bias1=0.1, bias2=0.001, eps=1e-8)
    expected = before - 0.1 / 0.1 * (0.1 * g) / (frozen.sqrt() + 1e-8)
    torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


def test_without_a_working_compiler_the_kernels_run_eagerly(monkeypatch):
    def broken(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(K, "_compiled", lambda fn: broken)
    monkeypatch.setattr(K, "_unavailable", [])
    v, g = tensors((16, 8))
    with pytest.warns(RuntimeWarning, match="could not be compiled"):
        first = K.change_sum(v, g, 1, 1e-5)
    torch.testing.assert_close(first, K.change_sum_eager(v, g, 1, 1e-5))
    assert K._unavailable  # remembered: later calls go straight to the eager definition
    torch.testing.assert_close(K.change_sum(v, g, 1, 1e-5), first)
