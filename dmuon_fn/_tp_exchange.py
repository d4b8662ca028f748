"""The step's one exchange under tensor parallelism: each matrix orthogonalized once in the job.

The T tensor ranks of a matrix's owner slot each hold a part of it (a shard, or a whole copy)
with its gradient and momentum; each computes its part of Muon's Newton-Schulz input u
elementwise (`muon_momentum`). Then, per matrix:

    gather   every other tensor rank sends its part of u to the root (a sharded matrix only:
             whole copies are equal, the root has u already)
    NS       the root orthogonalizes the whole u: O = orthogonalize(u)
    scatter  the root sends each tensor rank its part of O (a whole copy: all of O)

and every tensor rank applies its part of O to its part of the parameter (`muon_apply`, with
the whole matrix's shape for the lr scale). Point-to-point transfers over dmuon_fn's own
group of the tensor ranks, all posted before any waits (receives first), so the roots of
different matrices orthogonalize side by side; each matrix's transfers carry their own tags.

What travels per matrix of N elements, T tensor ranks: (T−1)/T·N elements of u in and the same
of O out for a sharded matrix; (T−1)·N of O out for a whole copy. The full update is sent, not
Gram factors: the Gram alternative all-reduces a min(m, n)² matrix at each of the ≥ 5
iterations and runs every iteration on all T ranks, which moves less only when
min(m, n) < max(m, n)/5 and never runs Newton-Schulz once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import blocked
from ._entries import Entry
from ._guard import phase
from ._orthogonalize import NSConfig, orthogonalize_with

TP_TAG = 0x7470_0000  # + 2·(the entry's index) for its gather, + 1 for its scatter


class TensorExchange:
    """One step's exchange (module docstring): `post` every matrix, `orthogonalize` (the roots'
    Newton-Schulz), then `result` per matrix."""

    def __init__(self, ns: NSConfig) -> None:
        self.ns = ns
        self.ns_calls = 0
        self._posted: list[tuple[Entry, int, Tensor]] = []
        self._recv: dict[int, list[tuple[int, Tensor, dist.Work]]] = {}
        self._sent: dict[int, list[dist.Work]] = {}
        self._out: dict[int, Tensor] = {}

    def post(self, e: Entry, index: int, u: Tensor) -> None:
        """This rank's part `u` of entry `e`'s Newton-Schulz input (a temporary: the root may
        overwrite it); `index` is the entry's place in the plan, the same on every rank."""
        lay = e.tp
        tp = lay.tp
        tag = TP_TAG + 2 * index
        with phase(f"step (tensor-parallel gather of {e.name})"):
            if tp.rank == lay.root:
                if lay.sharded:
                    self._recv[id(e)] = [
                        (t, buf := u.new_empty(lay.part_shape(t)), _irecv(buf, tp, t, tag))
                        for t in range(tp.size)
                        if t != tp.rank
                    ]
            else:
                if lay.sharded:
                    self._sent[id(e)] = [_isend(u.contiguous(), tp, lay.root, tag)]
                buf = u.new_empty(lay.part_shape(tp.rank))  # orthogonalize keeps u's dtype
                self._out[id(e)] = buf
                self._recv[id(e)] = [(lay.root, buf, _irecv(buf, tp, lay.root, tag + 1))]
        self._posted.append((e, index, u))

    def orthogonalize(self) -> None:
        """The roots' part: for each posted matrix this rank is the root of, wait for the other
        parts, orthogonalize the whole, send each tensor rank its part of the result."""
        for e, index, u in self._posted:
            lay = e.tp
            tp = lay.tp
            if tp.rank != lay.root:
                continue
            whole = u
            if lay.sharded:
                parts = dict.fromkeys(range(tp.size))
                parts[tp.rank] = u
                for t, buf, work in self._recv.pop(id(e)):
                    _wait(work, e)
                    parts[t] = buf
                whole = torch.cat([parts[t] for t in range(tp.size)], dim=lay.dim)
            O = orthogonalize_with(whole.reshape(whole.shape[0], -1), self.ns, overwrite=True)
            O = O.reshape(lay.full_shape).contiguous()  # (a tall matrix's O is transposed)
            self.ns_calls += 1
            sends = []
            with phase(f"step (tensor-parallel scatter of {e.name})"):
                for t in range(tp.size):
                    if t != tp.rank:
                        sends.append(_isend(self._part(O, lay, t), tp, t, TP_TAG + 2 * index + 1))
            self._sent[id(e)] = sends
            self._out[id(e)] = self._part(O, lay, tp.rank)

    @staticmethod
    def _part(O: Tensor, lay, t: int) -> Tensor:
        if not lay.sharded:
            return O
        return O.narrow(lay.dim, lay.offset(t), lay.sizes[t]).contiguous()

    def result(self, e: Entry) -> Tensor:
        """This rank's part of `e`'s orthogonalized update (the caller may overwrite it)."""
        for _, _, work in self._recv.pop(id(e), ()):
            _wait(work, e)
        for work in self._sent.pop(id(e), ()):  # the root's part may share memory with a send
            _wait(work, e)
        return self._out.pop(id(e))

    def finish(self) -> None:
        """Wait for every transfer not waited on yet (a skipped result), so none outlives the
        step."""
        for received in self._recv.values():
            for _, _, work in received:
                work.wait()
        for sent in self._sent.values():
            for work in sent:
                work.wait()
        for pending in (self._recv, self._sent, self._out):
            pending.clear()
        self._posted.clear()


def _isend(t: Tensor, tp, dst: int, tag: int) -> dist.Work:
    return dist.isend(t, group=tp.group, group_dst=dst, tag=tag)


def _irecv(t: Tensor, tp, src: int, tag: int) -> dist.Work:
    return dist.irecv(t, group=tp.group, group_src=src, tag=tag)


def _wait(work: dist.Work, e: Entry) -> None:
    with blocked(), phase(f"step (tensor-parallel exchange of {e.name})"):
        work.wait()
