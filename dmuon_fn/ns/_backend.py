"""Which Newton-Schulz method, SYRK kernel and iteration dtype actually run on a device."""

from __future__ import annotations

import math

import torch

import custom_ops

from ._cost import GRAM_MIN_SHORT, ns_method
from ._dispatch import dtype_reason, gram_min_aspect, iteration_dtype, kernel_choice


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_ns_backend(
    device: torch.device | str | None = None,
    *,
    kernel: str | None = None,
    method: str = "auto",
    dtype: torch.dtype | None = None,
) -> str:
    """One line naming the NS method, SYRK kernel and iteration dtype `orthogonalize` would run on
    `device` (default: the current CUDA device, else the CPU), and why; raises as it would."""
    device = _default_device() if device is None else torch.device(device)
    resolved = custom_ops.KERNELS[kernel_choice(kernel, device)]  # CUDA: measures auto's rule
    ns_method((1, 1), method)  # validates
    aspect = gram_min_aspect(device)  # resolves the dispatch, the CPU's strip table included
    if method != "auto":
        how = ("Gram NS" if method == "gram" else "Standard NS") + " (method=)"
    elif math.isinf(aspect):
        how = "Standard NS (Gram NS measured slower here at every aspect ratio)"
    else:
        how = f"Gram NS (long/short >= {aspect:g}, short >= {GRAM_MIN_SHORT}; else standard NS)"
    it = dtype or iteration_dtype(device)
    why = "dtype=" if dtype else dtype_reason(device)
    return f"{how} · {custom_ops.describe(resolved, device)} · iterate in {str(it)[6:]} ({why})"
