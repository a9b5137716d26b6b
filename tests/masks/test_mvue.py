"""Tests for nmcompile.masks.mvue: the unbiased minimum-variance N:M gradient sparsifier."""

import pytest
import torch

from nmcompile.masks.mvue import inclusion_probabilities, mvue, mvue_variance

DRAWS = 40_000

# one group of 4 per row: generic, skewed (max > S/2), exact ties, skewed with tied others,
# a single non-zero, two non-zeros, an element with a tiny probability, all zeros
GROUPS = torch.tensor(
    [
        [1.0, -2.0, 3.0, 4.0],
        [10.0, 1.0, -1.0, 0.5],
        [2.0, -2.0, 2.0, 2.0],
        [-5.0, 1.0, 1.0, -1.0],
        [0.0, 0.0, -3.0, 0.0],
        [0.0, 1.5, 0.0, -0.5],
        [1e-3, 1.0, -1.0, 1.0],
        [0.0, 0.0, 0.0, 0.0],
    ]
)
ROWS = torch.cat([GROUPS, GROUPS.roll(1, 0).flip(1)], dim=1)  # rows of 8, for M = 8 too

PATTERNS = [(1, 2), (2, 4), (1, 4), (2, 8)]


def _groups(t, m):
    return t.unflatten(-1, (-1, m))


def _draws(x, n, m, draws=DRAWS):
    """``draws`` independent samples of mvue(x) along the last dim, stacked on a new dim 0."""
    return mvue(x.expand(draws, *x.shape), n, m)


def _successive_marginals(a):
    """Inclusion probabilities of drawing 2 of 4 without replacement, each draw prop. to a.

    The first pick is i with p_i = a_i / S; after picking j, the second is i with a_i / (S - a_j).
    """
    s = a.sum(-1, keepdim=True)
    p = a / s
    second = p.unsqueeze(-1) * a.unsqueeze(-2) / (s.unsqueeze(-1) - a.unsqueeze(-1))  # [j, i]
    eye = torch.eye(a.shape[-1], dtype=torch.bool)
    return p + torch.where(eye, 0.0, second).sum(-2)


def _ht_variance(a, pi):
    return (a * a * (1 / pi - 1)).sum(-1)


def _pairs_variance(a):
    """Two independent 1:2 estimators on (a0, a1) and (a2, a3)."""
    return 2 * a[..., 0] * a[..., 1] + 2 * a[..., 2] * a[..., 3]


def test_hand_computed_2_4():
    x = GROUPS[:6]
    pi = inclusion_probabilities(x, 2, 4)
    expected = [
        [0.2, 0.4, 0.6, 0.8],  # max 4 <= S/2 = 5: 2 a / S
        [1.0, 0.4, 0.4, 0.2],  # max 10 > S/2: kept; others a / 2.5
        [0.5, 0.5, 0.5, 0.5],
        [1.0, 1 / 3, 1 / 3, 1 / 3],
        [0.0, 0.0, 1.0, 0.0],
        [0.0, 1.0, 0.0, 1.0],
    ]
    torch.testing.assert_close(pi, torch.tensor(expected))
    # 1*4 + 4*1.5 + 9*(2/3) + 16*0.25 = 20; skewed: sum a (R - a) over the others, R = 2.5 -> 4
    # ties: 4 * (4 * 1); tied others: sum 1 * (3 - 1)
    torch.testing.assert_close(mvue_variance(x, 2, 4), torch.tensor([[20.0], [4.0], [16.0], [6.0], [0.0], [0.0]]))


@pytest.mark.parametrize("n,m", PATTERNS, ids=lambda v: str(v))
def test_probabilities_sum_to_n_or_nonzero_count(n, m):
    x = torch.cat([ROWS, torch.randn(64, 8) * torch.randint(0, 2, (64, 8))])
    pi = _groups(inclusion_probabilities(x, n, m), m)
    nonzero = _groups(x != 0, m).sum(-1).clamp(max=n).float()
    torch.testing.assert_close(pi.sum(-1), nonzero)
    assert ((pi > 0) == _groups(x != 0, m)).all() and (pi <= 1).all()


