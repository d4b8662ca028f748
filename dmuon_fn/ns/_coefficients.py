"""Newton-Schulz coefficient presets: data with provenance, safety factors applied visibly. Each
row (a, b, c) is one quintic step X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X."""

from __future__ import annotations

from collections.abc import Sequence

Row = tuple[float, float, float]

# Keller Jordan's single quintic, https://kellerjordan.github.io/posts/muon/ (torch.optim.Muon's).
KELLER: tuple[Row, ...] = ((3.4445, -4.7750, 2.0315),)

# Polar Express, Amsel, Persson, Musco & Gower 2025, https://arxiv.org/abs/2505.16932: the
# paper's 5-step minimax schedule (l = 1e-3), then divided by a safety factor of 1.05 as
# (a/s, b/s³, c/s⁵) so that rounding cannot push a singular value past the basin of convergence.
_POLAR_EXPRESS_RAW: tuple[Row, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
POLAR_EXPRESS_SAFETY = 1.05
POLAR_EXPRESS: tuple[Row, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW
)

# You Jiacheng's tuned 5-step schedule, https://x.com/YouJiacheng/status/1905861218138804534
# (as shipped by Dao-AILab/gram-newton-schulz).
YOU: tuple[Row, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

PRESETS: dict[str, tuple[Row, ...]] = {"keller": KELLER, "polar_express": POLAR_EXPRESS, "you": YOU}


def schedule(coefficients: str | Sequence[Sequence[float]], steps: int) -> tuple[Row, ...]:
    """Exactly `steps` rows: a preset name or explicit rows, truncated or last-row-repeated."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(
                f"unknown coefficients preset {coefficients!r}; "
                f"choose one of {sorted(PRESETS)} or pass a list of (a, b, c) rows"
            )
        rows = PRESETS[coefficients]
    else:
        rows = tuple(tuple(float(v) for v in row) for row in coefficients)
        if not rows or any(len(row) != 3 for row in rows):
            raise ValueError(
                f"coefficients must be a non-empty list of (a, b, c) rows, got {coefficients!r}"
            )
    return tuple(rows[min(i, len(rows) - 1)] for i in range(steps))  # type: ignore[misc]
