"""The own CuTe DSL triangle SYRK (`cute_sm80`, sm_80+; the kernel: syrk_sm80.py, _tiles.py).
Importing this package needs neither CUDA nor nvidia-cutlass-dsl. Compiled kernels are kept per
process and on disk at `<cache_dir>/cute/<arch>/<key>.o`, <key> a hash of the kernel source, the
DSL version and the variant; ranks of one node wait for the first compile. Disk failures warn and
compile in memory; DMUON_CUTE_DISK_CACHE=0 turns the disk off."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..._disk import cache_dir, locked
from .._cuda import Operands, cuda_check, import_error, target_arch

_MAX_GRID_Z = 65535  # grid z is the batch; CUDA caps it


@functools.cache
def dsl_import_error() -> str:
    """'' when nvidia-cutlass-dsl imports, else why not."""
    return import_error("nvidia-cutlass-dsl", "cute", "cutlass.cute")


def cute_available(device: torch.device) -> tuple[bool, str]:
    why = cuda_check(device, (8, 0)) or dsl_import_error()
    return not why, why


def triangle(ops: Operands, alpha: float, beta: float) -> Tensor:
    """`_cuda.tensor_core`'s triangle through the own kernel, on an sm_80+ device."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_ptr

    el = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[ops.P.dtype]

    def ptr(t: Tensor):
        return make_ptr(el, t.data_ptr(), cutlass.AddressSpace.gmem, assumed_align=16)

    L, device = ops.P.shape[0], ops.P.device
    D = torch.empty((L, ops.n8, ops.n8), dtype=ops.P.dtype, device=device)
    with torch.cuda.device(device):
        dtype = str(D.dtype).removeprefix("torch.")
        kernel = get_kernel(target_arch(device), dtype, ops.q_k_major, ops.C is not None)
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        for b0 in range(0, L, _MAX_GRID_Z):
            b1 = min(L, b0 + _MAX_GRID_Z)
            p, q, d = ops.P[b0:b1], ops.B[b0:b1], D[b0:b1]
            c = ops.C[b0:b1] if ops.C is not None else d
            kernel(
                ptr(p), ptr(q), ptr(c), ptr(d),
                Int32(ops.n8), Int32(ops.k8), Int32(b1 - b0),
                Float32(alpha), Float32(beta), stream,
            )  # fmt: skip
    return D


def cache_root() -> Path:
    return cache_dir() / "cute"


@functools.cache
def get_kernel(arch: str, dtype: str, q_k_major: bool, has_c: bool):
    """The compiled triangle SYRK for one (arch, variant): from memory, disk, or a compile."""
    import cutlass
    import cutlass.cute as cute

    from . import _tiles, syrk_sm80

    cfg = syrk_sm80.TileConfig()
    compile_ = functools.partial(syrk_sm80.compile_kernel, dtype, q_k_major, has_c, arch, cfg)
    if os.environ.get("DMUON_CUTE_DISK_CACHE", "1") == "0":
        return compile_()
    h = hashlib.sha256()  # the object's name: kernel source, DSL version, variant
    for module in (syrk_sm80, _tiles):
        h.update(Path(module.__file__).read_bytes())
    h.update(f"cutlass-dsl={cutlass.__version__}".encode())
    h.update(repr((dtype, q_k_major, has_c, cfg)).encode())
    prefix = "dmuon_syrk_" + h.hexdigest()[:24]
    obj = cache_root() / arch / f"{prefix}.o"
    try:
        with locked(obj.with_suffix(".lock")):
            if obj.exists():
                try:
                    return cute.runtime.load_module(str(obj))[prefix]
                except Exception as e:  # a truncated or foreign object is a miss
                    warnings.warn(f"dmuon_fn: recompiling, cannot load {obj}: {e}", stacklevel=2)
            fn = compile_()
            try:
                with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
                    fn.export_to_c(tmp, prefix, function_prefix=prefix)
                    os.replace(Path(tmp) / f"{prefix}.o", obj)
            except Exception as e:
                warnings.warn(f"dmuon_fn: not caching {obj} on disk: {e}", stacklevel=2)
            return fn
    except OSError as e:  # unwritable cache directory: compile in memory only
        warnings.warn(f"dmuon_fn: CuTe kernel disk cache unusable ({e})", stacklevel=2)
        return compile_()
