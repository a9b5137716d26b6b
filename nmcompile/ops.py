"""nmcompile's custom ops (namespace ``nmsparse::``).

Each op exists for its backward rule; its forward is the plain aten math of :mod:`nmcompile.masks`.
:data:`DECOMPOSITIONS` hands that forward to Inductor, so the mask math fuses into one pass over the
weight instead of running as an opaque kernel. Under ``inner="aot_eager"`` or in eager mode the
ops run their bodies, which are the same functions.

=================================  ==============================  ==================================
op                                 forward                          gradient w.r.t. ``w``
=================================  ==============================  ==================================
``prune(w, n, m, dim)``            top-n of every m                 ``g`` (straight-through)
``prune_decay(w, n, m, dim, lam)`` top-n of every m                 ``g + lam * (w - out)``
                                                                    (= ``g + lam * (1 - mask) * w``)
``soft_threshold(w, beta, ...)``   ``beta * S(w)``                   ``g`` (straight-through, no beta)
=================================  ==============================  ==================================
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import masks

__all__ = ["prune", "prune_decay", "soft_threshold", "DECOMPOSITIONS"]


def _prune(w: Tensor, n: int, m: int, dim: int) -> Tensor:
    return masks.prune(w, n, m, dim).contiguous()


def _prune_decay(w: Tensor, n: int, m: int, dim: int, decay: float) -> Tensor:
    return masks.prune(w, n, m, dim).contiguous()


def _soft_threshold(w: Tensor, beta: Tensor, n: int, m: int, dim: int) -> Tensor:
    return masks.soft_threshold(w, n, m, dim, scale=beta).contiguous()


prune = torch.library.custom_op("nmsparse::prune", _prune, mutates_args=())
prune_decay = torch.library.custom_op("nmsparse::prune_decay", _prune_decay, mutates_args=())
soft_threshold = torch.library.custom_op("nmsparse::soft_threshold", _soft_threshold, mutates_args=())


@prune.register_fake
def _(w, n, m, dim):
    return w.new_empty(w.shape)  # outputs are contiguous


@prune_decay.register_fake
def _(w, n, m, dim, decay):
    return w.new_empty(w.shape)  # outputs are contiguous


@soft_threshold.register_fake
def _(w, beta, n, m, dim):
    return w.new_empty(w.shape)  # outputs are contiguous


def _straight_through(ctx, grad):
    return grad, None, None, None


def _decay_setup(ctx, inputs, output):
    w, _, _, _, decay = inputs
    ctx.decay = decay
    ctx.save_for_backward(w, output)


def _decay_backward(ctx, grad):
    w, out = ctx.saved_tensors
    # g - decay * (out - w) equals g + decay * (w - out) exactly; written as a subtraction so that
    # Inductor does not fold the term into the weight-gradient addmm (which costs an extra copy)
    return grad - ctx.decay * (out - w), None, None, None, None


def _soft_threshold_backward(ctx, grad):
    return grad, None, None, None, None


prune.register_autograd(_straight_through)
prune_decay.register_autograd(_decay_backward, setup_context=_decay_setup)
soft_threshold.register_autograd(_soft_threshold_backward)

#: Forward bodies given to Inductor so it traces (and fuses) the mask math.
DECOMPOSITIONS = {
    torch.ops.nmsparse.prune.default: _prune,
    torch.ops.nmsparse.prune_decay.default: _prune_decay,
    torch.ops.nmsparse.soft_threshold.default: _soft_threshold,
}
