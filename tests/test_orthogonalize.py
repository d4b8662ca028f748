"""orthogonalize against float64 reference math (see proofs/ for the invariants)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn import _iteration as iteration_module
from dmuon_fn import _orthogonalize as orth_module
from dmuon_fn import orthogonalize
from dmuon_fn._coefficients import PRESETS, schedule
from dmuon_fn._orthogonalize import NSConfig, orthogonalize_with
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


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_restarts_hold_error_at_standard_level(method, dtype):
    """Ill-conditioned and rank-deficient input, aspect 2..8: Gram NS (default restarts) stays
    within 0.02 of the standard iteration's error against the float64 polar factor."""
    for rows, cols in ((64, 128), (48, 384), (96, 256)):
        for kind in ("cond1e6", "rankdef"):
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
            ref = rel_err(orthogonalize(G.float(), method="standard", dtype=dtype), P)
            got = rel_err(orthogonalize(G.float(), method=method, dtype=dtype), P)
            assert got <= ref + 0.02, (rows, cols, kind, got, ref)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 20),
    aspect=st.sampled_from(ASPECTS),
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(["auto", "standard", "gram"]),
)
def test_transpose_equivariance(n, aspect, seed, method):
    """NS(Gᵀ) = NS(G)ᵀ: bitwise for non-square G (both iterate on the same short-side matrix);
    for square G the two iterate on Gᵀ and G, equal in exact arithmetic (proofs/ns_symmetry.md)."""
    G = _matrix(*_shape(n, aspect), 10.0, seed, dtype=torch.float32)
    dtype = torch.float32 if method == "gram" else None  # bf16 Gram needs >= 32 rows
    a = orthogonalize(G.mT.contiguous(), method=method, dtype=dtype)
    b = orthogonalize(G, method=method, dtype=dtype).mT
    if G.shape[0] != G.shape[1]:
        assert torch.equal(a, b)
    else:
        assert rel_err(a, b) < NS_LOW_PRECISION  # two bf16 runs of the same math
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
    # (dmuon_fn/_dispatch.py; output cast included)
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
    from dmuon_fn._cost import ns_method

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
