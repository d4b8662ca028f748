"""get_ns_backend names the kernel that runs; kernel resolution honours explicit > env > auto."""

from __future__ import annotations

import math

import pytest
import torch

import custom_ops
from dmuon_fn import get_ns_backend, orthogonalize
from dmuon_fn._dispatch import cpu_dispatch


def test_default_cpu_line_names_this_machines_choice(monkeypatch):
    """What the dispatch decided here (tests/test_dispatch.py checks the decisions)."""
    monkeypatch.delenv("DMUON_NS_KERNEL", raising=False)
    line = get_ns_backend("cpu")
    d = cpu_dispatch()
    if math.isinf(d.gram_min_aspect):
        assert line.startswith("Standard NS (Gram NS measured slower here")
    else:
        assert line.startswith(
            f"Gram NS (long/short >= {d.gram_min_aspect:g}, short >= 32; else standard NS)"
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
