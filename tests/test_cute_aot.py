"""The CuTe triangle SYRK without a GPU: its tile schedule, emulated on the CPU, against float64
A·Aᵀ (+ C); its operand preparation; and ahead-of-time compiles for sm_80 and sm_90a whose PTX
must contain tensor-core MMAs (proofs/cute_syrk.md).

The compile tests need nvidia-cutlass-dsl (`pip install -e ".[cute]"`, as CI does) and skip
with that reason when it is missing; everything else runs on torch alone.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from custom_ops._kernels import _cuda as _operands
from custom_ops._kernels.cute import dsl_import_error
from tests import _cute_schedule as _schedule
from tests._tolerance import PRODUCT


def _sym(*shape, generator):
    S = torch.randn(*shape, generator=generator)
    return S + S.mT


@pytest.mark.parametrize("tiles", [1, 2, 3, 7, 64, 300])
def test_tri_coords_is_a_bijection_onto_the_upper_triangle(tiles):
    seen = [_schedule.tri_coords(t) for t in range(tiles * (tiles + 1) // 2)]
    assert sorted(seen) == sorted((i, j) for j in range(tiles) for i in range(j + 1))
    assert len(set(seen)) == len(seen)


def _f32_sqrt(x: float) -> float:
    return float(np.sqrt(np.float32(x), dtype=np.float32))


@pytest.mark.parametrize(
    "sqrt",
    [_f32_sqrt, lambda x: math.sqrt(x) + 2.0, lambda x: max(math.sqrt(x) - 2.0, 0.0)],
    ids=["float32", "guess_one_high", "guess_one_low"],
)
def test_tri_coords_corrects_a_guess_off_by_one(sqrt):
    """The kernel's float32 sqrt (or any guess within one of the true j) still lands exactly,
    including at both ends of every column, for grids up to 16384 tiles a side (n = 2**21;
    the kernel's int32 8t + 1 holds up to ~23000)."""
    for j in [*range(0, 400), *range(400, 16384, 23), 16383]:
        first, last = j * (j + 1) // 2, j * (j + 1) // 2 + j
        assert _schedule.tri_coords(first, sqrt) == (0, j)
        assert _schedule.tri_coords(last, sqrt) == (j, j)


CASES = [  # n, k, batch: multiples and non-multiples of the 16x16x8 emulated tile
    (1, 1, 1),
    (7, 5, 1),
    (16, 8, 1),
    (17, 9, 2),
    (40, 33, 1),
    (48, 24, 3),
]


@pytest.mark.parametrize(("n", "k", "batch"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_c", [False, True])
def test_emulated_schedule_matches_float64(n, k, batch, dtype, with_c):
    g = torch.Generator().manual_seed(n * 1000 + k)
    A = torch.randn(batch, n, k, generator=g).to(dtype)
    C = _sym(batch, n, n, generator=g).to(dtype) if with_c else None
    alpha, beta = 0.75, -1.5
    out = _schedule.emulate(A, A, C, alpha, beta)
    ref = alpha * (A.double() @ A.double().mT)
    if with_c:
        ref = ref + beta * C.double()
    assert torch.equal(out, out.mT), "every entry written, and exactly symmetric"
    scale = alpha * A.double().norm() ** 2 + (abs(beta) * C.double().norm() if with_c else 0)
    assert (out.double() - ref).norm() <= PRODUCT[dtype] * scale + 1e-30


def test_emulated_schedule_general_symmetric_product():
    """P·Qᵀ with Q ≠ P but a symmetric product (the Gram step's R·S, S a polynomial in R)."""
    g = torch.Generator().manual_seed(5)
    X = torch.randn(40, 56, generator=g)
    R = X @ X.T / 56
    S = 0.5 * R + R @ R  # commutes with R
    out = _schedule.emulate(R[None], S.T[None], None, 1.0, 0.0)[0]
    ref = R.double() @ S.double()
    assert torch.equal(out, out.T)
    assert (out.double() - ref).norm() / ref.norm() < 1e-6


@pytest.mark.parametrize(
    ("n", "k", "b_kind"),
    [
        (16, 24, "syrk"),
        (16, 16, "row_major"),
        (16, 16, "strided"),
        (13, 21, "syrk"),
        (9, 9, "row_major"),
    ],
)
def test_prepare_keeps_the_product_and_copies_only_when_needed(n, k, b_kind):
    g = torch.Generator().manual_seed(n + k)
    A = torch.randn(2, n, k, generator=g, dtype=torch.float64)
    if b_kind == "syrk":
        B = A.mT
    elif b_kind == "row_major":
        B = torch.randn(2, k, n, generator=g, dtype=torch.float64)
    else:  # neither B nor B.mT row-major: copied
        B = torch.randn(2, k, 2 * n, generator=g, dtype=torch.float64)[:, :, ::2]
    C = _sym(2, n, n, generator=g).double()
    ops = _operands.prepare(A, B, C)
    assert ops.n8 % 8 == 0 and ops.k8 % 8 == 0 and ops.P.shape == (2, ops.n8, ops.k8)
    assert ops.P.is_contiguous() and ops.C.is_contiguous()
    assert (ops.B.mT if ops.q_k_major else ops.B).is_contiguous()
    padded = ops.P @ ops.B + ops.C
    out = _operands.finish(padded, ops, (2,))
    torch.testing.assert_close(out, A @ B + C)
    if (n % 8, k % 8) == (0, 0) and b_kind == "syrk":
        assert ops.q_k_major and ops.B.data_ptr() == A.data_ptr() == ops.P.data_ptr()
    if (n % 8, k % 8) == (0, 0) and b_kind == "row_major":
        assert not ops.q_k_major and ops.B.data_ptr() == B.data_ptr()


def test_prepare_then_emulated_kernel_is_the_whole_cpu_side_of_cute_sym_mm():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(3, 21, 13, generator=g).bfloat16()  # pads to 24 x 16
    C = _sym(3, 21, 21, generator=g).bfloat16()
    ops = _operands.prepare(A, A.mT, C)
    D = _schedule.emulate(ops.P, ops.B.mT, ops.C, 2.0, 0.5)
    out = _operands.finish(D, ops, (3,))
    ref = 2.0 * (A.double() @ A.double().mT) + 0.5 * C.double()
    assert torch.equal(out, out.mT)
    assert (out.double() - ref).norm() / ref.norm() < PRODUCT[torch.bfloat16]


# ---------------------------------------------------------------- ahead-of-time compiles

needs_dsl = pytest.mark.skipif(
    bool(dsl_import_error()), reason=dsl_import_error() or "nvidia-cutlass-dsl installed"
)

PTXAS_REPORT = "--ptxas-options=-v remarks{ptx}"
MMA = {
    "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
}


@needs_dsl
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize(
    ("dtype", "q_k_major", "has_c"),
    [("bfloat16", True, True), ("float16", False, False)],
    ids=["bf16-syrk-with-c", "fp16-n-major"],
)
def test_aot_compile_emits_tensor_core_mma(tmp_path, capfd, arch, dtype, q_k_major, has_c):
    from custom_ops._kernels.cute import syrk_sm80

    t0 = time.perf_counter()
    fn = syrk_sm80.compile_kernel(
        dtype, q_k_major, has_c, arch, keep_dir=str(tmp_path), extra_options=PTXAS_REPORT
    )
    seconds = time.perf_counter() - t0
    assert fn is not None
    report = capfd.readouterr().err
    assert re.search(r"Used \d+ registers", report), report[-2000:]
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and not any(spills), "the kernel must not spill registers to local memory"
    (ptx_path,) = Path(tmp_path).glob(f"*.{arch}.ptx")
    (cubin_path,) = Path(tmp_path).glob(f"*.{arch}.cubin")
    ptx = ptx_path.read_text()
    assert f".target {arch}" in ptx
    assert ptx.count(MMA[dtype]) >= 32, "a 64x64 warp tile is 32 m16n8k16 MMAs per k step"
    assert "ldmatrix.sync.aligned.m8n8.x4" in ptx
    assert ("ldmatrix.sync.aligned.m8n8.x4.trans" in ptx) == (not q_k_major)
    assert "cp.async.cg.shared.global" in ptx
    assert cubin_path.read_bytes()[:4] == b"\x7fELF"
    assert seconds < 120, f"compile took {seconds:.1f}s"


@needs_dsl
def test_kernel_cache_compiles_once_per_variant(tmp_path, monkeypatch):
    """No GPU needed to compile; exporting the object may be refused without CUDA libraries
    (a warning), after which the in-memory kernel is still returned, once per variant."""
    from custom_ops._kernels import cute as _cache

    monkeypatch.setenv("DMUON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DMUON_CUTE_DISK_CACHE", raising=False)
    _cache.get_kernel.cache_clear()
    assert _cache.cache_root() == tmp_path / "cute"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _cache.get_kernel("sm_80", "bfloat16", True, False)
        again = _cache.get_kernel("sm_80", "bfloat16", True, False)
    assert first is again
    assert list((tmp_path / "cute" / "sm_80").glob("dmuon_syrk_*.lock"))


# ---------------------------------------------------------------- dispatch without a GPU


@pytest.fixture
def fake_cuda(monkeypatch):
    """A pretend CUDA device of a given capability, with or without the optional packages;
    the per-device auto choice is cleared before and after, and its size rule is installed
    (triangle from 4096 rows) so that nothing times the device that is not there."""
    import custom_ops._kernels.cute as cute_pkg
    from custom_ops import _kernels

    def setup(cap, dsl=True, quack=True):
        monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(cute_pkg, "dsl_import_error", lambda: "" if dsl else "no dsl here")
        monkeypatch.setattr(_operands, "quack_import_error", lambda: "" if quack else "no quack")
        monkeypatch.setattr(_kernels, "_CUDA_TRIANGLE_FROM", {0: 4096.0})
        _kernels._auto.cache_clear()

    yield setup
    _kernels._auto.cache_clear()


@pytest.mark.parametrize(
    ("cap", "dsl", "quack", "expect"),
    [
        ((9, 0), True, True, "quack"),
        ((10, 0), True, True, "quack"),
        ((9, 0), True, False, "cute_sm80"),
        ((8, 0), True, True, "cute_sm80"),
        ((8, 6), True, False, "cute_sm80"),
        ((9, 0), False, False, "cublas"),
        ((8, 0), False, True, "cublas"),
        ((7, 5), True, True, "cublas"),
    ],
)
def test_auto_ladder_per_capability(fake_cuda, cap, dsl, quack, expect):
    import custom_ops

    fake_cuda(cap, dsl, quack)
    assert custom_ops.resolve_kernel(None, "cuda").name == expect
    assert custom_ops.resolve_kernel("auto", "cuda:0").name == expect


def test_requested_kernel_that_cannot_run_is_an_error_with_the_reason(fake_cuda, monkeypatch):
    import custom_ops

    fake_cuda((8, 0), dsl=True, quack=True)
    with pytest.raises(RuntimeError, match=r"'quack' .* needs compute capability >= 9\.0, .* 8\.0"):
        custom_ops.resolve_kernel("quack", "cuda")
    fake_cuda((7, 5), dsl=True, quack=True)
    with pytest.raises(RuntimeError, match=r"'cute_sm80' .* needs compute capability >= 8\.0"):
        custom_ops.resolve_kernel("cute_sm80", "cuda")
    fake_cuda((9, 0), dsl=False, quack=False)
    monkeypatch.setenv("DMUON_NS_KERNEL", "cute_sm80")
    with pytest.raises(RuntimeError, match=r"\(from \$DMUON_NS_KERNEL\) cannot run here: no dsl"):
        custom_ops.resolve_kernel(None, "cuda")
    with pytest.raises(RuntimeError, match="runs on cuda only, not cpu"):
        custom_ops.resolve_kernel("cute_sm80", "cpu")


def test_env_and_explicit_choices_beat_the_ladder_and_are_reported(fake_cuda, monkeypatch):
    import custom_ops
    from dmuon_fn import get_ns_backend

    fake_cuda((9, 0), dsl=True, quack=True)
    auto = get_ns_backend("cuda:0")
    assert "kernel=quack (SM90, quack gemm_symmetric" in auto
    assert "auto: from 4096 rows, else cuBLAS" in auto
    monkeypatch.setenv("DMUON_NS_KERNEL", "cute_sm80")
    assert custom_ops.resolve_kernel(None, "cuda").name == "cute_sm80"
    line = get_ns_backend("cuda:0")
    assert "kernel=cute_sm80 (SM90, CuTe DSL triangle SYRK; fp32/fp64 via cuBLAS)" in line
    assert "kernel=cublas (SM90," in get_ns_backend("cuda:0", kernel="cublas")


@pytest.mark.parametrize("name", ["cute_sm80", "quack"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tensor_core_kernels_send_wide_dtypes_to_one_gemm(name, dtype):
    """fp32/fp64 operands (which the tensor-core kernels do not take) run as one full GEMM,
    as the kernel's description says; checked here on CPU tensors, which take the same path."""
    import custom_ops

    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 12, 20, generator=g, dtype=dtype)
    C = _sym(2, 12, 12, generator=g).to(dtype)
    out = custom_ops.KERNELS[name].sym_mm(A, A.mT, C, 0.5, 2.0)
    torch.testing.assert_close(out, 0.5 * A @ A.mT + 2.0 * C)
    empty = custom_ops.KERNELS[name].sym_mm(A[..., :0], A[..., :0].mT, C, 0.5, 2.0)
    torch.testing.assert_close(empty, 2.0 * C)
