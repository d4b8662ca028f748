"""Compiled CuTe DSL kernels: compiled once per process, kept on disk across processes.

Location: `<cache_dir>/cute/<arch>/<key>.o` (custom_ops._disk), <arch> the target ("sm_80",
"sm_90a", ...), <key> a hash of the kernel's source (`syrk_sm80.py`, `_tiles.py`), the
nvidia-cutlass-dsl version and the variant (dtype, Q's major mode, whether C is read, tile
config): a changed kernel or DSL never loads a stale object; deleting it is always safe. A lock
file next to the object makes ranks that share a node wait for the first compile and load its
object. The disk cache is an optimization only: when exporting or loading fails, a warning says
so and the kernel compiled in memory runs; DMUON_CUTE_DISK_CACHE=0 turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from pathlib import Path

from ..._disk import cache_dir, locked


def cache_root() -> Path:
    return cache_dir() / "cute"


def variant_key(dtype: str, q_k_major: bool, has_c: bool, cfg) -> str:
    """Hash of kernel source + DSL version + variant: the object file's name."""
    import cutlass

    from . import _tiles, syrk_sm80

    h = hashlib.sha256()
    for module in (syrk_sm80, _tiles):
        h.update(Path(module.__file__).read_bytes())
    h.update(f"cutlass-dsl={cutlass.__version__}".encode())
    h.update(repr((dtype, q_k_major, has_c, cfg)).encode())
    return h.hexdigest()[:24]


def _load(obj: Path, prefix: str):
    import cutlass.cute as cute

    return cute.runtime.load_module(str(obj))[prefix]


def _export(fn, obj: Path, prefix: str) -> None:
    with tempfile.TemporaryDirectory(dir=obj.parent) as tmp:
        fn.export_to_c(tmp, prefix, function_prefix=prefix)
        os.replace(Path(tmp) / f"{prefix}.o", obj)


@functools.cache
def get_kernel(arch: str, dtype: str, q_k_major: bool, has_c: bool):
    """The compiled triangle SYRK for one (arch, variant): from memory, disk, or a compile."""
    from . import syrk_sm80

    cfg = syrk_sm80.TileConfig()
    if os.environ.get("DMUON_CUTE_DISK_CACHE", "1") == "0":
        return syrk_sm80.compile_kernel(dtype, q_k_major, has_c, arch, cfg)
    prefix = "dmuon_syrk_" + variant_key(dtype, q_k_major, has_c, cfg)
    obj = cache_root() / arch / f"{prefix}.o"
    try:
        with locked(obj.with_suffix(".lock")):
            if obj.exists():
                try:
                    return _load(obj, prefix)
                except Exception as e:  # a truncated or foreign object is a miss
                    warnings.warn(f"dmuon_fn: recompiling, cannot load {obj}: {e}", stacklevel=2)
            fn = syrk_sm80.compile_kernel(dtype, q_k_major, has_c, arch, cfg)
            try:
                _export(fn, obj, prefix)
            except Exception as e:
                warnings.warn(f"dmuon_fn: not caching {obj} on disk: {e}", stacklevel=2)
            return fn
    except OSError as e:  # unwritable cache directory: compile in memory only
        warnings.warn(f"dmuon_fn: CuTe kernel disk cache unusable ({e})", stacklevel=2)
        return syrk_sm80.compile_kernel(dtype, q_k_major, has_c, arch, cfg)