@pytest.mark.parametrize("n,m", PATTERNS, ids=lambda v: str(v))
def test_unbiased_and_variance_matches_closed_form(n, m):
    torch.manual_seed(1)
    samples = _draws(ROWS, n, m).double()
    mean = samples.mean(0)
    pi = inclusion_probabilities(ROWS, n, m).double()
    x = ROWS.double()
    safe_pi = torch.where(pi > 0, pi, 1.0)
    element_var = x * x * (1 / safe_pi - 1)
    stderr = (element_var / DRAWS).sqrt()
    # kept-for-sure and zero entries must come out exact; the rest within 5 standard errors
    assert ((mean - x).abs() <= 5 * stderr + 1e-6 * x.abs() + 1e-12).all(), (mean - x)

    # each entry is x/pi with probability pi, else 0: its 4th central moment gives the standard
    # error of its sample variance (large for rarely kept entries, small for the rest)
    fourth = pi * (x * (1 / safe_pi - 1)) ** 4 + (1 - pi) * x**4
    var_stderr = _groups(((fourth - element_var**2).clamp_min(0) / DRAWS).sqrt(), m).sum(-1)
    group_var = _groups(samples.var(0), m).sum(-1)
    expected = mvue_variance(ROWS, n, m).double()
    torch.testing.assert_close(expected, _groups(element_var, m).sum(-1), rtol=1e-5, atol=1e-9)
    # (the last term covers the O(1/N) error of using the sample mean; it is all there is for
    # entries whose |y - x| is constant, e.g. ties kept with pi = 1/2)
    tol = 5 * var_stderr + 10 * expected / DRAWS + 1e-9
    assert ((group_var - expected).abs() <= tol).all(), (group_var, expected)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4)], ids=lambda v: str(v))
def test_keep_frequencies_match_probabilities(n, m):
    torch.manual_seed(2)
    kept = (_draws(ROWS, n, m) != 0).double().mean(0)
    pi = inclusion_probabilities(ROWS, n, m).double()
    assert ((kept - pi).abs() <= 5 * (pi * (1 - pi) / DRAWS).sqrt() + 1e-12).all()


@pytest.mark.parametrize("n,m", PATTERNS, ids=lambda v: str(v))
def test_keeps_exactly_min_n_nonzeros(n, m):
    torch.manual_seed(3)
    x = torch.randn(256, 32) * torch.randint(0, 2, (256, 32))
    x[:, :4] *= 100  # many skewed groups
    y = mvue(x, n, m)
    expected = _groups(x != 0, m).sum(-1).clamp(max=n)
    assert (_groups(y != 0, m).sum(-1) == expected).all()
    # the uniforms at and beyond the ends of [0, 1) must not lose or add an element
    for value in (0.0, 1.0 - 2**-24, 1.0 - 2**-23, 1.0):
        u = torch.full((256, 32 // m), value)
        assert (_groups(mvue(x, n, m, u=u) != 0, m).sum(-1) == expected).all(), value


def test_skewed_group_always_keeps_its_max_exactly():
    torch.manual_seed(4)
    a = torch.rand(4096, 4)
    a[:, 0] = a[:, 1:].sum(-1) * (1 + torch.rand(4096))  # max > S/2
    x = (a * torch.randn(4096, 4).sign()).roll(1, 1)  # the max sits at position 1
    for _ in range(3):
        y = mvue(x, 2, 4)
        assert torch.equal(y[:, 1], x[:, 1])
        assert ((y[:, [0, 2, 3]] != 0).sum(-1) == 1).all()
        rest = x[:, [0, 2, 3]].abs().sum(-1, keepdim=True)
        kept = y[:, [0, 2, 3]]
        torch.testing.assert_close(kept.abs().sum(-1, keepdim=True), rest)


def test_1_2_keeps_one_as_sign_times_sum():
    torch.manual_seed(5)
    x = torch.randn(512, 2)
    y = mvue(x, 1, 2)
    assert ((y != 0).sum(-1) == 1).all()
    s = x.abs().sum(-1, keepdim=True)
    torch.testing.assert_close(y.abs().sum(-1, keepdim=True), s)
    assert (y.sign() == torch.where(y != 0, x.sign(), 0.0)).all()
    torch.testing.assert_close(mvue_variance(x, 1, 2).squeeze(-1), 2 * x[:, 0].abs() * x[:, 1].abs())
    torch.testing.assert_close(inclusion_probabilities(x, 1, 2), x.abs() / s)


def test_reference_sampler_formula_matches_monte_carlo():
    # the comparison below relies on _successive_marginals; check it against real sampling
    torch.manual_seed(6)
    a = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    picks = torch.multinomial(a.expand(DRAWS, 4), 2, replacement=False)
    freq = torch.zeros(DRAWS, 4, dtype=torch.float64).scatter_(1, picks, 1.0).mean(0)
    pi = _successive_marginals(a)
    assert ((freq - pi).abs() <= 5 * (pi * (1 - pi) / DRAWS).sqrt()).all()
    assert abs(pi.sum().item() - 2) < 1e-12


def test_exact_2_4_beats_successive_sampling_and_two_1_2():
    skewed = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 10.0]], dtype=torch.float64)
    exact = mvue_variance(skewed, 2, 4).squeeze(-1)
    approx = _ht_variance(skewed, _successive_marginals(skewed))
    pairs = _pairs_variance(skewed)
    torch.testing.assert_close(exact, torch.tensor([20.0, 22.0], dtype=torch.float64))
    torch.testing.assert_close(pairs, torch.tensor([28.0, 64.0], dtype=torch.float64))
    # approx is 20.47 and 29.84: the exact form gains most when one magnitude dominates
    assert (exact < approx - 0.4).all() and exact[1] < 0.8 * approx[1], (exact, approx)
    assert (exact < 0.8 * pairs).all(), (exact, pairs)

    torch.manual_seed(7)
    a = (torch.randn(2000, 4, dtype=torch.float64) * 2).exp()  # heavy-tailed magnitudes
    exact = mvue_variance(a, 2, 4).squeeze(-1)
    assert (exact <= _ht_variance(a, _successive_marginals(a)) * (1 + 1e-9)).all()
    assert (exact <= _pairs_variance(a) * (1 + 1e-9)).all()


