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


# ---- one-shot pruning from calibration data, written from the papers' equations (float64, no blocking)


def wanda(w, x, n, m):
    """Wanda (Sun et al. 2023, eq. 1): S_ij = |W_ij| * ||X_j||_2; keep the n largest S of every m
    consecutive inputs in each output row (comparison group per output, N:M along the input)."""
    score = w.double().abs() * x.double().norm(dim=0)
    return w * topn_mask(score, n, m, dim=1)


def sparsegpt(w, x, n, m, percdamp=0.01, update=True, scales=None, levels=(-127, 127)):
    """SparseGPT (Frantar & Alistarh 2023), column by column with explicit inverse Hessians.

    H = X^T X / T, dead inputs (H_jj = 0) get H_jj = 1 and a zero weight, then H += percdamp * mean(diag H) I.
    For column j (left to right) the columns still free are F = {j, j+1, ...} and H_F^-1 = inv(H[F, F]).
    At the first column of each group of m, the n columns k of the group with the largest OBS
    saliency w_k^2 / [H_{F_k}^-1]_00 are kept (F_k = {k, ...}). Column j is then set to its target q
    (0 if pruned, else w_j), and the OBS update moves its error onto the free columns:
    W[:, F] -= (w_j - q) / [H_F^-1]_00 * [H_F^-1]_0,: .
    With ``scales`` (one per row: the joint sparsification and quantization of the paper's section 3.5), a kept
    entry's target is its row's nearest grid point, q = clamp(round(w_j / s), lo, hi) * s (``levels=(lo, hi)``);
    ``scales`` ``[rows, cols / group]`` (4-bit grids): column j takes its group's scales, s = scales[:, j // group],
    and a zero scale holds zero. Returns (new weight, keep mask).
    """
    w0 = w.double()
    x = x.double()
    h = x.T @ x / x.shape[0]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w = w0.clone()
    w[:, dead] = 0
    h += percdamp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    cols = w.shape[1]
    inv = [torch.linalg.inv(h[j:, j:]) for j in range(cols)]
    keep = torch.ones_like(w, dtype=torch.bool)
    for j in range(cols):
        if j % m == 0:
            score = torch.stack([w[:, k] ** 2 / inv[k][0, 0] for k in range(j, j + m)], dim=1)
            order = torch.sort(-score, dim=1, stable=True).indices
            group = torch.zeros_like(score, dtype=torch.bool).scatter_(1, order[:, :n], True)
            keep[:, j:j + m] = group
        if scales is None:
            kept = w[:, j]
        else:
            s = scales.double() if scales.dim() == 1 else scales.double()[:, j // (cols // scales.shape[1])]
            kept = torch.where(s != 0, torch.round(w[:, j] / torch.where(s != 0, s, 1.0)), 0.0).clamp(*levels) * s
        q = torch.where(keep[:, j], kept, torch.zeros_like(w[:, j]))
        w[:, j:] -= ((w[:, j] - q) / inv[j][0, 0]).unsqueeze(1) * inv[j][0].unsqueeze(0)
        w[:, j] = q
    out = w if update else w0 * keep
    return out.to(torch.float32), keep


def int8_activation_linear(x, codes, row_scales, bias=None):
    """float64 ``F.linear`` of int8 weight ``codes`` ``[N, K]`` (times ``row_scales``) with ``x`` quantized to int8
    in blocks of 32 positions along K: a block's scale ``d`` is its largest magnitude / 127 (in fp32), its codes
    ``x * (127 / amax)`` (fp32) rounded to nearest even; ``y = scale_row * sum_blocks d * (codes . codes)``. A
    block holding NaN or inf makes its token's outputs NaN. ``row_scales`` ``[N, K / group]`` (4-bit weights): a
    scale per row and group of positions, each block's product times its group's."""
    k = x.shape[-1]
    x32 = torch.nn.functional.pad(x.reshape(-1, k).float(), (0, -k % 32))
    blocks = x32.view(x32.shape[0], x32.shape[1] // 32, 32)
    amax = blocks.abs().amax(-1)
    finite = torch.isfinite(blocks).all(-1)
    d = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    # 127 / amax as one fp32 division (Python's 127 / tensor is 127 * reciprocal(tensor), one more rounding)
    inv = torch.where(finite & (amax > 0), torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(torch.nan_to_num(blocks, 0.0, 0.0, 0.0) * inv[..., None]).double()
    w = torch.nn.functional.pad(codes.double(), (0, -k % 32)).view(codes.shape[0], -1, 32)
    dots = torch.einsum("tbk,nbk->tnb", q, w)
    if row_scales.dim() == 2:  # [N, K / group]: each block's group's scale
        per_block = row_scales.double().repeat_interleave(k // row_scales.shape[1] // 32, dim=1)
        y = (dots * d.double()[:, None, :] * per_block[None]).sum(-1)
    else:
        y = (dots * d.double()[:, None, :]).sum(-1) * row_scales.double()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], codes.shape[0])


def int4_groups(w, group):
    """``(codes, scales)`` of a 2:4 weight ``w`` ``[N, K]`` on 4-bit grids, from the definition: per row and group
    of ``group`` positions, ``d`` = the group's value of largest magnitude (the first in position order) / -8,
    rounded to fp16; codes ``round(w / d)`` (the quotient in fp32) clamped to -8..7 (0 where ``d`` is 0). Returns the codes as a dense
    float64 ``[N, K]`` (0 at pruned positions) and ``d`` as float64 ``[N, K / group]``."""
    n, k = w.shape
    wg = w.double().view(n, k // group, group)
    top = wg.gather(2, wg.abs().argmax(2, keepdim=True)).squeeze(2)
    d = (top.float() / -8).half().double()
    dd = d.repeat_interleave(group, dim=1)
    quotient = (w.float() / torch.where(dd != 0, dd, 1.0).float()).double()
    codes = torch.where(dd != 0, torch.round(quotient), 0.0).clamp(-8, 7)
    return codes, d


def int8_rows(w):
    """``(codes, scales)`` of ``w`` ``[N, K]`` on symmetric int8 grids, from the definition: per row ``s`` = its
    largest magnitude / 127 in fp32 (1 for a row of zeros), codes ``round(w / s)`` (the quotient in fp32) in
    -127..127; codes as float64 ``[N, K]``, ``s`` float64 ``[N]``."""
    top = w.float().abs().amax(1)
    s = torch.where(top > 0, top / 127, torch.ones_like(top))
    return torch.round(w.float() / s[:, None]).clamp(-127, 127).double(), s.double()


def distillation_kl(student, teacher, temperature):
    """Hinton et al.'s soft-target term: T^2 * mean over positions of sum_v p_v (log p_v - log q_v), p =
    softmax(teacher / T), q = softmax(student / T); float64, the softmax written out."""
    s, t = student.double().reshape(-1, student.shape[-1]) / temperature, teacher.double().reshape(-1, teacher.shape[-1]) / temperature
    p = torch.exp(t - t.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    q = torch.exp(s - s.max(-1, keepdim=True).values)
    q = q / q.sum(-1, keepdim=True)
    return float((p * (torch.log(p) - torch.log(q))).sum(-1).mean()) * temperature ** 2


def squarehead(student_states, teacher_states):
    """SquareHead's layer-wise term: sum over blocks of MSE(h_s, h_t) / Var(h_t), float64 (population variance)."""
    total = 0.0
    for s, t in zip(student_states, teacher_states):
        s, t = s.double().flatten(), t.double().flatten()
        total += float(((s - t) ** 2).sum() / s.numel()) / float(((t - t.mean()) ** 2).sum() / t.numel())
    return total
