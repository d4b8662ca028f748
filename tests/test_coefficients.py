"""The Newton-Schulz coefficient presets against their published sources, the Polar Express rows
against the minimax construction that defines them, and `schedule`'s truncate-or-repeat rule.

The literals below are typed from the sources named beside them, not from dmuon_fn: a preset
that drifts from its source (a digit lost, a row reordered, a safety factor applied twice)
fails here, whatever the rest of the suite computes from it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dmuon_fn.ns._iteration import (
    _POLAR_EXPRESS_RAW,
    KELLER,
    POLAR_EXPRESS,
    POLAR_EXPRESS_SAFETY,
    PRESETS,
    YOU,
    schedule,
)

# Amsel, Persson, Musco & Gower 2025, "The Polar Express", https://arxiv.org/abs/2505.16932,
# Algorithm 1 (`coeffs_list`, degree 5, l = 1e-3): its first five of eight rows, before the
# paper's own safety division. The same five rows, undivided, are
# `_unmodified_polar_express_coefficients` in gram_newton_schulz/coefficients.py of
# https://github.com/Dao-AILab/gram-newton-schulz (Zhang, Amsel, Chen & Dao).
PAPER_POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
# gram-newton-schulz's `safety_factor` for those rows (the paper's Algorithm 1 uses 1.01).
GRAM_NS_SAFETY = 1.05

# Keller Jordan's quintic: `a, b, c = (3.4445, -4.7750, 2.0315)` in muon.py
# (zeropower_via_newtonschulz5) of https://github.com/KellerJordan/Muon; the Polar Express
# paper quotes the same polynomial.
KELLER_JORDAN = ((3.4445, -4.7750, 2.0315),)

# You Jiacheng's schedule, https://x.com/YouJiacheng/status/1905861218138804534, as
# gram-newton-schulz's coefficients.py ships it (`YOU_COEFFICIENTS`).
YOU_JIACHENG = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# The interval Polar Express is designed for: σ/‖G‖_F in [L0, 1].
L0 = 1e-3
# The published rows have 16 digits; carried through the intervals [l_t, u_t] their rounding
# leaves the equioscillation conditions below off by up to 5e-12 (row 4); changing any one of
# the 15 numbers by one part in 1e9 already breaks them.
TIGHT = 1e-10


def _p(row, x):
    a, b, c = row
    return a * x + b * x**3 + c * x**5


def _critical_points(row):
    """The two positive roots x1 < x2 of p'(x) = a + 3b·x² + 5c·x⁴ (a local max, then a min)."""
    a, b, c = row
    disc = math.sqrt(9 * b * b - 20 * a * c)
    roots = sorted(((-3 * b - disc) / (10 * c), (-3 * b + disc) / (10 * c)))
    return math.sqrt(roots[0]), math.sqrt(roots[1])


def _intervals(rows):
    """[l_t, u_t] each row of the schedule sees when the first sees [L0, 1]."""
    lo, hi, out = L0, 1.0, []
    for row in rows:
        out.append((lo, hi))
        lo, hi = _p(row, lo), _p(row, hi)
    return out, (lo, hi)


# ------------------------------------------------------------------ the published numbers


def test_polar_express_raw_rows_are_the_papers():
    assert _POLAR_EXPRESS_RAW == PAPER_POLAR_EXPRESS


def test_polar_express_ships_the_raw_rows_scaled_by_the_safety_factor():
    """A row (a, b, c) divided as (a/s, b/s³, c/s⁵) is p(x/s): the same polynomial evaluated
    on singular values shrunk by s, so one rounded up by up to 5% still lands where the
    paper's polynomial was designed to act."""
    s = GRAM_NS_SAFETY
    assert s == POLAR_EXPRESS_SAFETY
    assert len(POLAR_EXPRESS) == len(PAPER_POLAR_EXPRESS)
    for shipped, (a, b, c) in zip(POLAR_EXPRESS, PAPER_POLAR_EXPRESS, strict=True):
        assert shipped == pytest.approx((a / s, b / s**3, c / s**5), rel=1e-15, abs=0)
    x = np.linspace(0.0, 1.2, 241)
    for shipped, raw in zip(POLAR_EXPRESS, PAPER_POLAR_EXPRESS, strict=True):
        np.testing.assert_allclose(_p(shipped, x), _p(raw, x / s), rtol=1e-13, atol=1e-13)
    # the first (steepest) row is what the factor tames: its slope at 0 drops from 8.287 to a/s
    assert POLAR_EXPRESS[0][0] == pytest.approx(8.28721201814563 / 1.05, rel=1e-15)


def test_keller_and_you_are_their_sources():
    assert KELLER == KELLER_JORDAN
    assert YOU == YOU_JIACHENG


def test_keller_is_torch_optim_muons_default():
    muon = pytest.importorskip("torch.optim._muon")  # private module: absent in older torch
    assert KELLER == ((muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C),)


def test_presets_are_the_three_schedules():
    assert PRESETS == {
        "keller": KELLER_JORDAN,
        "polar_express": POLAR_EXPRESS,
        "you": YOU_JIACHENG,
    }


# ------------------------------------------------------------------ the construction