def test_reproducible_under_manual_seed():
    x = torch.randn(16, 32)
    torch.manual_seed(8)
    first = mvue(x, 2, 4)
    torch.manual_seed(8)
    assert torch.equal(mvue(x, 2, 4), first)
    assert not torch.equal(mvue(x, 2, 4), first)


@pytest.mark.parametrize("shape,dim", [((8, 6), 0), ((6, 8), 1), ((3, 8, 5), 1), ((3, 8, 5), -2)])
def test_groups_along_dim(shape, dim):
    torch.manual_seed(9)
    x = torch.randn(shape)
    last = x.movedim(dim, -1)
    u = torch.rand(last.shape[:-1] + (last.shape[-1] // 4,))
    y = mvue(x, 2, 4, dim, u=u)
    assert y.shape == x.shape
    torch.testing.assert_close(y, mvue(last, 2, 4, u=u).movedim(-1, dim))
    assert (_groups(y.movedim(dim, -1) != 0, 4).sum(-1) == 2).all()
    torch.testing.assert_close(
        inclusion_probabilities(x, 2, 4, dim), inclusion_probabilities(last, 2, 4).movedim(-1, dim)
    )
    assert mvue_variance(x, 2, 4, dim).shape == u.shape
    assert mvue(x, 2, 4, dim).shape == x.shape  # with its own uniforms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input(dtype):
    x = torch.randn(8, 16).to(dtype)
    u = torch.rand(8, 4)
    y = mvue(x, 2, 4, u=u)
    assert y.dtype == dtype
    torch.testing.assert_close(y, mvue(x.float(), 2, 4, u=u).to(dtype))
    assert inclusion_probabilities(x, 2, 4).dtype == torch.float32
    assert mvue_variance(x, 2, 4).dtype == torch.float32


def test_all_zero_gives_zeros_without_nan():
    x = torch.zeros(4, 8)
    for n, m in PATTERNS:
        assert torch.equal(mvue(x, n, m), x)
        assert torch.equal(inclusion_probabilities(x, n, m), x)
        assert torch.equal(mvue_variance(x, n, m), torch.zeros(4, 8 // m))


def test_compiled_matches_eager():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, u: mvue(x, 2, 4, 0, u=u), backend="inductor", fullgraph=True)
    x = torch.cat([GROUPS.T, torch.randn(4, 3)], dim=1)  # [4, 11]: one group per column
    u = torch.rand(11, 1)
    u[:2] = torch.tensor([[0.0], [1.0 - 2**-24]])
    torch.testing.assert_close(compiled(x, u), mvue(x, 2, 4, 0, u=u), rtol=0, atol=0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: mvue(torch.randn(4, 6), 2, 4), "size 6 is not a multiple of M=4"),
        (lambda: mvue(torch.randn(6, 8), 2, 4, 0), "multiple of 4"),
        (lambda: mvue(torch.randn(4, 8), 3, 4), r"N in \(1, 2\).*got 3:4"),
        (lambda: mvue(torch.randn(4, 8), 2, 2), "got 2:2"),
        (lambda: inclusion_probabilities(torch.randn(4, 8), 4, 8), "1:2, 2:4"),
        (lambda: mvue_variance(torch.randn(4, 6), 1, 4), "multiple of 4"),
        (lambda: mvue(torch.ones(4, 8, dtype=torch.int64), 2, 4), "floating-point"),
        (lambda: mvue(torch.randn(4, 8), 2, 4, u=torch.rand(4, 8)), r"one uniform per group, shape \(4, 2\)"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
