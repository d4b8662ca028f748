"""The torch GEMM kernels: the CPU's lower-triangle row strips (their count from the table
`set_cpu_strips` installs) and one full GEMM (any device); proofs/custom_ops_notes.md."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

# ((min_rows, strips), ...), min_rows ascending: n rows take the last entry with min_rows <= n
_CPU_STRIPS: tuple[tuple[int, int], ...] = ()
_SCRATCH_PAD = 16  # extra elements per row of the mirror's scratch strip
MIN_STRIP_ROWS = 16  # thinner strips lose more to GEMM overhead than they save


def check_cpu_strips(table) -> tuple[tuple[int, int], ...]:
    """`table` as a strip table ((min_rows, strips), ...), or ValueError naming what is wrong."""
    rows = []
    for entry in table:
        ok = isinstance(entry, tuple | list) and len(entry) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        if not (ok and entry[1] >= 1 and entry[0] >= entry[1] * MIN_STRIP_ROWS):
            raise ValueError(
                f"strip table entries are (min_rows, strips) ints with strips >= 1 and min_rows "
                f">= {MIN_STRIP_ROWS}·strips, got {entry!r} in {table!r}"
            )
        rows.append((entry[0], entry[1]))
    if any(a[0] >= b[0] for a, b in itertools.pairwise(rows)):
        raise ValueError(f"strip table min_rows must ascend strictly, got {table!r}")
    return tuple(rows)


def set_cpu_strips(table) -> None:
    """Install the process-wide CPU strip table (eager and compiled), the same on every rank."""
    global _CPU_STRIPS
    _CPU_STRIPS = check_cpu_strips(table)


def cpu_strips() -> tuple[tuple[int, int], ...]:
    """The installed CPU strip table (empty: one GEMM everywhere)."""
    return _CPU_STRIPS


def _cpu_blocks(n: int) -> int:
    return next((strips for min_rows, strips in reversed(_CPU_STRIPS) if n >= min_rows), 1)


def strip_share(n: int) -> float:
    """The share of the full n×n product's FLOPs that the installed strips compute for n rows:
    strip i of b covers (i+1)/b of the columns, (b+1)/(2b) in all (1: one GEMM)."""
    blocks = _cpu_blocks(n)
    return (blocks + 1) / (2 * blocks)


def _as_batched(t: Tensor) -> Tensor:
    # explicit batch size: reshape(-1, ...) is ambiguous for an empty (k = 0) operand
    return t.reshape(t.shape[:-2].numel(), t.shape[-2], t.shape[-1])


def _mirror_lower_(out: Tensor, bounds: list[int]) -> Tensor:
    """In place, out[:r0, r0:r1] = out[r0:r1, :r0]ᵀ for each strip [r0, r1) of `bounds`."""
    scratch = None
    if out.shape[-1] % 128 == 0:  # one buffer for every strip: the tallest by the widest part
        rows = max(r1 - r0 for r0, r1 in itertools.pairwise(bounds))
        scratch = out.new_empty((*out.shape[:-2], rows, bounds[-2] + _SCRATCH_PAD))
    for r0, r1 in itertools.pairwise(bounds[1:]):
        part = out[..., r0:r1, :r0]
        if scratch is not None:
            part = scratch[..., : r1 - r0, :r0].copy_(part)
        out[..., :r0, r0:r1].copy_(part.mT)
    return out


def _strip_bounds(n: int, blocks: int) -> list[int]:
    return [(i * n) // blocks for i in range(blocks + 1)]


def triangle_product(
    A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float, blocks: int
) -> Tensor:
    """alpha·A·B + beta·C: row strip [r0, r1) of `blocks` against columns [0, r1), its part left
    of its diagonal block mirrored above it (exactly symmetric there); one block is one GEMM."""
    lead, n = A.shape[:-2], A.shape[-2]
    if alpha == 0.0:
        # torch 2.13's CPU bf16 baddbmm returns garbage for alpha=0; the product is not needed.
        out = torch.zeros((*lead, n, n), dtype=A.dtype, device=A.device)
        if C is not None and beta != 0.0:
            out = beta * C.triu()
            out = out + out.triu(1).mT
        return out
    if blocks == 1 and A.dim() == 2:  # one 2-D GEMM, no batch views around it
        if C is not None and beta != 0.0:
            return torch.addmm(C, A, B, beta=beta, alpha=alpha)
        out = torch.mm(A, B)
        return out if alpha == 1.0 else out.mul_(alpha)
    A3, B3 = _as_batched(A), _as_batched(B)
    C3 = _as_batched(C) if C is not None and beta != 0.0 else None
    out = torch.empty(A3.shape[0], n, n, dtype=A.dtype, device=A.device)
    if blocks == 1:  # both triangles, left as computed: mirroring costs more than it gives
        if A3.shape[0] > 1:
            _gemm(A3, B3, C3, alpha, beta, out)
        else:
            _gemm(A3[0], B3[0], None if C3 is None else C3[0], alpha, beta, out[0])
        return out.reshape(*lead, n, n)
    # Strips go through 2-D GEMMs: bmm would copy a sliced transposed operand; BLAS takes it.
    bounds = _strip_bounds(n, blocks)
    for i in range(A3.shape[0]):
        for r0, r1 in itertools.pairwise(bounds):
            c = None if C3 is None else C3[i, r0:r1, :r1]
            _gemm(A3[i, r0:r1, :], B3[i, :, :r1], c, alpha, beta, out[i, r0:r1, :r1])
    _mirror_lower_(out, bounds)
    return out.reshape(*lead, n, n)


def _gemm(a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float, out: Tensor) -> None:
    """out ← alpha·a·b + beta·c (2-D or 3-D), the add inside the GEMM's fp32 accumulation."""
    mm, addmm = (torch.mm, torch.addmm) if a.dim() == 2 else (torch.bmm, torch.baddbmm)
    if c is not None:
        addmm(c, a, b, beta=beta, alpha=alpha, out=out)
    else:
        mm(a, b, out=out)
        if alpha != 1.0:
            out.mul_(alpha)


def cpu_blocked(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """The CPU kernel: the installed table's strips for A's rows."""
    return triangle_product(A, B, C, alpha, beta, _cpu_blocks(A.shape[-2]))


def full_mm(A: Tensor, B: Tensor, C: Tensor | None, alpha: float, beta: float) -> Tensor:
    """The whole product with one GEMM (no FLOP saving), symmetric to rounding."""
    return triangle_product(A, B, C, alpha, beta, 1)
