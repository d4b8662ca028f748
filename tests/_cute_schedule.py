"""The triangle tile schedule of the CuTe SYRK kernel, in plain Python (no GPU, no CuTe).

The kernel (custom_ops/_kernels/cute/syrk_sm80.py) launches one CTA per output tile (i, j) with
i ≤ j of the T×T tile grid, T = ceil(n / tile); CTA `t` of the x grid dimension finds its tile
with `tri_coords`, computes alpha·P[i-rows]·Q[j-rows]ᵀ + beta·C[i, j] in fp32, and writes it
to D[i, j] and its transpose to D[j, i] (a diagonal tile is first made symmetric from its upper
triangle). `emulate` runs exactly that schedule with tile loops in torch on the CPU, so the
index arithmetic the GPU uses is checked in CI (`tests/test_cute_aot.py`); `proofs/cute_syrk.md`
gives the argument.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def num_tiles(n: int, tile: int) -> int:
    """T: tiles along one side of the n×n output."""
    return (n + tile - 1) // tile


def num_ctas(n: int, tile: int) -> int:
    """CTAs per matrix: the T·(T+1)/2 tiles on and above the diagonal."""
    t = num_tiles(n, tile)
    return t * (t + 1) // 2


def tri_coords(t: int, sqrt=math.sqrt) -> tuple[int, int]:
    """Tile (i, j), i ≤ j, of linear CTA index t; column-major over the upper triangle:
    t = j·(j+1)/2 + i. The kernel does the same arithmetic: a float32 square root for the
    first guess of j, then one correction in each direction, so a guess off by one (rounding,
    or an approximate sqrt) still lands on the exact j. `sqrt` is a parameter so the test can
    feed in guesses that are off on purpose.
    """
    j = int((sqrt(float(8 * t + 1)) - 1.0) * 0.5)
    if (j + 1) * (j + 2) // 2 <= t:
        j += 1
    if j * (j + 1) // 2 > t:
        j -= 1
    return t - j * (j + 1) // 2, j


def emulate(
    P: Tensor,
    Q: Tensor,
    C: Tensor | None,
    alpha: float,
    beta: float,
    tile: int = 16,
    tile_k: int = 8,
) -> Tensor:
    """alpha·P·Qᵀ + beta·C for (L, n, k) P, Q and (L, n, n) C, computed the way the kernel does.

    Per CTA: the k loop runs over ceil(k / tile_k) slabs with the ragged slab first (the
    kernel shifts its k origin by k − tile_k·ceil(k / tile_k) ≤ 0 and predicates negative
    columns to zero); rows ≥ n are predicated to zero; the fp32 accumulator gets
    alpha·acc + beta·C[i, j] (C read only where row, col < n), is rounded to the output dtype
    into a tile buffer, a diagonal tile copies its upper triangle onto its lower one, and the
    buffer is stored to D[i, j] and (i ≠ j) transposed to D[j, i], both predicated to < n.
    """
    L, n, k = P.shape
    out = torch.full((L, n, n), float("nan"), dtype=P.dtype)
    k_tiles = max(1, math.ceil(k / tile_k))
    k_origin = k - tile_k * k_tiles  # ≤ 0: the first slab is the ragged one
    for b in range(L):
        for t in range(num_ctas(n, tile)):
            i, j = tri_coords(t)
            acc = torch.zeros(tile, tile, dtype=torch.float32)
            for kt in range(k_tiles):
                a = _load(P[b], i * tile, k_origin + kt * tile_k, tile, tile_k)
                q = _load(Q[b], j * tile, k_origin + kt * tile_k, tile, tile_k)
                acc += a.float() @ q.float().T
            acc = alpha * acc
            if C is not None:
                acc += beta * _load(C[b], i * tile, j * tile, tile, tile).float()
            buf = acc.to(P.dtype)
            if i == j:
                buf = buf.triu() + buf.triu(1).T
            _store(out[b], buf, i * tile, j * tile)
            if i != j:
                _store(out[b], buf.T, j * tile, i * tile)
    return out


def _load(M: Tensor, r0: int, c0: int, rows: int, cols: int) -> Tensor:
    """M[r0:r0+rows, c0:c0+cols] with out-of-range entries (negative or ≥ size) as zero."""
    tile = torch.zeros(rows, cols, dtype=M.dtype)
    rs, cs = max(r0, 0), max(c0, 0)
    re, ce = min(r0 + rows, M.shape[0]), min(c0 + cols, M.shape[1])
    if rs < re and cs < ce:
        tile[rs - r0 : re - r0, cs - c0 : ce - c0] = M[rs:re, cs:ce]
    return tile


def _store(M: Tensor, tile: Tensor, r0: int, c0: int) -> None:
    re, ce = min(r0 + tile.shape[0], M.shape[0]), min(c0 + tile.shape[1], M.shape[1])
    M[r0:re, c0:ce] = tile[: re - r0, : ce - c0]
