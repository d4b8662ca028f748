"""The CUDA tensor-core kernels (cute_sm80, quack) against float64 references, on a GPU.

Skipped without CUDA. Each kernel test also skips, with the kernel's own reason, when that
kernel cannot run on this device (e.g. quack not installed, or an sm_80 device for quack).
"""

from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops import _kernels
from tests._tolerance import PRODUCT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRIANGLE_KERNELS = ["cute_sm80", "quack"]
LOW = [torch.float16, torch.bfloat16]


def _need(kernel: str) -> None:
    ok, why = custom_ops.KERNELS[kernel].available(torch.device("cuda"))
    if not ok:
        pytest.skip(f"{kernel}: {why}")


def _sym(*shape, generator):
    S = torch.randn(*shape, generator=generator, device="cuda")
    return S + S.mT


def _check(out, A, B, C, alpha, beta, dtype):
    ref = alpha * (A.double() @ B.double())
    if C is not None:
        ref = ref + beta * C.double()
    assert out.dtype == dtype and out.shape == ref.shape
    scale = abs(alpha) * A.double().norm() * B.double().norm()
    if C is not None:
        scale = scale + abs(beta) * C.double().norm()
    assert (out.double() - ref).norm() <= PRODUCT[dtype] * scale


SHAPES = [  # (batch, n, k): tile multiples, not multiples of the 128 tile, not multiples of 8
    ((), 256, 512),
    ((), 1000, 3000),
    ((), 129, 77),
    ((3,), 384, 200),
    ((2, 2), 64, 8),
    ((), 8, 8),
]


@pytest.mark.parametrize("kernel", TRIANGLE_KERNELS)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(("batch", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_c", [False, True])
def test_syrk_matches_float64(kernel, dtype, batch, n, k, with_c):
    _need(kernel)
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    A = torch.randn(*batch, n, k, generator=g, device="cuda").to(dtype)
    C = _sym(*batch, n, n, generator=g).to(dtype) if with_c else None
    out = torch.ops.dmuon.syrk(A, C, 0.5, -1.25, impl=kernel)
    _check(out, A, A.mT, C, 0.5, -1.25, dtype)
    if kernel == "cute_sm80":
        assert torch.equal(out, out.mT), "upper tiles mirrored: exactly symmetric"


@pytest.mark.parametrize("kernel", TRIANGLE_KERNELS)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("n", [512, 520, 100])
def test_symmetric_product_of_commuting_matrices(kernel, dtype, n):
    """The Gram step's products: B is a row-major symmetric matrix, not A.mT."""
    _need(kernel)
    g = torch.Generator(device="cuda").manual_seed(n)
    X = torch.randn(n, 2 * n, generator=g, device="cuda")
    R = (X @ X.T / (2 * n)).to(dtype)
    R = R.triu() + R.triu(1).mT  # exactly symmetric, so R·R is
    out = custom_ops.KERNELS[kernel].sym_mm(R, R, R, 2.0, -0.5)
    _check(out, R, R, R, 2.0, -0.5, dtype)


@pytest.mark.parametrize("kernel", TRIANGLE_KERNELS)
@pytest.mark.parametrize("n", [256, 300])
def test_gram_ns_step_no_worse_than_cublas(kernel, n):
    """A whole Gram step (four chained symmetric products) in bf16: its error against the
    float64 step is at most twice that of the same step through cuBLAS in bf16."""
    _need(kernel)
    g = torch.Generator(device="cuda").manual_seed(n)
    X = torch.randn(n, 4 * n, generator=g, device="cuda")
    R = (X @ X.T / X.norm() ** 2).bfloat16()
    R = R.triu() + R.triu(1).mT
    Qz = (R @ R).bfloat16()
    Qz = Qz.triu() + Qz.triu(1).mT
    coeffs = (3.4445, -4.7750, 2.0315)
    ref = torch.ops.dmuon.gram_ns_step(R.double(), Qz.double(), *coeffs, impl="torch_mm")
    got = torch.ops.dmuon.gram_ns_step(R, Qz, *coeffs, impl=kernel)
    base = torch.ops.dmuon.gram_ns_step(R, Qz, *coeffs, impl="cublas")
    for x, y, r in zip(got, base, ref, strict=True):
        err, err_cublas = (x.double() - r).norm(), (y.double() - r).norm()
        assert err <= 2 * err_cublas + 1e-3 * r.norm()


@pytest.mark.parametrize("kernel", TRIANGLE_KERNELS)
def test_compiles_fullgraph(kernel):
    _need(kernel)
    g = torch.Generator(device="cuda").manual_seed(2)
    A = torch.randn(2, 300, 1000, generator=g, device="cuda").bfloat16()
    C = _sym(2, 300, 300, generator=g).bfloat16()

    def f(a, c):
        return torch.ops.dmuon.syrk(a, c, 1.5, 0.25, impl=kernel) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(A, C), f(A, C))


def test_fp32_goes_through_cublas_inside_the_kernel():
    _need("cute_sm80")
    A = torch.randn(64, 96, device="cuda", dtype=torch.float32)
    out = torch.ops.dmuon.syrk(A, impl="cute_sm80")
    _check(out, A, A.mT, None, 1.0, 0.0, torch.float32)


def test_auto_ladder_and_report_name_the_kernel_that_runs(monkeypatch):
    from dmuon_fn import get_ns_backend

    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    expect = next(
        name
        for name in _kernels._AUTO_LADDER["cuda"]
        if custom_ops.KERNELS[name].available(device)[0]
    )
    assert custom_ops.resolve_kernel(None, "cuda").name == expect
    assert f"kernel={expect} (SM" in get_ns_backend("cuda")


def test_cute_kernel_is_compiled_and_cached():
    _need("cute_sm80")
    from custom_ops._kernels import cute as _cache

    A = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    torch.ops.dmuon.syrk(A, impl="cute_sm80")
    assert _cache.get_kernel.cache_info().currsize >= 1