def test_polar_express_rows_equioscillate_on_their_intervals():
    """Each Polar Express row is the degree-5 odd minimax approximation of 1 on an interval
    [k_t, u_t], recentred so that p(l_t) + p(u_t) = 2 (the paper's construction; u_{t+1} =
    p_t(u_t) = 2 − l_{t+1}). Minimax means equioscillation: p − 1 takes its extreme values
    alternately at k_t < x1 < x2 < u_t, i.e. p(x1) = p(u_t) and p(x2) = p(k_t). The first rows
    are "cushioned" (`cushion` in the paper's reference code, github.com/NoahAmsel/PolarExpress):
    k_t = κ·u_t above l_t, with one κ for every such row; once l_t passes κ·u_t the row is the
    plain minimax on [l_t, u_t] (k_t = l_t).

    Checked from the literal rows alone: nothing here is fitted to them but κ, which the first
    row determines and the next two must share."""
    intervals, _ = _intervals(PAPER_POLAR_EXPRESS)
    cushions = []
    for t, (row, (lo, hi)) in enumerate(zip(PAPER_POLAR_EXPRESS, intervals, strict=True)):
        x1, x2 = _critical_points(row)
        assert lo < x2 and x1 < x2 < hi, t
        assert _p(row, lo) + _p(row, hi) == pytest.approx(2.0, abs=TIGHT), t
        assert _p(row, x1) == pytest.approx(_p(row, hi), rel=TIGHT), t
        # k_t: where p climbs back to its minimum's value, left of the local max x1
        target = _p(row, x2)
        if _p(row, lo) >= target * (1 - TIGHT):
            k = lo  # p(l_t) = p(x2): minimax on [l_t, u_t] itself
            assert _p(row, lo) == pytest.approx(target, rel=TIGHT), t
        else:
            a, b = lo, x1  # p is increasing on [l_t, x1] and p(l_t) < p(x2) < p(x1)
            for _ in range(200):
                mid = (a + b) / 2
                a, b = (mid, b) if _p(row, mid) < target else (a, mid)
            k = (a + b) / 2
            cushions.append(k / hi)
        assert k >= lo
    # rows 0-2 are cushioned (l_t = 1e-3, 8.3e-3, 0.034 below κ·u_t), rows 3-4 are not
    assert len(cushions) == 3
    assert cushions == pytest.approx([cushions[0]] * 3, rel=1e-9)
    assert 0.024 < cushions[0] < 0.0241  # the paper's cushion, about 0.02407


def test_polar_express_maps_its_interval_into_a_narrow_band_around_one():
    """The paper's guarantee for the raw rows: σ in [1e-3, 1] ends in [l_5, 2 − l_5] after the
    five steps, l_5 = 0.8764 (each step keeps the image symmetric about 1), so the worst
    singular value is off by 12.4%, and that worst case is σ = 1e-3 itself."""
    _, (lo, hi) = _intervals(PAPER_POLAR_EXPRESS)
    assert lo == pytest.approx(0.876441, abs=1e-6) and hi == pytest.approx(2 - lo, abs=1e-11)
    x = np.logspace(-3, 0, 200_001)
    y = x
    for row in PAPER_POLAR_EXPRESS:
        y = _p(row, y)
    assert y.min() >= lo - 1e-12 and y.max() <= hi + 1e-12
    assert y[0] == pytest.approx(lo, rel=1e-12)
    # the composition's slope at 0 is the product of the rows' a, ~1e3: what lifts the
    # smallest designed σ, 1e-3, to order 1
    assert math.prod(r[0] for r in PAPER_POLAR_EXPRESS) == pytest.approx(1026.06, rel=1e-5)


def test_keller_row_overshoots_where_polar_express_does_not():
    """Keller's row trades accuracy for slope: p(1) = 0.701 (no fixed point at 1) and five
    steps leave σ in a band reaching 1.2, where Polar Express stays within 12.4% of 1."""
    (row,) = KELLER_JORDAN
    assert _p(row, 1.0) == pytest.approx(0.701, abs=1e-12)
    x = np.logspace(-3, 0, 20_001)
    y = x
    for _ in range(5):
        y = _p(row, y)
    assert y.max() > 1.2 and y.min() < 0.48


# ------------------------------------------------------------------ schedule


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_schedule_truncates_or_repeats_the_last_row(name):
    rows = PRESETS[name]
    for steps in range(1, 12):
        got = schedule(name, steps)
        assert len(got) == steps
        want = tuple(rows[i] if i < len(rows) else rows[-1] for i in range(steps))
        assert got == want, steps


def test_schedule_of_explicit_rows():
    rows = [[3, -3.2, 1.2], (2.5, -2.0, 0.6)]
    assert schedule(rows, 1) == ((3.0, -3.2, 1.2),)
    assert schedule(rows, 4) == (
        (3.0, -3.2, 1.2),
        (2.5, -2.0, 0.6),
        (2.5, -2.0, 0.6),
        (2.5, -2.0, 0.6),
    )
    assert all(isinstance(v, float) for row in schedule(rows, 2) for v in row)
    assert schedule(PRESETS["you"], 5) == YOU_JIACHENG


@pytest.mark.parametrize(
    ("coefficients", "steps", "match"),
    [
        ("polar_express", 0, "steps must be a positive int"),
        ("polar_express", -1, "steps must be a positive int"),
        ("polar_express", True, "steps must be a positive int"),
        ("polar_express", 2.0, "steps must be a positive int"),
        ("nope", 5, "unknown coefficients preset"),
        ([], 5, "non-empty list of"),
        ([(1.0, 2.0)], 5, "non-empty list of"),
        ([(1.0, 2.0, 3.0, 4.0)], 5, "non-empty list of"),
    ],
)
def test_schedule_refuses_bad_arguments(coefficients, steps, match):
    with pytest.raises(ValueError, match=match):
        schedule(coefficients, steps)
