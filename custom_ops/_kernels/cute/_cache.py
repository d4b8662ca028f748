"""Compiled CuTe DSL kernels: once per process, and on disk at `<cache_dir>/cute/<arch>/<key>.o`
(custom_ops._disk), <key> a hash of the kernel source, the nvidia-cutlass-dsl version and the
variant, so a changed kernel or DSL never loads a stale object. A lock file makes ranks of one
node wait for the first compile. Disk failures warn and run the in-memory compile;
DMUON_CUTE_DISK_CACHE=0 turns the disk off. Deleting an entry is always safe.
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


@functools.cache
def get_kernel(arch: str, dtype: str, q_k_major: bool, has_c: bool):
    """The compiled triangle SYRK for one (arch, variant): from memory, disk, or a compile."""
    import cutlass.cute as cute

    from . import syrk_sm80

    cfg = syrk_sm80.TileConfig()
    compile_ = functools.partial(syrk_sm80.compile_kernel, dtype, q_k_major, has_c, arch, cfg)
    if os.environ.get("DMUON_CUTE_DISK_CACHE", "1") == "0":
        return compile_()
    prefix = "dmuon_syrk_" + variant_key(dtype, q_k_major, has_c, cfg)
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
