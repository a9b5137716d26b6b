"""nmcompile's custom ops (namespace ``nmsparse::``).

Each op exists for its backward rule; its forward is the plain aten math of :mod:`nmcompile.masks`.
:data:`DECOMPOSITIONS` hands that forward to Inductor, so the mask math fuses into one pass over the
weight instead of running as an opaque kernel. Under ``inner="aot_eager"`` or in eager mode the
ops run their bodies, which are the same functions.

Mask ops (forward; gradient with respect to ``w``):

- ``prune(w, n, m, dim)``: the top-n of every m; ``g`` (straight-through).
- ``prune_decay(w, n, m, dim, lam)``: the same; ``g + lam * (w - out)`` (= ``g + lam * (1 - mask) * w``).
- ``mask_decay(w, mask, lam)``: ``w`` times a stored 0/1 mask (transposable); ``g + lam * (w - out)``.
- ``prune_when(w, on, n, m, dim, lam)``: ``prune(w)`` where the 0-d bool ``on`` holds, else ``w``
  itself, in one pass; ``g + lam * (w - out)``, which is ``g`` while ``on`` is off.
- ``soft_threshold(w, beta, n, m, dim)``: ``beta * S(w)``; ``g`` (straight-through, no beta).
- ``round_to_grid(w, bits, group, dim)``: ``w``'s rows rounded to their int8 (``bits=8``) or 4-bit grids
  (:mod:`nmcompile.masks.grids`); ``g`` (straight-through). Not decomposed for Inductor: fused, Inductor skips
  the fp16 rounding of the 4-bit scales (a cast inside a kernel), and the codes moved off the packed grid.
- ``backward_mask_weight(kept, perm, n, m, dim)``: Bi-Mask's ``W * B`` from ``kept = W * F``; none
  (used on detached weights).

Two ops replace the GEMM itself where a recipe changes its backward (the weight gradient, the
input gradient's weight, or FP8 rounding); their forwards are the plain aten GEMMs:

``linear(x, w, w_dgrad, bias, mvue_n, mvue_m, fp8)`` and
``conv(x, w, w_dgrad, bias, stride, padding, dilation, groups, mvue_n, mvue_m)``:

- DGRAD ``dX = dY * w_dgrad`` (``w_dgrad`` is ``w`` except for Bi-Mask's backward mask);
- WGRAD ``dW = MVUE(dY)^T X`` with ``dY`` made ``mvue_n:mvue_m`` sparse along the tokens (the
  batch and spatial positions for a conv), or the dense ``dY`` when ``mvue_n == 0``;
- ``fp8``: the forward rounds ``x`` and ``w`` through e4m3, both backward GEMMs round their operands
  through e5m2, each with a per-tensor scale ``FP8_MAX / amax``; accumulation stays float32.

One op gathers calibration statistics for the one-shot recipes (Wanda, SparseGPT); it mutates its
state arguments in place, returns nothing, and is inserted before each GEMM that reads such a weight:

``accumulate_stats(x, stat, count, route, layout, expert, conv, gram)``: ``x`` is the GEMM's input
operand as the graph has it; ``stat += X^T X`` (``gram``) or the per-column sum of squares of the rows
``X`` that reach the weight, ``count +=`` their number, per expert for stacked weights (``expert``: a
fixed expert, or -1; ``route``: ``offs`` of a grouped GEMM or the ``ids`` of ``W[ids]``); see
:func:`nmcompile.masks.calibration.input_rows` for the layouts. Runs no autograd (``x`` is detached).

Under ``torch.autocast`` both cast their floating-point inputs to the autocast dtype, as aten's GEMMs do.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import masks
from .masks.mvue import mvue

__all__ = [
    "prune", "prune_decay", "mask_decay", "prune_when", "soft_threshold", "round_to_grid", "backward_mask_weight", "linear", "conv",
    "fake_fp8", "mvue_along", "autocast_kernel", "accumulate_stats", "DECOMPOSITIONS",
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def _prune(w: Tensor, n: int, m: int, dim: int) -> Tensor:
    return masks.prune(w, n, m, dim).contiguous()


def _prune_decay(w: Tensor, n: int, m: int, dim: int, decay: float) -> Tensor:
    return masks.prune(w, n, m, dim).contiguous()


def _mask_decay(w: Tensor, mask: Tensor, decay: float) -> Tensor:
    return masks.apply_mask(w, mask).contiguous()


def _prune_when(w: Tensor, on: Tensor, n: int, m: int, dim: int, decay: float) -> Tensor:
    return masks.prune(w, n, m, dim, on=on).contiguous()


def _soft_threshold(w: Tensor, beta: Tensor, n: int, m: int, dim: int) -> Tensor:
    return masks.soft_threshold(w, n, m, dim, scale=beta).contiguous()


def _round_to_grid(w: Tensor, bits: int, group: int, dim: int) -> Tensor:
    return masks.grids.round_to_grid(w, bits, group, dim).contiguous()


prune = torch.library.custom_op("nmsparse::prune", _prune, mutates_args=())
round_to_grid = torch.library.custom_op("nmsparse::round_to_grid", _round_to_grid, mutates_args=())
prune_decay = torch.library.custom_op("nmsparse::prune_decay", _prune_decay, mutates_args=())
soft_threshold = torch.library.custom_op("nmsparse::soft_threshold", _soft_threshold, mutates_args=())
prune_when = torch.library.custom_op("nmsparse::prune_when", _prune_when, mutates_args=())
mask_decay = torch.library.custom_op("nmsparse::mask_decay", _mask_decay, mutates_args=())


def _accumulate_stats(x: Tensor, stat: Tensor, count: Tensor, route: Optional[Tensor], layout: str, expert: int,
                      conv: list[int], gram: bool) -> None:
    rows, who = masks.calibration.input_rows(x.detach(), layout, route, conv)
    masks.calibration.accumulate(stat, count, rows, who, expert, gram)


accumulate_stats = torch.library.custom_op(
    "nmsparse::accumulate_stats", _accumulate_stats, mutates_args=("stat", "count")
)


@accumulate_stats.register_fake
def _(x, stat, count, route, layout, expert, conv, gram):
    return None


@prune.register_fake
def _(w, n, m, dim):
    return w.new_empty(w.shape)  # outputs are contiguous


@prune_decay.register_fake
def _(w, n, m, dim, decay):
    return w.new_empty(w.shape)  # outputs are contiguous


@mask_decay.register_fake
def _(w, mask, decay):
    return w.new_empty(w.shape)  # outputs are contiguous


@soft_threshold.register_fake
def _(w, beta, n, m, dim):
    return w.new_empty(w.shape)  # outputs are contiguous


@round_to_grid.register_fake
def _(w, bits, group, dim):
    return w.new_empty(w.shape)  # outputs are contiguous


@prune_when.register_fake
def _(w, on, n, m, dim, decay):
    return w.new_empty(w.shape)  # outputs are contiguous


def _straight_through(ctx, grad):
    return grad, None, None, None


def _decay_setup(ctx, inputs, output):
    w, decay = inputs[0], inputs[-1]  # prune_decay(w, n, m, dim, decay), mask_decay(w, mask, decay), prune_when(...)
    ctx.decay, ctx.n_inputs = decay, len(inputs)
    if decay:
        ctx.save_for_backward(w, output)


def _decay_backward(ctx, grad):
    if ctx.decay:
        w, out = ctx.saved_tensors  # (prune_when while off: out == w, and the term is zero)
        # g - decay * (out - w) equals g + decay * (w - out) exactly; written as a subtraction so that
        # Inductor does not fold the term into the weight-gradient addmm (which costs an extra copy)
        grad = grad - ctx.decay * (out - w)
    return (grad,) + (None,) * (ctx.n_inputs - 1)


def _soft_threshold_backward(ctx, grad):
    return grad, None, None, None, None


prune.register_autograd(_straight_through)
prune_decay.register_autograd(_decay_backward, setup_context=_decay_setup)
soft_threshold.register_autograd(_soft_threshold_backward)
round_to_grid.register_autograd(_straight_through)
prune_when.register_autograd(_decay_backward, setup_context=_decay_setup)
mask_decay.register_autograd(_decay_backward, setup_context=_decay_setup)

def fake_fp8(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` rounded through the FP8 format ``dtype`` with a per-tensor scale ``max / amax(t)``."""
    amax = t.detach().abs().amax().float()
    scale = torch.where(amax > 0, FP8_MAX[dtype] / amax.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    return ((t.float() * scale).to(dtype).float() / scale).to(t.dtype)


def mvue_along(t: Tensor, n: int, m: int, dim: int) -> Tensor:
    """MVUE ``n:m`` of ``t`` along ``dim``, zero-padding that dimension to a multiple of ``m``."""
    size = t.shape[dim]
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, (-size) % m]
    # contiguous before narrowing: a view narrowed from the padded layout has strides that depend on
    # whether padding happened, which with dynamic shapes guards on the token count modulo m (a recompile)
    return mvue(F.pad(t, pad), n, m, dim).contiguous().narrow(dim, 0, size)


