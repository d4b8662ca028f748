"""`torch.ops.dmuon`: the custom ops, one per file, all registered on import; imports torch only."""

from . import collective_wait as _collective_wait  # noqa: F401  (each import registers its op)
from . import gather_start as _gather_start  # noqa: F401
from . import gram_ns_step as _gram_ns_step  # noqa: F401
from . import lpt_partition as _lpt_partition  # noqa: F401
from . import ns_step as _ns_step  # noqa: F401
from . import owner_broadcast as _owner_broadcast  # noqa: F401
from . import param_gather as _param_gather  # noqa: F401
from . import param_reduce as _param_reduce  # noqa: F401
from . import syrk as _syrk  # noqa: F401
from . import two_stage_reduce as _two_stage_reduce  # noqa: F401
from ._disk import cache_dir, locked
from ._kernels import (
    KERNELS,
    auto_kernel,
    cpu_strips,
    cuda_triangle_rows,
    describe,
    kernel_names,
    resolve_kernel,
    set_cuda_triangle_rows,
)
from ._kernels.cpu import MIN_STRIP_ROWS, check_cpu_strips, set_cpu_strips, triangle_product
from ._registry import OpSpec, register_op, registered_ops

__all__ = [
    "KERNELS",
    "MIN_STRIP_ROWS",
    "OpSpec",
    "auto_kernel",
    "cache_dir",
    "check_cpu_strips",
    "cpu_strips",
    "cuda_triangle_rows",
    "describe",
    "kernel_names",
    "locked",
    "register_op",
    "registered_ops",
    "resolve_kernel",
    "set_cpu_strips",
    "set_cuda_triangle_rows",
    "triangle_product",
]
