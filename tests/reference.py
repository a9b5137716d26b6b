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


# ---- scheduled recipes (STEP, MDGF, SDGF) and the GEMM-level ones (Bi-Mask) ----


def mdgf_alpha(step, coef, schedule="exp", dense_steps=0, finetune_start=None):
    """alpha_t of mask decay: 1 while dense, then exp(-c s) or max(0, 1 - c s), 0 in fine-tuning."""
    import math

    if step < dense_steps:
        return 1.0
    if finetune_start is not None and step >= finetune_start:
        return 0.0
    s = step - dense_steps
    return math.exp(-coef * s) if schedule == "exp" else max(0.0, 1 - coef * s)


def mdgf_weight(w, n, m, alpha, dim=1):
    mask = topn_mask(w, n, m, dim)
    return w * (mask + (~mask) * alpha)


def bi_mask_backward_mask(w, perm, n, m):
    """Bi-Mask's B for a weight [out, in, k...], one output column group at a time (loops, no tricks)."""
    f = topn_mask(w, n, m, 1).flatten(1)
    ws = (w.flatten(1) * f)[perm]
    fp = f[perm]
    b_perm = torch.zeros_like(f)
    out, cols = f.shape
    for c in range(cols):
        for g in range(0, out, m):
            column = ws[g : g + m, c].abs()
            order = torch.sort(-column, stable=True).indices[:n]
            for i in order.tolist():
                b_perm[g + i, c] = bool(fp[g + i, c])
    b = torch.zeros_like(b_perm)
    b[perm] = b_perm
    return b.reshape(w.shape)


def fake_fp8(t, dtype):
    """Round t through an FP8 format with the per-tensor scale max/amax (S-STE's simulation)."""
    top = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    scale = top / t.abs().max()
    return (t * scale).to(dtype).to(t.dtype) / scale