def _linear(x: Tensor, w: Tensor, w_dgrad: Tensor, bias: Optional[Tensor], mvue_n: int, mvue_m: int, fp8: bool) -> Tensor:
    if fp8:
        x, w = fake_fp8(x, E4M3), fake_fp8(w, E4M3)
    return F.linear(x, w, bias)


def _conv(
    x: Tensor, w: Tensor, w_dgrad: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
    dilation: list[int], groups: int, mvue_n: int, mvue_m: int,
) -> Tensor:
    return torch.ops.aten.convolution(x, w, bias, stride, padding, dilation, False, [0] * len(stride), groups)


def _backward_mask_weight(kept: Tensor, perm: Tensor, n: int, m: int, dim: int) -> Tensor:
    """Bi-Mask's DGRAD weight ``W * B`` from the forward weight ``kept = W * F``.

    ``F`` is the forward mask (top-n of m along ``dim``). ``B`` groups the output axis in the
    order ``perm``: within each group of m permuted output rows, the n largest ``|W * F|`` that
    ``F`` also keeps; then ``B`` is put back in the original row order. Since ``W * F`` is zero
    wherever ``F`` drops, pruning it along the output axis gives ``W * B`` directly.
    """
    if dim != 0:  # out is axis 0: each output row gathers its group's rows (one pass)
        return masks.prune_row_groups(kept, perm, n, m)
    # out is axis 1: gathering columns is slow, so prune a column-permuted copy and write its
    # columns back (an index_copy: a gather by the inverse order would recompute the prune)
    pruned = masks.prune(kept.index_select(1, perm), n, m, 1)
    return torch.index_copy(torch.empty_like(kept), 1, perm, pruned)


