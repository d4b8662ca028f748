"""How a dedicated parameter lies over the tensor-parallel ranks (`parallelize_module` over a 1-D
tensor mesh of T ranks): a `Shard(d)` DTensor (torch.chunk's sizes), or a whole copy
(`Replicate()`, or a plain tensor). Tensor rank t of the owner slot holds part t as a plain
parameter; tensor rank `root` orthogonalizes the whole matrix (proofs/tensor_parallel.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


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


def chunk_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Each of `parts` ranks' extent of a dim of size n under Shard: torch.chunk's
    (proofs/tensor_parallel.md claim 1)."""
    step = -(-n // parts)
    return tuple(max(0, min(step, n - t * step)) for t in range(parts))
