"""get_ns_backend names the kernel that runs; kernel resolution honours explicit > env > auto."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import custom_ops
from custom_ops import _kernels
from dmuon_fn import get_ns_backend, orthogonalize
from dmuon_fn.ns._calibrate import choose_rows
from dmuon_fn.ns._dispatch import cpu_dispatch


def test_default_cpu_line_names_this_machines_choice(monkeypatch):
    """What the dispatch decided here (tests/test_dispatch.py checks the decisions)."""
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    line = get_ns_backend("cpu")
    d = cpu_dispatch()
    if math.isinf(d.gram_min_aspect):
        assert line.startswith("Standard NS (Gram NS measured slower here")
    else:
        assert line.startswith(
            f"Gram NS (long/short >= {d.gram_min_aspect:g}, short >= {d.gram_min_short}; "
            "else standard NS)"
        )
    assert "kernel=cpu_syrk (CPU, blocked lower-triangle GEMM strips: " in line
    assert line.endswith(f"iterate in {str(d.dtype)[6:]} ({d.why})")
    assert "\n" not in line


def test_explicit_method_kernel_and_dtype(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    line = get_ns_backend("cpu", kernel="torch_mm", method="standard", dtype=torch.float32)
    assert line.startswith("Standard NS (method=) · kernel=torch_mm (CPU,")
    assert line.endswith("iterate in float32 (dtype=)")


def test_env_var_is_honoured_and_explicit_wins(monkeypatch):
    monkeypatch.setenv("DMUON_NS_KERNEL", "torch_mm")
    assert "kernel=torch_mm" in get_ns_backend("cpu")
    assert custom_ops.resolve_kernel(None, "cpu").name == "torch_mm"
    assert "kernel=cpu_syrk" in get_ns_backend("cpu", kernel="cpu_syrk")
    monkeypatch.setenv("DMUON_NS_KERNEL", "auto")
    assert "kernel=cpu_syrk" in get_ns_backend("cpu")


def test_unknown_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    with pytest.raises(
        ValueError, match=r"valid kernels: auto, cpu_syrk, cublas, cute_sm80, quack, torch_mm"
    ):
        get_ns_backend("cpu", kernel="cute_sm90")
    monkeypatch.setenv("DMUON_NS_KERNEL", "bogus")
    with pytest.raises(ValueError, match=r"unknown NS kernel 'bogus' \(from \$DMUON_NS_KERNEL\)"):
        orthogonalize(torch.randn(4, 4))


def test_kernel_that_cannot_run_here_is_refused_not_replaced(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    with pytest.raises(RuntimeError, match=r"'cublas' .* cannot run here: runs on cuda only"):
        get_ns_backend("cpu", kernel="cublas")
    with pytest.raises(RuntimeError, match="cannot run here"):
        orthogonalize(torch.randn(4, 4), kernel="cublas")


def test_the_reported_kernel_is_the_one_that_runs(monkeypatch):
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    seen = []
    for name in ("cpu_syrk", "torch_mm"):
        k = custom_ops.KERNELS[name]
        monkeypatch.setitem(
            custom_ops.KERNELS,
            name,
            type(k)(
                k.name,
                k.device_types,
                k.description,
                lambda *a, _n=name, _f=k.sym_mm: (seen.append(_n), _f(*a))[1],
                k.available,
            ),
        )
    for kernel in ("cpu_syrk", "torch_mm"):
        seen.clear()
        orthogonalize(torch.randn(64, 256), kernel=kernel)
        assert f"kernel={kernel}" in get_ns_backend("cpu", kernel=kernel)
        assert seen and set(seen) == {kernel}


class _BrokenPackage:
    """A meta-path finder for which importing `name` raises RuntimeError, as a kernel package
    installed without its native libraries does (nvidia-cutlass-dsl without a CTK flavor)."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path, target=None):
        if name == self.name:
            raise RuntimeError(f"{name}: No CTK flavor installed")
        return None


def test_kernel_choice_is_made_outside_the_compiled_graph(monkeypatch):
    """The auto ladder's availability checks import optional packages. Under torch.compile they
    run once at trace time, not traced: a package failing to import with a RuntimeError rules
    its kernel out (as in eager) instead of failing the compile, and the graph calls the kernel
    that eager runs."""
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenPackage("dmuon_test_broken"), *sys.meta_path])

    def available(device):
        try:
            import dmuon_test_broken  # noqa: F401
        except Exception as e:
            return False, f"not importable ({e})"
        return True, ""

    cpu = custom_ops.KERNELS["cpu_syrk"]
    broken = type(cpu)("broken", ("cpu",), "needs a broken package", cpu.sym_mm, available)
    monkeypatch.setitem(custom_ops.KERNELS, "broken", broken)
    monkeypatch.setitem(_kernels._AUTO_LADDER, "cpu", ("broken", "cpu_syrk"))
    _kernels._auto.cache_clear()
    try:
        G = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
        torch._dynamo.reset()
        step = torch.compile(orthogonalize, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(step(G), orthogonalize(G), rtol=0, atol=0)
        assert "kernel=cpu_syrk" in get_ns_backend("cpu")
    finally:
        _kernels._auto.cache_clear()
        torch._dynamo.reset()


def test_cuda_triangle_rule_from_timings():
    """The triangle kernel runs from the geometric midpoint below the smallest size at which it
    won there and at every larger size; never if it lost at the largest."""
    t = {1024: (1.0, 2.0), 2048: (1.0, 1.5), 4096: (1.0, 1.2), 8192: (1.0, 0.6)}  # H200-like
    assert choose_rows(t) == round(math.sqrt(4096 * 8192))
    assert choose_rows({n: (1.0, 0.5) for n in t}) == round(1024 / math.sqrt(2))
    assert math.isinf(choose_rows({**t, 8192: (1.0, 1.0)}))
    assert choose_rows({**t, 2048: (1.0, 0.9)}) == round(math.sqrt(4096 * 8192))


def test_cuda_auto_runs_cublas_below_the_rule(monkeypatch):
    """`auto` on a CUDA device: its triangle kernel from the installed rule's rows, cuBLAS
    below; without rows (or an explicit kernel) the rule is not applied."""
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    monkeypatch.setattr(_kernels, "_auto", lambda device_type, index: "quack")
    monkeypatch.setattr(_kernels, "_CUDA_TRIANGLE_FROM", {})
    cuda = torch.device("cuda", 0)
    assert custom_ops.resolve_kernel(None, cuda, rows=100).name == "quack"  # no rule yet
    custom_ops.set_cuda_triangle_rows(0, 5793)
    assert custom_ops.cuda_triangle_rows(0) == 5793
    assert custom_ops.resolve_kernel(None, cuda, rows=4096).name == "cublas"
    assert custom_ops.resolve_kernel("auto", cuda, rows=5793).name == "quack"
    assert custom_ops.resolve_kernel(None, cuda).name == "quack"
    custom_ops.set_cuda_triangle_rows(0, math.inf)
    assert custom_ops.resolve_kernel(None, cuda, rows=1 << 20).name == "cublas"
    with pytest.raises(ValueError, match="triangle rows"):
        custom_ops.set_cuda_triangle_rows(0, -1)
