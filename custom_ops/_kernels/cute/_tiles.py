"""Tile-level building blocks of `syrk_sm80.py`: shared-memory layouts, 128-bit tiled copies,
predicated tile loads and stores. Predicates compare coordinate tensors with n: rows and columns
>= n are never read (zero instead) nor written. Imports `cutlass` at import time.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum


def smem_layout_ab(dtype, major, tiler, copy_bits: int):
    """Swizzled (rows, bK, stages) operand buffer: 8-row atoms of up to 64 contiguous elements,
    XOR-swizzled so that cp.async writes and ldmatrix reads hit distinct banks."""
    contiguous = min(tiler[1] if major == LayoutEnum.ROW_MAJOR else tiler[0], 64)
    swizzle_bits = min(int(math.log2(contiguous * dtype.width // copy_bits)), 3)
    if major == LayoutEnum.ROW_MAJOR:
        atom = cute.make_layout((8, contiguous), stride=(contiguous, 1))
    else:
        atom = cute.make_layout((contiguous, 8), stride=(1, contiguous))
    atom = cute.make_composed_layout(cute.make_swizzle(swizzle_bits, 3, 3), 0, atom)
    return cute.tile_to_shape(atom, tiler, (0, 1, 2))


def smem_layout_d(tiler):
    """Row-major swizzled output tile, read back by row- and by column-vectors."""
    atom = cute.make_layout((8, 64), stride=(64, 1))
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, atom)
    return cute.tile_to_shape(atom, tiler, (0, 1))


def gmem_tiled_copy(atom, major, rows: int, cols: int, threads: int, vector: int):
    """Copies of a (rows, cols) tile by `threads` threads, `vector` elements per copy along the
    contiguous mode (cols for ROW_MAJOR, rows for COL_MAJOR)."""
    if major == LayoutEnum.ROW_MAJOR:
        per_row = cols // vector
        layout = cute.make_layout((threads // per_row, per_row), stride=(per_row, 1))
        values = cute.make_layout((1, vector))
    else:
        per_col = rows // vector
        layout = cute.make_layout((per_col, threads // per_col), stride=(1, per_col))
        values = cute.make_layout((vector, 1))
    return cute.make_tiled_copy_tv(atom, layout, values)


@cute.jit
def row_predicate(tXgX, tXcX, n):
    """Per copy atom of tXgX (coordinates tXcX): whether its row is < n, broadcast over k."""
    m = cute.size(tXgX, mode=[1])
    shape = (tXgX.shape[0][1], m, cute.size(tXgX, mode=[2]))
    pred = cute.make_rmem_tensor(cute.make_layout(shape, stride=(m, 1, 0)), cutlass.Boolean)
    for rv in cutlass.range_constexpr(pred.shape[0]):
        for m in cutlass.range_constexpr(pred.shape[1]):
            pred[rv, m, 0] = cute.elem_less(tXcX[(0, rv), m, 0, 0][0], n)
    return pred


@cute.jit
def copy_first_slab(tiled_copy, tXgX, tXsX, tXcX, rows_in, k_slab):
    """Slab `k_slab` of tXgX into stage 0 of tXsX; atoms whose k columns are < 0 stay zero."""
    for kk in cutlass.range_constexpr(rows_in.shape[2]):
        if cute.elem_less(cutlass.Int32(-1), tXcX[0, 0, kk, 0][1]):
            cute.copy(
                tiled_copy, tXgX[None, None, kk, k_slab], tXsX[None, None, kk, 0],
                pred=rows_in[None, None, kk],
            )  # fmt: skip


@cute.jit
def _in_bounds(tSg, tSc, n):
    """Per copy atom of a partitioned tile: whether its row and column are both < n."""
    shape = (tSg.shape[0][1], cute.size(tSg, mode=[1]), cute.size(tSg, mode=[2]))
    pred = cute.make_rmem_tensor(shape, cutlass.Boolean)
    for rv in cutlass.range_constexpr(pred.shape[0]):
        for m in cutlass.range_constexpr(pred.shape[1]):
            for c in cutlass.range_constexpr(pred.shape[2]):
                pred[rv, m, c] = cute.elem_less(tSc[(0, rv), m, c], (n, n))
    return pred


@cute.jit
def load_tile(tiled_copy, tidx, gIn, sD, cIn, n, dtype: cutlass.Constexpr):
    """Global tile gIn -> registers (predicated, zero outside n) -> shared tile sD."""
    thr = tiled_copy.get_slice(tidx)
    tSg = thr.partition_S(gIn)
    tSs = thr.partition_D(sD)
    tSc = thr.partition_S(cIn)
    frag = cute.make_rmem_tensor(tSg.shape, dtype)
    frag.fill(0)
    cute.copy(tiled_copy, tSg, frag, pred=_in_bounds(tSg, tSc, n))
    cute.autovec_copy(frag, tSs)


@cute.jit
def store_tile(
    tiled_copy, tidx, sD, gOut, cOut, n, dtype: cutlass.Constexpr, rows: cutlass.Constexpr
):
    """Shared tile sD -> registers -> predicated global stores into gOut (rows and cols < n).
    rows: vectors along tile rows (read as vectors); else along columns (element by element)."""
    thr = tiled_copy.get_slice(tidx)
    tSs = thr.partition_S(sD)
    tSg = thr.partition_D(gOut)
    tSc = thr.partition_D(cOut)
    frag = cute.make_rmem_tensor(tSg.shape, dtype)
    if cutlass.const_expr(rows):
        cute.autovec_copy(tSs, frag)
    else:
        for e in cutlass.range(cute.size(frag), unroll_full=True):
            frag[e] = tSs[e]
    cute.copy(tiled_copy, frag, tSg, pred=_in_bounds(tSg, tSc, n))
