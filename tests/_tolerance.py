"""Relative-error tolerances by dtype, ‖out − ref‖_F / ‖ref‖_F against a float64 reference.

float64: rounding of a few chained products of unit-scale matrices, ~1e-15 each.
float32: 24-bit mantissa, products of length up to a few thousand: ~1e-6, with headroom.
bfloat16: 8-bit mantissa (unit roundoff 2^-8 ≈ 4e-3) on the output cast; fp32 accumulation.
float16: 11-bit mantissa (unit roundoff 2^-11 ≈ 5e-4) on the output cast.
"""

import torch

PRODUCT = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 2e-3,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff if denom == 0 else diff / denom


# One low-precision (bf16/fp16) Newton-Schulz run against the same polynomial iterated in float64:
# each product rounds at 2^-8 (bf16), and the early steps' slope on small singular values (up to
# a ≈ 8 for Polar Express step 1) amplifies it; measured 0.02-0.05 on 16..64-sized matrices.
NS_LOW_PRECISION = 0.06
