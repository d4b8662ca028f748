"""CuTe DSL triangle SYRK for sm_80+: D = alpha·P·Qᵀ + beta·C on the upper tile triangle, mirrored.

P, Q: (L, n, k) fp16/bf16, P K-major; Q K-major (Q = P) or N-major (Q = Bᵀ of a row-major B).
C, D: (L, n, n) row-major, C symmetric (only its upper tiles are read). n, k multiples of 8 and
pointers 16-byte aligned (`_cuda.prepare` pads); n <= 2**21 (int32 tile index). Design:
proofs/custom_ops_notes.md, "CuTe triangle SYRK"; correctness: proofs/cute_syrk.md.
Imports `cutlass` (nvidia-cutlass-dsl) at import time: import this module lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.tensor_utils import LayoutEnum

from . import _tiles

try:
    from cutlass.memory import SmemAllocator
except ImportError:  # nvidia-cutlass-dsl < 4.8
    from cutlass.utils import SmemAllocator

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


@dataclass(frozen=True)
class TileConfig:
    """CTA tile (square in m, n), k slab, pipeline depth, warp grid. Part of the cache key."""

    tile: int = 128
    tile_k: int = 32
    stages: int = 3
    warps_m: int = 2
    warps_n: int = 2


class TriangleSyrk:
    """One compiled variant: dtype, Q's major mode, whether C is read, tile config."""

    def __init__(self, dtype: str, q_k_major: bool, has_c: bool, cfg: TileConfig = TileConfig()):
        self.dtype = DTYPES[dtype]
        self.q_major = LayoutEnum.ROW_MAJOR if q_k_major else LayoutEnum.COL_MAJOR
        self.has_c, self.cfg = has_c, cfg
        self.bM = self.bN = cfg.tile
        self.bK = cfg.tile_k
        self.cta_tiler = (self.bM, self.bN, self.bK)
        self.num_threads = 32 * cfg.warps_m * cfg.warps_n
        self.copy_bits = 128
        self.copy_elems = self.copy_bits // self.dtype.width

    @cute.jit
    def __call__(
        self, pP: cute.Pointer, pQ: cute.Pointer, pC: cute.Pointer, pD: cute.Pointer,
        n: Int32, k: Int32, batch: Int32, alpha: Float32, beta: Float32, stream: cuda.CUstream,
    ):  # fmt: skip
        n, k = cute.assume(n, divby=8), cute.assume(k, divby=8)
        nk = cute.assume(Int64(n) * Int64(k), divby=64)
        nn = cute.assume(Int64(n) * Int64(n), divby=64)
        mP = cute.make_tensor(pP, cute.make_layout((n, k, batch), stride=(k, 1, nk)))
        q_stride = (k, 1, nk) if self.q_major == LayoutEnum.ROW_MAJOR else (1, n, nk)
        mQ = cute.make_tensor(pQ, cute.make_layout((n, k, batch), stride=q_stride))
        mC = cute.make_tensor(pC, cute.make_layout((n, n, batch), stride=(n, 1, nn)))
        mD = cute.make_tensor(pD, cute.make_layout((n, n, batch), stride=(n, 1, nn)))
        # D transposed: tile (i, j) of mDt is the mirror image of tile (i, j) of D
        mDt = cute.make_tensor(pD, cute.make_layout((n, n, batch), stride=(1, n, nn)))

        dt, stages, bits = self.dtype, self.cfg.stages, self.copy_bits
        sP_layout = _tiles.smem_layout_ab(
            dt, LayoutEnum.ROW_MAJOR, (self.bM, self.bK, stages), bits
        )
        sQ_layout = _tiles.smem_layout_ab(dt, self.q_major, (self.bN, self.bK, stages), bits)
        sD_layout = _tiles.smem_layout_d((self.bM, self.bN))
        sizes = [cute.size_in_bytes(dt, layout) for layout in (sP_layout, sQ_layout, sD_layout)]
        smem_bytes = max(sizes[0] + sizes[1], sizes[2])

        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            self.dtype,
            num_bits_per_copy=self.copy_bits,
        )
        copy_P = self._tiled_copy(g2s, LayoutEnum.ROW_MAJOR, self.bM, self.bK)
        copy_Q = self._tiled_copy(g2s, self.q_major, self.bN, self.bK)
        r2g = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=bits)
        copy_D = self._tiled_copy(r2g, LayoutEnum.ROW_MAJOR, self.bM, self.bN)
        copy_Dt = self._tiled_copy(r2g, LayoutEnum.COL_MAJOR, self.bM, self.bN)

        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            cute.make_layout((self.cfg.warps_m, self.cfg.warps_n, 1)),
            permutation_mnk=(self.cfg.warps_m * 16, self.cfg.warps_n * 16, 16),
        )

        tiles = (n + self.bM - 1) // self.bM
        self.kernel(
            mP, mQ, mC, mD, mDt, alpha, beta,
            sP_layout, sQ_layout, sD_layout,
            copy_P, copy_Q, copy_D, copy_Dt, tiled_mma,
        ).launch(
            grid=(tiles * (tiles + 1) // 2, 1, batch), block=(self.num_threads, 1, 1),
            smem=smem_bytes, stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self, mP: cute.Tensor, mQ: cute.Tensor, mC: cute.Tensor, mD: cute.Tensor,
        mDt: cute.Tensor, alpha: Float32, beta: Float32, sP_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout, sD_layout: cute.ComposedLayout, copy_P: cute.TiledCopy,
        copy_Q: cute.TiledCopy, copy_D: cute.TiledCopy, copy_Dt: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, bidz = cute.arch.block_idx()
        n = mP.shape[0]

        # ---- tile (i, j), i <= j, of CTA t = j(j+1)/2 + i (as tests/_cute_schedule.py) ----
        t = Int32(bidx)
        j = Int32((cute.math.sqrt(Float32(8 * t + 1)) - Float32(1.0)) * Float32(0.5))
        if (j + 1) * (j + 2) // 2 <= t:
            j = j + 1
        if j * (j + 1) // 2 > t:
            j = j - 1
        i = t - j * (j + 1) // 2
        coord = (i, j, None)

        # ---- global tiles; the ragged k slab first ----
        gP = cute.local_tile(mP[None, None, bidz], self.cta_tiler, coord, proj=(1, None, 1))
        gQ = cute.local_tile(mQ[None, None, bidz], self.cta_tiler, coord, proj=(None, 1, 1))
        residual_k = cute.size(mP, mode=[1]) - Int32(self.bK) * cute.size(gP, mode=[2])
        gP, gQ = (cute.domain_offset((0, residual_k, 0), g) for g in (gP, gQ))
        gP, gQ = (cute.make_tensor(g.iterator.align(16), g.layout) for g in (gP, gQ))
        # coordinate tensors (for predicates only)
        cP = cute.make_identity_tensor(mP.layout.shape)[None, None, bidz]
        cP = cute.local_tile(cP, self.cta_tiler, coord, proj=(1, None, 1))
        cQ = cute.make_identity_tensor(mQ.layout.shape)[None, None, bidz]
        cQ = cute.local_tile(cQ, self.cta_tiler, coord, proj=(None, 1, 1))
        cP, cQ = (cute.domain_offset((0, residual_k, 0), c) for c in (cP, cQ))

        smem = SmemAllocator()
        sP = smem.allocate_tensor(self.dtype, sP_layout, 16)
        sQ = smem.allocate_tensor(self.dtype, sQ_layout, 16)
        # the output tile reuses the operand buffers once the main loop is done
        sD = cute.make_tensor(cute.recast_ptr(sP.iterator, dtype=self.dtype), sD_layout)

        thr_P, thr_Q = copy_P.get_slice(tidx), copy_Q.get_slice(tidx)
        tPgP, tPsP = thr_P.partition_S(gP), thr_P.partition_D(sP)
        tQgQ, tQsQ = thr_Q.partition_S(gQ), thr_Q.partition_D(sQ)
        tPcP, tQcQ = thr_P.partition_S(cP), thr_Q.partition_S(cQ)

        # row predicates (rows >= n read nothing), one per copy atom, broadcast over k
        tPpP, tQpQ = _tiles.row_predicate(tPgP, tPcP, n), _tiles.row_predicate(tQgQ, tQcQ, n)

        # ---- prologue: zero the stages, then prefetch stages - 1 slabs ----
        tPsP.fill(0)
        tQsQ.fill(0)
        cute.arch.sync_threads()
        stages, k_tiles = cute.size(tPsP, mode=[3]), cute.size(tPgP, mode=[3])
        k_next = Int32(0)
        _tiles.copy_first_slab(copy_P, tPgP, tPsP, tPcP, tPpP, k_next)  # the ragged slab
        _tiles.copy_first_slab(copy_Q, tQgQ, tQsQ, tQcQ, tQpQ, k_next)
        k_next = k_next + 1
        cute.arch.cp_async_commit_group()
        for s in cutlass.range_constexpr(1, self.cfg.stages - 1):
            if s == k_tiles:
                tPpP.fill(0)
                tQpQ.fill(0)
            cute.copy(copy_P, tPgP[None, None, None, k_next], tPsP[None, None, None, s], pred=tPpP)
            cute.copy(copy_Q, tQgQ[None, None, None, k_next], tQsQ[None, None, None, s], pred=tQpQ)
            k_next = k_next + 1
            cute.arch.cp_async_commit_group()

        # ---- MMA partitions and the shared -> register (ldmatrix) copies ----
        thr_mma = tiled_mma.get_slice(tidx)
        tCsP, tCsQ = thr_mma.partition_A(sP), thr_mma.partition_B(sQ)
        tCgD = thr_mma.partition_C(
            cute.local_tile(mD[None, None, bidz], self.cta_tiler, coord, proj=(1, 1, None))
        )
        tCrP = tiled_mma.make_fragment_A(tCsP[None, None, None, 0])
        tCrQ = tiled_mma.make_fragment_B(tCsQ[None, None, None, 0])
        acc = tiled_mma.make_fragment_C(tCgD)
        acc.fill(0.0)

        ldm, q_trans = cute.nvgpu.warp.LdMatrix8x8x16bOp, self.q_major != LayoutEnum.ROW_MAJOR
        s2r_P = cute.make_tiled_copy_A(cute.make_copy_atom(ldm(False, 4), self.dtype), tiled_mma)
        s2r_Q = cute.make_tiled_copy_B(cute.make_copy_atom(ldm(q_trans, 4), self.dtype), tiled_mma)
        thr_s2r_P, thr_s2r_Q = s2r_P.get_slice(tidx), s2r_Q.get_slice(tidx)
        tCsP_v, tCrP_v = thr_s2r_P.partition_S(sP), thr_s2r_P.retile(tCrP)
        tCsQ_v, tCrQ_v = thr_s2r_Q.partition_S(sQ), thr_s2r_Q.retile(tCrQ)

        pipe_read, pipe_write = Int32(0), Int32(stages - 1)
        tCsP_p, tCsQ_p = tCsP_v[None, None, None, pipe_read], tCsQ_v[None, None, None, pipe_read]
        k_blocks = cute.size(tCrP, mode=[2])
        if cutlass.const_expr(k_blocks > 1):
            cute.arch.cp_async_wait_group(self.cfg.stages - 2)
            cute.arch.sync_threads()
            cute.copy(s2r_P, tCsP_p[None, None, 0], tCrP_v[None, None, 0])
            cute.copy(s2r_Q, tCsQ_p[None, None, 0], tCrQ_v[None, None, 0])

        # ---- main loop ----
        for _kt in range(k_tiles):
            for kb in cutlass.range(k_blocks, unroll_full=True):
                if kb == k_blocks - 1:
                    tCsP_p = tCsP_v[None, None, None, pipe_read]
                    tCsQ_p = tCsQ_v[None, None, None, pipe_read]
                    cute.arch.cp_async_wait_group(self.cfg.stages - 2)
                    cute.arch.sync_threads()
                kb_next = (kb + 1) % k_blocks
                cute.copy(s2r_P, tCsP_p[None, None, kb_next], tCrP_v[None, None, kb_next])
                cute.copy(s2r_Q, tCsQ_p[None, None, kb_next], tCrQ_v[None, None, kb_next])
                # nested ifs, not `and`: each condition is a staged (runtime) branch
                if kb == 0:  # noqa: SIM102
                    if k_next < k_tiles:
                        cute.copy(
                            copy_P, tPgP[None, None, None, k_next],
                            tPsP[None, None, None, pipe_write], pred=tPpP,
                        )  # fmt: skip
                cute.gemm(tiled_mma, acc, tCrP[None, None, kb], tCrQ[None, None, kb], acc)
                if kb == 0:
                    if k_next < k_tiles:
                        cute.copy(
                            copy_Q, tQgQ[None, None, None, k_next],
                            tQsQ[None, None, None, pipe_write], pred=tQpQ,
                        )  # fmt: skip
                    k_next = k_next + 1
                    cute.arch.cp_async_commit_group()
                    pipe_write, pipe_read = pipe_read, pipe_read + 1
                    if pipe_read == stages:
                        pipe_read = Int32(0)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()

        # ---- epilogue: alpha·acc + beta·C[i, j] in fp32, rounded into the shared tile ----
        gD = cute.local_tile(mD[None, None, bidz], self.cta_tiler, coord, proj=(1, 1, None))
        cD = cute.local_tile(
            cute.make_identity_tensor((n, n)), self.cta_tiler, coord, proj=(1, 1, None)
        )
        if cutlass.const_expr(self.has_c):
            # C's tile through shared memory, read back in acc's layout: fewer registers
            gC = cute.local_tile(mC[None, None, bidz], self.cta_tiler, coord, proj=(1, 1, None))
            _tiles.load_tile(copy_D, tidx, gC, sD, cD, n, self.dtype)
            cute.arch.sync_threads()
            tCsC = thr_mma.partition_C(sD)
            for e in cutlass.range(cute.size(acc), unroll_full=True):
                acc[e] = acc[e] * alpha + Float32(tCsC[e]) * beta
            cute.arch.sync_threads()
        else:
            for e in cutlass.range(cute.size(acc), unroll_full=True):
                acc[e] = acc[e] * alpha
        rD = cute.make_fragment_like(acc, self.dtype)
        rD.store(acc.load().to(self.dtype))
        cute.autovec_copy(rD, thr_mma.partition_C(sD))
        cute.arch.sync_threads()

        if i == j:
            # diagonal tile: lower triangle := upper triangle, so D is exactly symmetric
            for e in range(tidx, self.bM * self.bN, self.num_threads):
                r = e // self.bN
                c = e - r * self.bN
                if r > c:
                    sD[r, c] = sD[c, r]
            cute.arch.sync_threads()

        _tiles.store_tile(copy_D, tidx, sD, gD, cD, n, self.dtype, True)
        if i != j:
            gDt = cute.local_tile(mDt[None, None, bidz], self.cta_tiler, coord, proj=(1, 1, None))
            _tiles.store_tile(copy_Dt, tidx, sD, gDt, cD, n, self.dtype, False)

    def _tiled_copy(self, atom, major, rows, cols):
        return _tiles.gmem_tiled_copy(atom, major, rows, cols, self.num_threads, self.copy_elems)


def compile_kernel(
    dtype: str,
    q_k_major: bool,
    has_c: bool,
    arch: str,
    cfg: TileConfig = TileConfig(),
    keep_dir: str | None = None,
    extra_options: str = "",
):
    """cute.compile one variant for `arch` ("sm_80", "sm_90a", ...); needs no GPU. keep_dir: an
    existing directory to write the PTX and cubin to; extra_options: more cute.compile options.
    Returns fn(pP, pQ, pC, pD, n, k, batch, alpha, beta, stream), pointers 16-byte aligned."""
    options = f"--gpu-arch {arch} {extra_options}".strip()
    if keep_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {keep_dir}"
    op = TriangleSyrk(dtype, q_k_major, has_c, cfg)
    el, gmem = DTYPES[dtype], cute.AddressSpace.gmem
    ptrs = [cute.runtime.make_ptr(el, 0, gmem, assumed_align=16) for _ in range(4)]
    sizes, scalars = (Int32(8), Int32(8), Int32(1)), (Float32(1.0), Float32(0.0))
    stream = cute.runtime.make_fake_stream()
    return cute.compile(op, *ptrs, *sizes, *scalars, stream, options=options)
