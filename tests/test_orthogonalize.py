"""orthogonalize against float64 reference math (see proofs/ for the invariants)."""

from __future__ import annotations

import functools
import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn import orthogonalize
from dmuon_fn.ns import _iteration as iteration_module
from dmuon_fn.ns import _orthogonalize as orth_module
from dmuon_fn.ns._cost import default_restarts
from dmuon_fn.ns._iteration import PRESETS, schedule
from dmuon_fn.ns._orthogonalize import NSConfig, orthogonalize_with
from tests._tolerance import NS_LOW_PRECISION, PRODUCT, rel_err

ASPECTS = [0.25, 0.5, 1.0, 1.5, 2.0, 4.0, 8.0]


def _matrix(rows, cols, cond, seed, batch=(), dtype=torch.float64):
    """Random (batch..., rows, cols) with singular values log-spaced from 1 down to 1/cond."""
    g = torch.Generator().manual_seed(seed)
    r = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(*batch, rows, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, cols, r, generator=g, dtype=torch.float64))
    S = torch.logspace(0, -np.log10(cond), r, dtype=torch.float64)
    return ((U * S) @ V.mT).to(dtype)


def _scalar_map(rows, sigma):
    """The NS polynomial composition applied to normalized singular values, in float64."""
    s = np.asarray(sigma, dtype=np.float64)
    for a, b, c in rows:
        s = a * s + b * s**3 + c * s**5
    return s


def _shape(n, aspect):
    return n, max(1, round(n * aspect))


def _ns_reference(G, rows):
    """Newton-Schulz written out from its definition in float64, sharing no code with dmuon_fn
    (no custom op, no Gram form, no max-scaling): on the short side, X₀ = G/‖G‖_F, then per row
    (a, b, c): X ← a·X + b·(XXᵀ)·X + c·(XXᵀ)²·X."""
    X = G.double()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / torch.linalg.matrix_norm(X)[..., None, None]
    for a, b, c in rows:
        A = X @ X.mT
        X = a * X + b * (A @ X) + c * (A @ (A @ X))
    return X.mT if tall else X


def _rows(coefficients, steps):
    """`steps` rows of a preset or explicit list: truncated, or the last row repeated."""
    rows = list(PRESETS[coefficients] if isinstance(coefficients, str) else coefficients)
    return [tuple(r) for r in rows[:steps]] + [tuple(rows[-1])] * (steps - len(rows))


def _well_conditioned(rows, cols, seed, batch=()):
    """37·U·diag(S)·Vᵀ with S log-spaced over [1e-2, 1], and U, S, V: after normalization every
    σ/‖G‖_F lies in [4e-3, 0.51], inside the [1e-3, 1] the presets are designed for."""
    g = torch.Generator().manual_seed(seed)
    r = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(*batch, rows, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, cols, r, generator=g, dtype=torch.float64))
    S = torch.logspace(0, -2, r, dtype=torch.float64)
    return 37.0 * (U * S) @ V.mT, U, S, V


