"""Which Newton-Schulz method and SYRK kernel actually run on a device."""

from __future__ import annotations

import torch

import custom_ops

from ._cost import GRAM_MIN_ASPECT, GRAM_MIN_SHORT, ns_method
from ._orthogonalize import default_iteration_dtype


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


def get_ns_backend(
    device: torch.device | str | None = None,
    *,
    kernel: str | None = None,
    method: str = "auto",
    dtype: torch.dtype | None = None,
) -> str:
    """One line naming the NS method, the SYRK kernel and the iteration dtype that will run.

    device: defaults to the current CUDA device, else the CPU. `kernel` resolves exactly as in
    `orthogonalize` (explicit > $DMUON_NS_KERNEL > auto), so the line names the kernel that runs;
    an unknown or unavailable kernel raises the same error `orthogonalize` would.
    """
    device = _default_device() if device is None else torch.device(device)
    resolved = custom_ops.resolve_kernel(kernel, device)
    ns_method((1, 1), method)  # validates
    if method == "auto":
        how = (
            f"Gram NS (long/short >= {GRAM_MIN_ASPECT:g}, short >= {GRAM_MIN_SHORT}; "
            "else standard NS)"
        )
    else:
        how = "Gram NS" if method == "gram" else "Standard NS"
    it = dtype or default_iteration_dtype(device)
    return f"{how} · {custom_ops.describe(resolved, device)} · iterate in {str(it)[6:]}"
