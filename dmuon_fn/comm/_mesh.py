"""Conventions both faces share, below both (`_dedicate` and `_functional`): the mesh shapes
they accept and the mixed-precision dtypes (what is gathered, summed, and kept as the master).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._exchange import all_gather_json


def check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
    """Mixed-precision dtypes: floating torch dtypes or None (both faces take the same)."""
    for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise ValueError(f"{what} must be a floating torch.dtype or None, got {dt!r}")


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the global owner keeps a parameter of `dtype` in under mixed precision: the dtype
    promoted to at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def check_meshes(
    mesh: DeviceMesh, replicate_mesh: DeviceMesh | None, *, tensor_size: int = 1
) -> None:
    """A 1-D shard mesh, and under HSDP a 1-D replicate mesh: the two dims of one 2-D mesh
    named ('replicate', 'shard') that together span the world (with `tensor_size` tensor
    ranks per data coordinate: a ('replicate', 'shard', <tensor>) mesh)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"mesh must be a 1-D DeviceMesh (for HSDP pass hsdp['shard'] and "
            f"replicate_mesh=hsdp['replicate']), got {mesh!r}"
        )
    if replicate_mesh is None:
        return
    if not isinstance(replicate_mesh, DeviceMesh) or replicate_mesh.ndim != 1:
        raise ValueError(f"replicate_mesh must be a 1-D DeviceMesh, got {replicate_mesh!r}")
    names = (mesh.mesh_dim_names, replicate_mesh.mesh_dim_names)
    if names != (("shard",), ("replicate",)):
        raise ValueError(
            "HSDP needs a 2-D mesh named ('replicate', 'shard'): build it with "
            "init_device_mesh(dev, (R, G), mesh_dim_names=('replicate', 'shard')) and pass "
            f"mesh=hsdp['shard'], replicate_mesh=hsdp['replicate']; got dim names {names}"
        )
    if mesh.size() * replicate_mesh.size() * tensor_size != dist.get_world_size():
        tensor = f" and {tensor_size} tensor-parallel ranks" if tensor_size > 1 else ""
        raise ValueError(
            f"mesh ({mesh.size()} ranks) and replicate_mesh ({replicate_mesh.size()} ranks)"
            f"{tensor} disagree with the world size {dist.get_world_size()}: they must be the "
            f"'shard' and 'replicate' dims of one {'3-D' if tensor else '2-D'} mesh"
        )
    shard_ranks = set(mesh.mesh.flatten().tolist())
    rep_ranks = set(replicate_mesh.mesh.flatten().tolist())
    if shard_ranks & rep_ranks != {dist.get_rank()}:
        raise ValueError(
            "mesh and replicate_mesh disagree: they must be the 'shard' and 'replicate' dims of "
            "the same 2-D mesh (their groups must cross in exactly this rank)"
        )


def own_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new process group over `group`'s ranks, for dmuon_fn's traffic alone.

    Gloo runs one group's collectives one after another, so an FSDP2 all-gather issued while a
    dedicated prefetch is in flight on the mesh's own group waits for the whole prefetch; on
    separate groups (separate connections; on NCCL separate communicators) the two proceed side
    by side. Collective over the world: every rank gathers every rank's group, then creates all
    of them in one sorted order (`new_group` needs every rank, member or not). The new groups
    keep `group`'s collective timeout (`new_group`'s default would be torch's 30 minutes, so a
    hung peer would no longer fail within the job's timeout).
    """
    mine = sorted(dist.get_process_group_ranks(group))
    backend, timeout = dist.get_backend(group), _timeout(group)
    made = None
    for ranks in sorted({tuple(r) for r in all_gather_json(mine)}):
        new = dist.new_group(list(ranks), timeout=timeout, backend=backend)
        if list(ranks) == mine:
            made = new
    assert made is not None  # this rank's own list is among the gathered ones
    return made


def _timeout(group: dist.ProcessGroup):
    """`group`'s collective timeout (a timedelta), or None (torch's default) if unreadable."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None