backward_mask_weight = torch.library.custom_op(
    "nmsparse::backward_mask_weight", _backward_mask_weight, mutates_args=()
)


@backward_mask_weight.register_fake
def _(w, perm, n, m, dim):
    return w.new_empty(w.shape)


linear = torch.library.custom_op("nmsparse::linear", _linear, mutates_args=())
conv = torch.library.custom_op("nmsparse::conv", _conv, mutates_args=())


@linear.register_fake
def _(x, w, w_dgrad, bias, mvue_n, mvue_m, fp8):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@conv.register_fake
def _(x, w, w_dgrad, bias, stride, padding, dilation, groups, mvue_n, mvue_m):
    return _conv(x, w, w_dgrad, bias, stride, padding, dilation, groups, mvue_n, mvue_m)


def _gemm_setup(ctx, inputs, output):
    x, w, w_dgrad, bias = inputs[:4]
    ctx.has_bias = bias is not None
    ctx.args = inputs[4:]
    ctx.save_for_backward(x, w, w_dgrad)


def _linear_backward(ctx, grad):
    x, _, w_dgrad = ctx.saved_tensors
    mvue_n, mvue_m, fp8 = ctx.args
    g = grad.reshape(-1, grad.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    dx = None
    if ctx.needs_input_grad[0]:
        gd, wd = (fake_fp8(g, E5M2), fake_fp8(w_dgrad, E5M2)) if fp8 else (g, w_dgrad)
        dx = (gd @ wd).reshape(x.shape)
    gw = mvue_along(g, mvue_n, mvue_m, 0) if mvue_n else g
    if fp8:
        gw, x2 = fake_fp8(gw, E5M2), fake_fp8(x2, E5M2)
    dw = gw.t() @ x2
    db = g.sum(0) if ctx.has_bias else None
    return dx, dw, None, db, None, None, None


def _conv_backward(ctx, grad):
    x, w, w_dgrad = ctx.saved_tensors
    stride, padding, dilation, groups, mvue_n, mvue_m = ctx.args
    conv_args = (stride, padding, dilation, False, [0] * len(stride), groups)
    dx = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.aten.convolution_backward(grad, x, w_dgrad, None, *conv_args, [True, False, False])[0]
    gw = grad
    if mvue_n:  # group along the WGRAD reduction: batch and spatial positions, per output channel
        per_channel = grad.transpose(0, 1)
        flat = mvue_along(per_channel.reshape(per_channel.shape[0], -1), mvue_n, mvue_m, 1)
        gw = flat.reshape(per_channel.shape).transpose(0, 1)
    dw = torch.ops.aten.convolution_backward(gw, x, w, None, *conv_args, [False, True, False])[1]
    db = grad.sum([d for d in range(grad.dim()) if d != 1]) if ctx.has_bias else None
    return dx, dw, None, db, None, None, None, None, None, None


linear.register_autograd(_linear_backward, setup_context=_gemm_setup)
conv.register_autograd(_conv_backward, setup_context=_gemm_setup)


def autocast_kernel(op, device_type: str, keep: tuple[int, ...] = ()):
    """The ``Autocast<device>`` kernel of a GEMM op: cast as ``F.linear``/``conv`` are under autocast.

    aten's GEMMs run in the autocast dtype; without this kernel the dispatcher falls through
    autocast, and Dynamo/AOTAutograd (which run the compiled graph with autocast off) would keep a
    rewritten layer in float32 while its fake kernel and eager body disagree on the output dtype.
    ``torch.library.register_autocast`` casts to one fixed dtype; this reads the active one
    (float16 or bfloat16) at each call. The positional arguments at ``keep`` are passed uncast.
    """
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))
    overload = getattr(op, "_opoverload", op)  # a custom_op's, or an OpOverload (ops defined in C++)

    def kernel(keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(value):
            eligible = (
                isinstance(value, Tensor) and value.is_floating_point()
                and value.device.type == device_type and value.dtype is not torch.float64
            )
            return value.to(dtype) if eligible else value

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return overload(*[a if i in keep else cast(a) for i, a in enumerate(args)])

    return kernel


#: The one ``nmsparse`` library fragment nmcompile's Python registers kernels on (a registration lives
#: as long as its Library object: this module keeps it for the process).
LIBRARY = torch.library.Library("nmsparse", "FRAGMENT")


def register_autocast(op, devices=("cpu", "cuda"), keep: tuple[int, ...] = ()) -> None:
    """Register :func:`autocast_kernel` of ``op`` for each of ``devices`` on :data:`LIBRARY`."""
    name = op._name if hasattr(op, "_name") else op._schema.name.split("::", 1)[1]
    for device in devices:
        LIBRARY.impl(name, autocast_kernel(op, device, keep), "Autocast" + torch._C._dispatch_key_for_device(device),
                     with_keyset=True)


for _op in (linear, conv):  # the GEMM ops' autocast kernels
    register_autocast(_op)

#: Forward bodies given to Inductor so it traces (and fuses) the mask math.
DECOMPOSITIONS = {
    torch.ops.nmsparse.prune.default: _prune,
    torch.ops.nmsparse.prune_decay.default: _prune_decay,
    torch.ops.nmsparse.soft_threshold.default: _soft_threshold,
    torch.ops.nmsparse.prune_when.default: _prune_when,
    torch.ops.nmsparse.mask_decay.default: _mask_decay,
    torch.ops.nmsparse.backward_mask_weight.default: _backward_mask_weight,
    torch.ops.nmsparse.linear.default: _linear,
    torch.ops.nmsparse.conv.default: _conv,
}
