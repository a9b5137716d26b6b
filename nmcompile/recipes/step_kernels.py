"""STEP's per-step optimizer-time arithmetic, fused: one pass over each weight instead of five.

STEP runs two element-wise computations on every STEP weight at every optimizer step: the
AutoSwitch statistic in phase 1 and the frozen-moment Adam update in phase 2. Run op by op they
allocate temporaries the size of the weight and read it several times (about 4 ms per step on four
1024 x 1024 weights on a 2-core CPU); compiled by Inductor each is one loop. Both are compiled once
per dtype (on 1-D aliases, dynamic sizes; hyperparameters are symbolic floats, so a learning-rate
schedule does not recompile). The eager functions are the definitions: they run for
non-contiguous tensors and are what the tests compare the compiled ones against.
"""

from __future__ import annotations

import functools
import warnings

import torch


def change_sum_eager(v, g, z_option: int, floor: float):
    """``sum |g^2 - v|`` (option 1) or ``sum log(|g^2 - v|, exact zeros floored)`` (option 2), float32."""
    g = g.float()
    change = g * g if v is None else torch.addcmul(v.float(), g, g, value=-1)
    if z_option == 1:
        return torch.linalg.vector_norm(change, ord=1)
    return torch.where(change != 0, change.abs(), floor).log_().sum()


def frozen_update_eager(p, g, exp_avg, exp_avg_sq, frozen, lr, beta1, beta2, bias1, bias2, eps) -> None:
    """Adam's moments from ``g``, then ``p -= lr / bias1 * m / (sqrt(v) + eps)`` with ``v`` the frozen
    moment, or Adam's live bias-corrected one where the frozen moment is exactly zero."""
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = torch.where(frozen > 0, frozen, exp_avg_sq.float() / bias2).sqrt_().add_(eps).to(p.dtype)
    p.addcdiv_(exp_avg, denom, value=-lr / bias1)


def _change_sum(v, g, z_option: int, floor: float):
    g = g.float()
    change = g * g - v.float()
    if z_option == 1:
        return change.abs().sum()
    return torch.where(change != 0, change.abs(), floor).log().sum()


def _frozen_update(p, g, exp_avg, exp_avg_sq, frozen, lr, beta1, beta2, bias1, bias2, eps) -> None:
    g32 = g.float()
    m = exp_avg.float().lerp(g32, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g32 * g32
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    m, v = exp_avg.float(), exp_avg_sq.float()  # rounded as stored, as the eager update reads them
    denom = (torch.where(frozen > 0, frozen, v / bias2).sqrt() + eps).to(p.dtype).float()
    p.copy_(p.float() - (lr / bias1) * m / denom)


@functools.cache
def _compiled(fn):
    """``fn`` compiled, made at its first call: importing nmcompile does not import Dynamo (about
    2.5 s of a process's start-up on a 2-core CPU, paid by serving processes that never compile)."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


_unavailable: list[str] = []  # why Inductor could not compile the kernels here (then: eager from now on)


def _run_fused(fn, eager, *args):
    if _unavailable:
        return eager(*args)
    try:
        return _compiled(fn)(*args)
    except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. no C++ compiler, or no Triton for this GPU
        _unavailable.append(str(err).splitlines()[0])
        warnings.warn(f"nmcompile: STEP's optimizer kernels could not be compiled ({_unavailable[0]}); "
                      "running them op by op (slower, same result)", RuntimeWarning, stacklevel=3)
        return eager(*args)


def _flat(*tensors):
    """1-D aliases of contiguous tensors, or None when one is not contiguous (or when already tracing).

    The aliases share storage but are not views (``set_`` on a new tensor): a view would make
    Dynamo guard on its base's shape, and weights of other shapes would recompile the kernel.
    """
    if torch.compiler.is_compiling() or not all(t.is_contiguous() for t in tensors):
        return None
    out = []
    for t in tensors:
        alias = torch.empty(0, dtype=t.dtype, device=t.device)
        out.append(alias.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,)))
    return out


def change_sum(v, g, z_option: int, floor: float):
    """:func:`change_sum_eager`, fused where the tensors allow it."""
    flat = None if v is None else _flat(v, g)
    if flat is None:
        return change_sum_eager(v, g, z_option, floor)
    return _run_fused(_change_sum, change_sum_eager, *flat, z_option, float(floor))


def frozen_update(p, g, exp_avg, exp_avg_sq, frozen, *, lr, beta1, beta2, bias1, bias2, eps) -> None:
    """:func:`frozen_update_eager`, fused where the tensors allow it (all in place)."""
    scalars = tuple(float(x) for x in (lr, beta1, beta2, bias1, bias2, eps))
    flat = _flat(p, g, exp_avg, exp_avg_sq, frozen) if p.dtype == exp_avg.dtype else None
    if flat is None:
        frozen_update_eager(p, g, exp_avg, exp_avg_sq, frozen, *scalars)
        return
    _run_fused(_frozen_update, frozen_update_eager, *flat, *scalars)
    for t in (p, exp_avg, exp_avg_sq):  # written through the aliases: record it as in-place ops would
        torch.autograd.graph.increment_version(t)
