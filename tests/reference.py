"""Eager references written from the papers' equations, independent of nmcompile's formulations."""

import torch


def _groups(w, m, dim):
    return w.movedim(dim, -1).unflatten(-1, (-1, m))


def _ungroup(g, dim):
    return g.flatten(-2).movedim(-1, dim)


def topn_mask(w, n, m, dim=1):
    """Keep the n largest |w| of every m along dim; ties go to the lower index (stable sort)."""
    g = _groups(w.abs(), m, dim)
    order = torch.sort(-g, dim=-1, stable=True).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, order[..., :n], True)
    return _ungroup(mask, dim)


def soft_threshold(w, n, m, dim=1):
    """S(w)_i = sign(w_i) max(|w_i| - t, 0), t the (n+1)-th largest |w| of the group."""
    g = _groups(w, m, dim)
    t = torch.sort(g.abs(), dim=-1, descending=True).values[..., n : n + 1]
    return _ungroup(torch.sign(g) * torch.clamp(g.abs() - t, min=0), dim)


def beta(w, n, m, dim=1):
    s = soft_threshold(w, n, m, dim)
    return (w * s).sum() / (s * s).sum()


class STE(torch.autograd.Function):
    """The papers' eager module-swap form: masked forward, straight-through backward."""

    @staticmethod
    def forward(ctx, w, n, m, dim):
        return w * topn_mask(w, n, m, dim)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class SRSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, n, m, dim, decay):
        mask = topn_mask(w, n, m, dim)
        ctx.save_for_backward(w, mask)
        ctx.decay = decay
        return w * mask

    @staticmethod
    def backward(ctx, g):
        w, mask = ctx.saved_tensors
        return g + ctx.decay * (~mask) * w, None, None, None, None


class SSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, b, n, m, dim):
        return b * soft_threshold(w, n, m, dim)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None, None


def effective(recipe, w, dim=1, beta_value=None):
    """The reference forward weight for an nmcompile recipe object."""
    if recipe.name == "ste":
        return STE.apply(w, recipe.n, recipe.m, dim)
    if recipe.name == "sr_ste":
        return SRSTE.apply(w, recipe.n, recipe.m, dim, recipe.decay)
    if recipe.name == "s_ste":
        return SSTE.apply(w, beta_value, recipe.n, recipe.m, dim)
    raise ValueError(recipe.name)
