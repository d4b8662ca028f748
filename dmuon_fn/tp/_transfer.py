"""The step's exchange under tensor parallelism: each matrix orthogonalized once in the job, by its
owner slot's tensor rank `root`, which gathers the parts of the Newton-Schulz input u (sharded
matrices) and scatters O's: two point-to-point batches per step (proofs/tensor_parallel.md)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm._counters import blocked
from ..comm._errors import phase
from ..ns._orthogonalize import NSConfig, orthogonalize_with
from ._layout import TensorLayout

TP_TAG = 0x7470_0000  # + 2·(the entry's index) for its gather, + 1 for its scatter


class TensorExchange:
    """One step's exchange: `post` every matrix, `orthogonalize`, then `result` per matrix; a
    matrix `e` is anything with a `tp: TensorLayout` (dedicated/_state.Entry)."""

    def __init__(self, ns: NSConfig) -> None:
        self.ns, self.ns_calls = ns, 0
        self._posted: list[tuple[Any, int, Tensor]] = []
        self._out: dict[int, Tensor] = {}
        self._scatter: list[dist.Work] = []

    def post(self, e: Any, index: int, u: Tensor) -> None:
        """This rank's part `u` (shape `e.tp.part_shape(rank)`; the root may overwrite it) of
        `e`'s Newton-Schulz input; `index`: `e`'s place in the plan."""
        self._posted.append((e, index, u))

    def orthogonalize(self) -> None:
        """Gather u's parts to the roots, orthogonalize there, issue the scatter of O's parts."""
        ops, received = [], {}
        for e, index, u in self._posted:
            lay, tp = e.tp, e.tp.tp
            if not lay.sharded:
                continue
            if tp.rank == lay.root:
                received[id(e)] = bufs = {
                    t: u.new_empty(lay.part_shape(t)) for t in range(tp.size) if t != tp.rank
                }
                ops += [_op(dist.irecv, b, tp, t, TP_TAG + 2 * index) for t, b in bufs.items()]
            else:
                ops.append(_op(dist.isend, u.contiguous(), tp, lay.root, TP_TAG + 2 * index))
        for work in _batch(ops, "gather"):
            _wait(work, "gather")
        ops = []
        for e, index, u in self._posted:
            lay, tp = e.tp, e.tp.tp
            tag = TP_TAG + 2 * index + 1
            if tp.rank != lay.root:
                buf = u.new_empty(lay.part_shape(tp.rank))  # orthogonalize keeps u's dtype
                ops.append(_op(dist.irecv, buf, tp, lay.root, tag))
                self._out[id(e)] = buf
                continue
            whole = u
            if lay.sharded:
                parts = received.pop(id(e)) | {tp.rank: u}
                whole = torch.cat([parts[t] for t in range(tp.size)], dim=lay.dim)
            O = orthogonalize_with(whole.reshape(whole.shape[0], -1), self.ns, overwrite=True)
            O = O.reshape(lay.full_shape).contiguous()  # (a tall matrix's O is transposed)
            self.ns_calls += 1
            others = [t for t in range(tp.size) if t != tp.rank]
            ops += [_op(dist.isend, _part(O, lay, t), tp, t, tag) for t in others]
            self._out[id(e)] = _part(O, lay, tp.rank)
        self._scatter = _batch(ops, "scatter")

    def result(self, e: Any) -> Tensor:
        """This rank's part of `e`'s orthogonalized update (the caller may overwrite it)."""
        self.finish()
        return self._out.pop(id(e))

    def finish(self) -> None:
        for work in self._scatter:
            _wait(work, "scatter")
        self._scatter = []


def _part(O: Tensor, lay: TensorLayout, t: int) -> Tensor:
    if not lay.sharded:
        return O
    return O.narrow(lay.dim, lay.offset(t), lay.sizes[t]).contiguous()


def _op(fn, t: Tensor, tp, peer: int, tag: int) -> dist.P2POp:
    return dist.P2POp(fn, t, group=tp.group, tag=tag, group_peer=peer)


def _batch(ops: list[dist.P2POp], what: str) -> list[dist.Work]:
    if not ops:
        return []
    with phase(f"step (tensor-parallel {what})"):
        return dist.batch_isend_irecv(ops)


def _wait(work: dist.Work, what: str) -> None:
    with blocked(), phase(f"step (tensor-parallel {what})"):
        work.wait()