# wide, tall, square, and a batch; every short side >= 32, so bf16 Gram runs on all of them
REF_SHAPES = [((32, 80), ()), ((80, 32), ()), ((48, 48), ()), ((36, 90), (2,))]
REF_IDS = ["wide", "tall", "square", "batch"]
# explicit rows, fewer than the steps asked for: the last repeats
CUSTOM = ((3.0, -3.2, 1.2), (2.5, -2.0, 0.6))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 24),
    aspect=st.sampled_from(ASPECTS),
    preset=st.sampled_from(sorted(PRESETS)),
    steps=st.integers(1, 7),
    cond=st.sampled_from([1.0, 10.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_singular_values_follow_the_scalar_map(n, aspect, preset, steps, cond, seed):
    """In float64 the output's singular values are exactly f(σ/‖G‖_F), f the composed quintic."""
    G = _matrix(*_shape(n, aspect), cond, seed)
    for method in ("standard", "gram"):
        O = orthogonalize(
            G, steps=steps, coefficients=preset, method=method, eps=0.0, dtype=torch.float64
        )
        got = torch.linalg.svdvals(O).numpy()
        s = torch.linalg.svdvals(G).numpy() / torch.linalg.matrix_norm(G).item()
        want = np.sort(np.abs(_scalar_map(schedule(preset, steps), s)))[::-1]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 32),
    aspect=st.sampled_from(ASPECTS),
    batch=st.sampled_from([(), (3,)]),
    cond=st.sampled_from([1.0, 100.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gram_equals_standard(n, aspect, batch, cond, seed):
    G = _matrix(*_shape(n, aspect), cond, seed, batch)
    # The composed polynomial's slope at small σ (∏ a_i ≈ 1e3 for Polar Express) amplifies the
    # iteration dtype's rounding: float32's 6e-8 becomes up to ~1e-4 on ill-conditioned input.
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-3)):
        std = orthogonalize(G, method="standard", dtype=dtype)
        gram = orthogonalize(G, method="gram", dtype=dtype)
        assert rel_err(gram, std) < tol


# The band each preset promises for σ/‖G‖_F in [1e-3, 1] (Polar Express's design interval),
# computed by `_scalar_map` on a dense grid; the iteration dtype adds its rounding on top.
_GRID = np.logspace(-3, 0, 20001)
_MAPS = {p: _scalar_map(schedule(p, 5), _GRID) for p in PRESETS}
BANDS = {p: (m.min(), m.max()) for p, m in _MAPS.items()}
BAND_SLACK = {torch.float32: 1e-3, torch.bfloat16: 0.04}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aspect", [0.25, 1.0, 2.0, 4.0, 8.0])
def test_singular_values_lie_in_preset_band(preset, dtype, aspect):
    lo, hi = BANDS[preset]
    for cond, seed in ((1.0, 1), (30.0, 2), (300.0, 3)):
        rows, cols = (32, round(32 * aspect)) if aspect >= 1 else (round(32 / aspect), 32)
        G = _matrix(rows, cols, cond, seed, batch=(2,), dtype=torch.float32)
        s = torch.linalg.svdvals(G.double()) / torch.linalg.matrix_norm(G.double())[..., None]
        assert s.min() >= 1e-3  # inside the promised interval by construction
        for method in ("standard", "gram"):
            O = orthogonalize(G, coefficients=preset, method=method, dtype=dtype)
            sv = torch.linalg.svdvals(O.double())
            slack = BAND_SLACK[dtype]
            assert lo - slack <= sv.min() and sv.max() <= hi + slack, (method, cond, sv.aminmax())


def test_bands_are_what_the_presets_promise():
    """Guard the bands the docs quote for σ/‖G‖_F in [1e-3, 1] after 5 steps."""
    assert BANDS["keller"][0] > 0.47 and BANDS["keller"][1] < 1.21
    assert BANDS["polar_express"][0] > 0.72 and BANDS["polar_express"][1] < 1.13
    assert BANDS["you"][0] > 0.47 and BANDS["you"][1] < 1.15


# float64 against the polynomial written out: measured <= 1e-14 for the standard form and Gram
# with its default restarts, <= 1e-12 for Gram with no restart over 8 steps (one segment chains
# every product); 1e-10 leaves room for other BLAS orders, amplified by the composed
# polynomial's slope (∏a ≈ 800 for the shipped Polar Express rows).
F64_TOL = 1e-10


@pytest.mark.parametrize(("shape", "batch"), REF_SHAPES, ids=REF_IDS)
@pytest.mark.parametrize("coefficients", [*sorted(PRESETS), CUSTOM], ids=[*sorted(PRESETS), "rows"])
@pytest.mark.parametrize("steps", [5, 8])
def test_float64_is_the_polynomial_written_out(shape, batch, coefficients, steps):
    """Both forms, and Gram under any restarts (they change nothing in exact arithmetic:
    proofs/gram_ns.md), equal `_ns_reference` in float64."""
    G, *_ = _well_conditioned(*shape, seed=sum(shape) + steps, batch=batch)
    want = _ns_reference(G, _rows(coefficients, steps))
    runs = [("standard", None), ("gram", None), ("gram", ()), ("gram", (1, 3)), ("gram", (2,))]
    runs.append(("gram", tuple(range(1, steps))))  # a restart before every step
    for method, restarts in runs:
        O = orthogonalize(
            G,
            steps=steps,
            coefficients=coefficients,
            method=method,
            restarts=restarts,
            eps=0.0,
            dtype=torch.float64,
        )
        assert O.dtype == torch.float64 and O.shape == G.shape
        assert rel_err(O, want) < F64_TOL, (method, restarts, rel_err(O, want))


@pytest.mark.parametrize("shape", [(32, 80), (80, 32), (48, 48)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_float64_output_is_the_polar_factor_up_to_the_band(shape, preset, method):
    """Against torch.linalg.svd's factors of G = U·diag(S)·Vᵀ: the output is U·diag(d)·Vᵀ (G's
    own singular vectors, nothing outside them: Uᵀ·O·V is diagonal to rounding), every d_i is
    positive and inside the band the preset maps [1e-3, 1] into, so its distance to the polar
    factor U·Vᵀ, the RMS of d_i − 1, is at most the band's reach from 1: 0.271 (Polar Express,
    [0.729, 1.124]), 0.525 (You) and 0.529 (Keller). Measured here: <= 0.097, 0.037 and 0.193;
    Uᵀ·O·V's off-diagonal part, <= 6e-15."""
    G, *_ = _well_conditioned(*shape, seed=3)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    s = S / torch.linalg.matrix_norm(G)
    assert s.min() >= 1e-3  # inside the interval the band is promised for
    O = orthogonalize(G, coefficients=preset, method=method, eps=0.0, dtype=torch.float64)
    D = U.mT @ O @ Vh.mT
    d = torch.diagonal(D)
    assert rel_err(O, (U * d) @ Vh) < F64_TOL
    lo, hi = BANDS[preset]
    assert d.min() > 0 and lo - 1e-6 <= d.min() and d.max() <= hi + 1e-6, d.aminmax()
    polar = U @ Vh
    bound = max(1 - lo, hi - 1)
    assert rel_err(O, polar) == pytest.approx(((d - 1) ** 2).mean().sqrt().item(), rel=1e-9)
    assert rel_err(O, polar) <= bound, (rel_err(O, polar), bound)
    # More steps repeat Polar Express's last row, whose attracting fixed point x* (p(x*) = x*,
    # |p'(x*)| = 0.58) is 1.0504, not 1: the safety factor keeps it off 1. So the iterates
    # converge to x*·U·Vᵀ, the polar factor's direction.
    if preset == "polar_express":
        a, b, c = PRESETS["polar_express"][-1]
        x_star = math.sqrt((-b - math.sqrt(b * b - 4 * c * (a - 1))) / (2 * c))
        assert x_star == pytest.approx(1.0504, abs=1e-4)
        more = orthogonalize(G, steps=20, method=method, eps=0.0, dtype=torch.float64)
        assert rel_err(more, x_star * polar) < 1e-3


# float32 / bf16 iterates against the float64 polynomial, on the well-conditioned input (σ/‖G‖_F
# >= 4e-3, where the composed slope is far below its ∏a ≈ 800 at 0): measured <= 2.7e-6 in
# float32 and <= 0.037 in bf16 (Gram; the standard form's <= 0.025), under
# tests/_tolerance.py's PRODUCT[float32] and NS_LOW_PRECISION.
LOW_TOL = {torch.float32: PRODUCT[torch.float32], torch.bfloat16: NS_LOW_PRECISION}


@pytest.mark.parametrize(("shape", "batch"), REF_SHAPES, ids=REF_IDS)
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("it", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_iteration_dtype_against_the_float64_polynomial(shape, batch, preset, method, it):
    """Both iteration dtypes, named explicitly, so both run on every machine whatever its
    dispatch would pick."""
    G, *_ = _well_conditioned(*shape, seed=5, batch=batch)
    want = _ns_reference(G, _rows(preset, 5))
    O = orthogonalize(G.float(), coefficients=preset, method=method, dtype=it)
    assert O.dtype == torch.float32
    assert rel_err(O, want) < LOW_TOL[it], rel_err(O, want)
    if it == torch.bfloat16:  # it really iterated in bf16 (measured ≥ 1.2e-2), not in fp32 (≤ 3e-6)
        assert rel_err(O, want) > 1e-4, rel_err(O, want)


def test_gram_restarts_are_configured_and_observable():
    """NSConfig.restarts: None means `default_restarts(steps)`, every second step; explicit sets
    are sorted and deduplicated. A restart is not a no-op in finite precision: dropping any one
    changes the bits, and dropping all of them lets bf16's error in R compound until the
    iteration diverges, where the default restarts hold it at the standard form's level."""
    assert NSConfig().restarts is None
    assert default_restarts(5) == (2, 4) and default_restarts(8) == (2, 4, 6)
    assert default_restarts(2) == () and default_restarts(3) == (2,)
    assert NSConfig(restarts=(4, 2, 2)).restarts == (2, 4)
    for shape in ((32, 80), (80, 32), (48, 48)):
        G, *_ = _well_conditioned(*shape, seed=1)
        want = _ns_reference(G, _rows("polar_express", 5))
        G = G.float()
        for it in (torch.float32, torch.bfloat16):
            run = functools.partial(orthogonalize, G, dtype=it)
            default = run(method="gram")
            assert torch.equal(run(method="gram", restarts=(4, 2)), default)
            variants = {r: run(method="gram", restarts=r) for r in ((2,), (4,), (), (1, 2, 3, 4))}
            for r, out in variants.items():
                assert not torch.equal(out, default), (shape, it, r)
            err = {r: rel_err(out, want) for r, out in variants.items()}
            err["default"] = rel_err(default, want)
            err["standard"] = rel_err(run(method="standard"), want)
            assert err["default"] < LOW_TOL[it] and err["standard"] < LOW_TOL[it], err
            # no restart: float32 rounding compounds over five steps of R (measured 10-12x the
            # default's error); bf16 diverges (measured 24 to 450, where the band ends at 1.12)
            if it == torch.float32:
                assert err[()] > 3 * err["default"], err
            else:
                assert err[()] > 1.0, err


# The spectra of test_default_restarts_hold_error_at_standard_level: (rows, cols), kind.
HARD_CASES = [
    (shape, kind) for shape in ((64, 128), (48, 384), (96, 256)) for kind in ("cond1e6", "rankdef")
]


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_restarts_hold_error_at_standard_level(method, dtype):
    """Ill-conditioned and rank-deficient input, aspect 2..8, against references computed
    outside dmuon_fn: the float64 polynomial written out (`_ns_reference`) and the polar factor
    P = U·Vᵀ over the nonzero singular values (rank-deficient: the null space maps to 0).

    float32 is within 1e-4 of the float64 polynomial (measured <= 1.4e-5: the input's float32
    rounding, 6e-8, times the composed slope at small σ, up to ∏a ≈ 800, gives 5e-5). bf16's
    distance to P exceeds the float64 polynomial's own by at most 0.2 (measured <= 0.14, standard
    on rank-deficient 48×384: the null space, which P maps to 0, takes the bf16 cast's rounding
    and the slope lifts it; <= 0.02 with condition 1e6). Gram NS with the default restarts also
    stays within 0.02 of the standard iteration's distance to P."""
    for (rows, cols), kind in HARD_CASES:
        g = torch.Generator().manual_seed(rows + cols)
        U, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
        V, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
        if kind == "cond1e6":
            S = torch.logspace(0, -6, rows, dtype=torch.float64)
        else:
            S = torch.cat([torch.logspace(0, -2, rows // 2), torch.zeros(rows - rows // 2)])
            S = S.double()
        G = (U * S) @ V.mT
        P = (U * (S > 0)) @ V.mT
        ref = _ns_reference(G, _rows("polar_express", 5))
        got = orthogonalize(G.float(), method=method, dtype=dtype)
        where = (rows, cols, kind)
        if dtype == torch.float32:
            assert rel_err(got, ref) < 1e-4, (*where, rel_err(got, ref))
        else:
            assert rel_err(got, P) <= rel_err(ref, P) + 0.2, (*where, rel_err(got, P))
        if method == "gram":
            std = orthogonalize(G.float(), method="standard", dtype=dtype)
            assert rel_err(got, P) <= rel_err(std, P) + 0.02, (*where, rel_err(got, P))


@settings(deadline=None, max_examples=20)
@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_tall_normalize_is_bitwise_the_transposed_one(rows, cols, seed, dtype):
    """normalize of a transposed view into a buffer (a tall matrix's path) equals, bit for bit,
    normalize of the contiguous transpose without one (proofs/ns_notes.md), with the transposing
    copy in one piece or by blocks of source rows (patched small: ragged last blocks, a batch)."""
    g = torch.Generator().manual_seed(seed)
    G = (torch.randn(rows, cols, generator=g) * 10.0).to(dtype)
    dt = torch.promote_types(dtype, torch.float32)
    plain = iteration_module.normalize(G.mT.contiguous(), 1e-7)
    whole = (iteration_module.TRANSPOSE_BLOCKED_FROM, iteration_module.TRANSPOSE_BLOCK)
    for blocked in (whole, (0, 7)):
        with (
            mock.patch.object(iteration_module, "TRANSPOSE_BLOCKED_FROM", blocked[0]),
            mock.patch.object(iteration_module, "TRANSPOSE_BLOCK", blocked[1]),
        ):
            buf = torch.empty(cols, rows, dtype=dt)
            via_view = iteration_module.normalize(G.mT, 1e-7, scratch=buf)
            B = torch.stack([G, -G])  # a batch of two tall matrices
            bufs = torch.empty(2, cols, rows, dtype=dt)
            got = iteration_module.normalize(B.mT, 1e-7, scratch=bufs)
        assert via_view.data_ptr() == buf.data_ptr()
        assert torch.equal(via_view, plain)
        assert torch.equal(got, iteration_module.normalize(B.mT.contiguous(), 1e-7))


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 20),
    aspect=st.sampled_from(ASPECTS),
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(["auto", "standard", "gram"]),
)
def test_transpose_equivariance(n, aspect, seed, method):
    """NS(Gᵀ) = NS(G)ᵀ: bitwise for non-square G (both iterate on the same short-side matrix);
    for square G the two iterate on Gᵀ and G, equal in exact arithmetic (proofs/ns_symmetry.md):
    compared in fp32 and fp64 iterates. (In bf16 the two roundings of a small, ill-conditioned
    square matrix part by up to 15% through the quintic's gain on small singular values, as a
    bf16 emulation of the same steps does too: no bound there tests the library.)"""
    G = _matrix(*_shape(n, aspect), 10.0, seed, dtype=torch.float32)
    dtype = torch.float32 if method == "gram" else None  # bf16 Gram needs >= 32 rows
    if G.shape[0] != G.shape[1]:
        a = orthogonalize(G.mT.contiguous(), method=method, dtype=dtype)
        assert torch.equal(a, orthogonalize(G, method=method, dtype=dtype).mT)
        return
    a = orthogonalize(G.mT.contiguous(), method=method, dtype=torch.float32)
    assert rel_err(a, orthogonalize(G, method=method, dtype=torch.float32).mT) < 1e-4
    a64 = orthogonalize(G.double().mT.contiguous(), method=method)
    assert rel_err(a64, orthogonalize(G.double(), method=method).mT) < 1e-10


@pytest.mark.parametrize("scale", [1e-20, 1e-10, 3.7e-3, 1.0, 5e5, 1e20])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_scale_invariance(scale, method):
    G = _matrix(32, 80, 100.0, 7, dtype=torch.float32)
    base = orthogonalize(G, method=method, dtype=torch.float32)
    scaled = orthogonalize(G * scale, method=method, dtype=torch.float32)
    assert rel_err(scaled, base) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_input_gives_zeros(dtype):
    for shape in ((5, 7), (3, 8, 4), (600, 600)):
        out = orthogonalize(torch.zeros(shape, dtype=dtype))
        assert out.dtype == dtype and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("it", [torch.bfloat16, torch.float32])
def test_huge_fp32_gradient_stays_finite(it):
    G = _matrix(40, 100, 10.0, 3, dtype=torch.float32)
    G = G / G.abs().max() * torch.finfo(torch.float32).max  # entries up to 3.4e38
    out = orthogonalize(G, dtype=it)
    assert torch.isfinite(out).all()
    # the two normalized copies differ by fp32 rounding, which the iteration may amplify
    assert rel_err(out, orthogonalize(G / 1e30, dtype=it)) < PRODUCT[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(16, 16), (4, 16, 40), (40, 16)])
def test_dtype_and_shape_preserved(dtype, shape):
    G = _matrix(*shape[-2:], 10.0, 0, batch=shape[:-2], dtype=dtype)
    out = orthogonalize(G)
    assert out.dtype == dtype and out.shape == G.shape
    ref = orthogonalize(G.double(), dtype=torch.float64)
    # float64 input iterates in float64; others in the machine's default, bf16 or fp32
    # (dmuon_fn/ns/_dispatch.py; output cast included)
    assert rel_err(out, ref) < (1e-12 if dtype == torch.float64 else NS_LOW_PRECISION)


def test_batched_matches_per_matrix():
    G = torch.randn(3, 24, 64)
    batched = orthogonalize(G, dtype=torch.float32)
    single = torch.stack([orthogonalize(g, dtype=torch.float32) for g in G])
    assert rel_err(batched, single) < 1e-6


@pytest.mark.parametrize("it", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(40, 100), (100, 40), (3, 36, 80)])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_buffer_reuse_changes_no_value(dtype, shape, method, it, monkeypatch):
    """Eager orthogonalize reuses its buffers (the fp32 result holds the normalized copy, Gram
    restarts write into dead iterates, `overwrite=True` works in the input's own buffer); none of
    it may change a value or touch a caller's tensor. Both iteration dtypes a machine may pick."""
    G = _matrix(*shape[-2:], 100.0, 5, batch=shape[:-2], dtype=dtype)
    keep = G.clone()
    cfg = NSConfig(method=method, dtype=None if dtype == torch.float64 else it)
    out = orthogonalize_with(G, cfg)
    assert torch.equal(G, keep), "the input is the caller's"
    assert out.untyped_storage().data_ptr() != G.untyped_storage().data_ptr()
    with monkeypatch.context() as m:  # the same ops with fresh tensors, as under torch.compile
        for module in (orth_module, iteration_module):
            m.setattr(module, "plain_eager", lambda: False)
        assert torch.equal(orthogonalize_with(G, cfg), out)
    again = orthogonalize_with(G, cfg)
    assert torch.equal(again, out), "a reused buffer left nothing behind"
    tmp = G.clone()
    over = orthogonalize_with(tmp, cfg, overwrite=True)
    assert torch.equal(over, out)
    if dtype == torch.float32 and it == torch.bfloat16 and shape[-2] <= shape[-1]:
        assert over.data_ptr() == tmp.data_ptr()  # wide, narrower iterates: in place


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_eager_calls_run_the_op_bodies_and_an_intercepting_mode_sees_the_ops(method):
    """Plain eager iterations call the dmuon:: ops' bodies directly (no op dispatch, the same
    arithmetic); a dispatch mode (as CommCounter, make_fx) sees the ops themselves, and the
    values are the same bits either way (the compiled path: test_buffer_reuse_changes_no_value)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from custom_ops.gram_ns_step import gram_ns_step_math
    from custom_ops.ns_step import ns_step_math
    from custom_ops.syrk import syrk_math

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.namespace + "::" + func._opname)
            return func(*args, **(kwargs or {}))

    G = _matrix(96, 300, 100.0, 3, dtype=torch.float32)
    assert iteration_module.ops(G) == (ns_step_math, gram_ns_step_math, syrk_math)
    cfg = NSConfig(method=method, dtype=torch.bfloat16)
    direct = orthogonalize_with(G, cfg)
    with Seen() as seen:
        via_ops = orthogonalize_with(G, cfg)
    expect = {"dmuon::gram_ns_step", "dmuon::syrk"} if method == "gram" else {"dmuon::ns_step"}
    assert expect <= seen.ops
    assert torch.equal(direct, via_ops)


def test_steps_always_honoured():
    G = _matrix(16, 40, 10.0, 0)
    s = torch.linalg.svdvals(G) / torch.linalg.matrix_norm(G)
    for steps in (1, 3, 5, 8):  # 8 > len(preset): the last row repeats
        O = orthogonalize(G, steps=steps, eps=0.0, dtype=torch.float64)
        want = np.sort(np.abs(_scalar_map(schedule("polar_express", steps), s.numpy())))[::-1]
        np.testing.assert_allclose(torch.linalg.svdvals(O).numpy(), want, rtol=1e-9)
    assert schedule("polar_express", 8)[5:] == (PRESETS["polar_express"][-1],) * 3
    assert schedule("polar_express", 2) == PRESETS["polar_express"][:2]


def test_explicit_rows_equal_the_preset():
    G = torch.randn(20, 50)
    a = orthogonalize(G, coefficients=[list(r) for r in PRESETS["you"]])
    assert torch.equal(a, orthogonalize(G, coefficients="you"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps must be a positive int"),
        ({"coefficients": "nope"}, "unknown coefficients preset"),
        ({"coefficients": [(1.0, 2.0)]}, r"\(a, b, c\) rows"),
        ({"method": "fast"}, "method must be"),
        ({"restarts": [5]}, r"restarts must be ints in \[1, steps-1\]"),
        ({"eps": -1.0}, "eps must be >= 0"),
        ({"dtype": torch.int32}, "dtype must be one of"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        orthogonalize(torch.randn(4, 4), **kwargs)


def test_low_precision_gram_refuses_small_matrices():
    with pytest.raises(ValueError, match="short side of at least 32"):
        orthogonalize(torch.randn(8, 64), method="gram", dtype=torch.bfloat16)
    G = _matrix(8, 64, 10.0, 0, dtype=torch.float32)
    gram = orthogonalize(G, method="gram", dtype=torch.float32)
    assert rel_err(gram, orthogonalize(G, method="standard", dtype=torch.float32)) < 1e-4


def test_auto_picks_the_measured_method():
    from dmuon_fn.ns._cost import ns_method

    assert ns_method((1024, 4096)) == "gram" and ns_method((4096, 1024)) == "gram"
    assert ns_method((1024, 1535)) == "standard" and ns_method((1024, 1536)) == "gram"
    assert ns_method((31, 1000)) == "standard" and ns_method((32, 1000)) == "gram"


def test_requires_grad_input_needs_no_grad():
    """Not differentiable: a clear error in grad mode; under no_grad (as in an optimizer step)
    the same values as for the detached tensor."""
    G = torch.randn(40, 100, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable"):
        orthogonalize(G)
    with torch.no_grad():
        out = orthogonalize(G)
    assert not out.requires_grad and torch.equal(out, orthogonalize(G.detach()))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="floating matrix"):
        orthogonalize(torch.randn(5))
    with pytest.raises(ValueError, match="floating matrix"):
        orthogonalize(torch.ones(3, 3, dtype=torch.int64))


def test_empty_input_gives_empty_output():
    for shape in ((0, 4, 8), (5, 0), (0, 3)):
        out = orthogonalize(torch.randn(shape))
        assert out.shape == shape
