"""How a dedicated parameter lies over the tensor-parallel ranks (`parallelize_module` over a 1-D
tensor mesh of T ranks): a `Shard(d)` DTensor (torch.chunk's sizes), or a whole copy
(`Replicate()`, or a plain tensor). Tensor rank t of the owner slot holds part t as a plain
parameter; tensor rank `root` orthogonalizes the whole matrix (proofs/tensor_parallel.md), or,
where the parts are whole matrices (experts split over a batch dim: expert parallelism), every
tensor rank its own part. `TensorExchange` is the step's one exchange: parts of u to the root,
parts of O back, two point-to-point batches per step in the plan's entry order."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm._counters import blocked
from ..comm._mesh import phase
from ..ns._orthogonalize import NSConfig, orthogonalize_with
from ..planning._tensor import LOCAL, chunk_sizes


@dataclass(frozen=True, eq=False)
class TensorMesh:
    """This rank's tensor-parallel ranks, and dmuon_fn's own group over them."""

    mesh: DeviceMesh
    group: dist.ProcessGroup
    rank: int
    size: int


@dataclass(frozen=True, eq=False)
class TensorLayout:
    """A dedicated parameter over the tensor ranks: sharded along `dim` (None: whole copies), rank t
    holding `sizes[t]` of it; `placements`: the module's DTensor's (None: a plain tensor)."""

    tp: TensorMesh
    dim: int | None
    full_shape: torch.Size
    sizes: tuple[int, ...]
    root: int
    placements: tuple | None

    @property
    def sharded(self) -> bool:
        return self.dim is not None and self.tp.size > 1

    @property
    def local(self) -> bool:
        """Each tensor rank's part is whole matrices (experts) it orthogonalizes where they lie,
        with no exchange (expert parallelism; proofs/tensor_parallel.md claim 11)."""
        return self.root == LOCAL

    def offset(self, t: int) -> int:
        return sum(self.sizes[:t])

    def part_shape(self, t: int) -> torch.Size:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.sizes[t]
        return torch.Size(shape)

    def to_module(self, part: torch.Tensor) -> torch.Tensor:
        """The DTensor the module was built with, around `part` (no copy)."""
        return part if self.placements is None else self._whole(part, self.placements)

    def to_checkpoint(self, part: torch.Tensor) -> torch.Tensor:
        """`part` as a view of the whole for DCP (a sharded one: a DTensor; a copy stays plain)."""
        return self._whole(part, (Shard(self.dim),)) if self.sharded else part

    def _whole(self, part: torch.Tensor, placements: tuple) -> torch.Tensor:
        full, stride = self.full_shape, make_contiguous_strides_for(self.full_shape)
        return DTensor.from_local(
            part, self.tp.mesh, placements, run_check=False, shape=full, stride=stride
        )


def find_tensor_mesh(model: nn.Module) -> DeviceMesh | None:
    """The one 1-D mesh of the model's DTensor parameters, or None; raises for several meshes,
    a mesh of more dims, or placements other than Shard and Replicate."""
    found: dict[tuple[int, ...], tuple[str, DeviceMesh]] = {}  # by the mesh's ranks
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"{name} is a DTensor over a {mesh.ndim}-D mesh: dedicate_params takes "
                "tensor-parallel parameters over one 1-D mesh (parallelize_module(model, "
                "mesh['tp'], ...)), applied before dedicate_params and fully_shard"
            )
        bad = [pl for pl in p.placements if not isinstance(pl, Shard | Replicate)]
        if bad:
            raise ValueError(
                f"{name} has placement {bad[0]!r} over the tensor mesh: dedicate_params takes "
                "Shard and Replicate (what ColwiseParallel, RowwiseParallel and "
                "SequenceParallel make); redistribute the parameter, or leave it out"
            )
        found.setdefault(tuple(mesh.mesh.flatten().tolist()), (name, mesh))
    if len(found) > 1:
        (n1, m1), (n2, m2) = list(found.values())[:2]
        raise ValueError(
            f"{n1} and {n2} are DTensors over different meshes ({m1} and {m2}): dedicate_params "
            "takes one tensor-parallel mesh"
        )
    return next(iter(found.values()))[1] if found else None


def check_crossing(tensor: DeviceMesh, data: list[DeviceMesh]) -> None:
    """Raises unless the tensor and data meshes are the dims of one mesh over the world (their
    groups cross in exactly this rank, their sizes multiply to the world size)."""
    ranks = [set(m.mesh.flatten().tolist()) for m in (tensor, *data)]
    me = dist.get_rank()
    crossing = all(a & b == {me} for i, a in enumerate(ranks) for b in ranks[i + 1 :])
    if math.prod(len(r) for r in ranks) != dist.get_world_size() or not crossing:
        raise ValueError(
            f"the tensor-parallel mesh {tensor} and the data mesh(es) {data} are not the dims of "
            "one mesh over the world: build init_device_mesh(dev, (dp, tp), mesh_dim_names="
            "('dp', 'tp')) (HSDP: ('replicate', 'shard', 'tp')), parallelize_module over "
            "mesh['tp'] and dedicate_params over mesh['dp'] (HSDP: mesh['shard'], "
            "replicate_mesh=mesh['replicate'])"
        )


def layout_name(p: torch.Tensor) -> str:
    """A parameter's layout over the tensor mesh, as the plan records it."""
    if not isinstance(p, DTensor):
        return "plain"
    (pl,) = p.placements
    return f"Shard({pl.dim % p.ndim})" if isinstance(pl, Shard) else "Replicate()"


def make_layout(p: torch.Tensor, tp: TensorMesh, root: int) -> TensorLayout:
    if not isinstance(p, DTensor):
        return TensorLayout(tp, None, p.shape, (), root, None)
    (pl,) = p.placements
    if isinstance(pl, Replicate):
        return TensorLayout(tp, None, p.shape, (), root, (pl,))
    dim = pl.dim % p.ndim
    sizes, held = chunk_sizes(p.shape[dim], tp.size), p.to_local().shape[dim]
    if sizes[tp.rank] != held:  # (a Shard layout other than torch.chunk's)
        raise ValueError(
            f"a DTensor of shape {tuple(p.shape)} sharded over dim {dim} holds {held} rows on "
            f"tensor rank {tp.rank}, not torch.chunk's {sizes[tp.rank]}: dedicate_params takes "
            "DTensor's own Shard layout"
        )
    return TensorLayout(tp, dim, p.shape, sizes, root, (Shard(dim),))


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
