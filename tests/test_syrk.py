"""dmuon::syrk against float64 A·Aᵀ (+ C, symmetric), on every kernel this machine can run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops._kernels.cpu import _cpu_blocks, _strip_bounds
from tests._tolerance import PRODUCT, rel_err

CPU_KERNELS = ["cpu_syrk", "torch_mm"]
# 0 or order-one magnitudes: a coefficient like 1e-49 underflows in fp32 by design, not by bug.
COEF = st.one_of(st.just(0.0), st.floats(0.01, 3.0), st.floats(-3.0, -0.01))


def _ref(A, C, alpha, beta):
    out = alpha * (A.double() @ A.double().mT)
    return out if C is None else out + beta * C.double()


# A strip table for the strip-path tests, whatever this machine measured (dmuon_fn/ns/_dispatch.py).
STRIPS = ((256, 2), (768, 4))


@pytest.fixture
def strips():
    before = custom_ops.cpu_strips()
    custom_ops.set_cpu_strips(STRIPS)
    yield STRIPS
    custom_ops.set_cpu_strips(before)


def _sym(*shape, generator):
    S = torch.randn(*shape, generator=generator)
    return S + S.mT


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 40),
    batch=st.sampled_from([(), (3,), (2, 2)]),
    alpha=COEF,
    beta=COEF,
    with_c=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    impl=st.sampled_from(CPU_KERNELS),
    seed=st.integers(0, 2**31 - 1),
)
def test_syrk_matches_float64(n, k, batch, alpha, beta, with_c, dtype, impl, seed):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*batch, n, k, generator=g).to(dtype)
    C = _sym(*batch, n, n, generator=g).to(dtype) if with_c else None
    out = torch.ops.dmuon.syrk(A, C, alpha, beta, impl=impl)
    ref = _ref(A, C, alpha, beta)
    assert out.dtype == dtype and out.shape == ref.shape
    # scale the tolerance by the magnitude of the terms, not of the (possibly cancelling) sum
    scale = abs(alpha) * A.double().norm() ** 2 + (abs(beta) * C.double().norm() if with_c else 0)
    assert (out.double() - ref).norm() <= PRODUCT[dtype] * scale + 1e-300
    # below the strip size one GEMM computes both triangles: symmetric to rounding
    assert (out.double() - out.double().mT).norm() <= PRODUCT[dtype] * scale + 1e-300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "blocks"), [(512, 96, 2), (1031, 64, 4), (700, 1500, 2)])
def test_blocked_strips_match_float64(n, k, blocks, dtype, strips):
    """Sizes where cpu_syrk actually splits into strips, incl. n not a multiple of a block."""
    assert _cpu_blocks(n) == blocks
    g = torch.Generator().manual_seed(n + k)
    A = torch.randn(2, n, k, generator=g).to(dtype)
    C = _sym(2, n, n, generator=g).to(dtype)
    out = torch.ops.dmuon.syrk(A, C, 0.5, -2.0, impl="cpu_syrk")
    _assert_strip_symmetry(out, blocks, dtype)
    assert rel_err(out, _ref(A, C, 0.5, -2.0)) < PRODUCT[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1024, 1031])
def test_blocked_product_of_commuting_matrices(n, dtype, strips):
    """The Gram step's products: B = R·R + R commutes with A = R, so A·B is symmetric, but B is
    a row-major matrix, not A.mT (each strip's diagonal block then differs from its transpose
    by rounding)."""
    g = torch.Generator().manual_seed(n)
    X = torch.randn(n, n + 64, generator=g, dtype=torch.float64) / n
    R = X @ X.mT
    B = R @ R + R
    out = custom_ops.KERNELS["cpu_syrk"].sym_mm(R.to(dtype), B.to(dtype), R.to(dtype), 2.0, -0.5)
    assert _cpu_blocks(n) == 4, "the strip path is what this test is for"
    _assert_strip_symmetry(out, 4, dtype)
    ref = 2.0 * R.to(dtype).double() @ B.to(dtype).double() - 0.5 * R.to(dtype).double()
    assert rel_err(out, ref) < PRODUCT[dtype]


def _assert_strip_symmetry(out, blocks, dtype):
    """Off-diagonal blocks are mirrored (bitwise symmetric); each strip's diagonal block is one
    GEMM's output, symmetric to the dtype's rounding."""
    n = out.shape[-1]
    strip = torch.bucketize(torch.arange(n), torch.tensor(_strip_bounds(n, blocks)), right=True)
    off = strip[:, None] != strip[None, :]
    assert torch.equal(out[..., off], out.mT[..., off]), "mirrored blocks: exactly symmetric"
    asym = (out.double() - out.double().mT).norm() / out.double().norm()
    assert asym <= PRODUCT[dtype]


def test_strip_table_rule_and_validation(strips):
    """The last entry whose min_rows <= n decides; below the first, one GEMM."""
    assert [_cpu_blocks(n) for n in (1, 255, 256, 767, 768, 10**6)] == [1, 1, 2, 2, 4, 4]
    assert custom_ops.cpu_strips() == STRIPS
    assert "2 from 256 rows, 4 from 768 rows, else one GEMM" in custom_ops.describe(
        custom_ops.KERNELS["cpu_syrk"], "cpu"
    )
    for bad in (((256, 0),), ((16, 2),), ((512, 2), (256, 4)), ((256.5, 2),), ((256, 2, 1),)):
        with pytest.raises(ValueError, match="strip table"):
            custom_ops.set_cpu_strips(bad)
    assert custom_ops.cpu_strips() == STRIPS, "a rejected table leaves the installed one"
    custom_ops.set_cpu_strips(())
    assert _cpu_blocks(4096) == 1
    assert "one GEMM at every size" in custom_ops.describe(custom_ops.KERNELS["cpu_syrk"], "cpu")


def test_syrk_gradients_float64():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    S = torch.randn(2, 5, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def f(a, s):  # C is symmetric by contract: perturb it only symmetrically
        return torch.ops.dmuon.syrk(a, s + s.mT, 0.7, 1.3)

    assert torch.autograd.gradcheck(f, (A, S))


def test_syrk_rejects_bad_shapes():
    with pytest.raises(ValueError, match="at least 2 dims"):
        torch.ops.dmuon.syrk(torch.randn(4))
    with pytest.raises(ValueError, match="C must be"):
        torch.ops.dmuon.syrk(torch.randn(4, 3), torch.randn(3, 3))


def test_unknown_kernel_lists_valid_ones():
    with pytest.raises(
        ValueError, match="valid kernels: auto, cpu_syrk, cublas, cute_sm80, quack, torch_mm"
    ):
        torch.ops.dmuon.syrk(torch.randn(4, 3), impl="nope")
    assert set(custom_ops.kernel_names()) == {
        "cpu_syrk",
        "cublas",
        "cute_sm80",
        "quack",
        "torch_mm",
    }
