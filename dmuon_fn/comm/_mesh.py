"""What both faces (dedicated/, functional/) accept and share: mesh shapes, mixed-precision
dtypes, and the process groups dmuon_fn's own traffic runs on."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._agree import all_gather_json


def check_dtype(what: str, dtype: object) -> None:
    """Raise ValueError naming `what` unless `dtype` is a floating torch dtype or None."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{what} must be a floating torch.dtype or None, got {dtype!r}")


def check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
    """Mixed-precision dtypes: floating torch dtypes or None (both faces take the same)."""
    check_dtype("param_dtype", param_dtype)
    check_dtype("reduce_dtype", reduce_dtype)


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
    """A new process group over `group`'s ranks, with its backend and collective timeout, for
    dmuon_fn's traffic alone (so it runs beside FSDP2's instead of queued behind it on gloo;
    proofs/comm_notes.md). Collective over the world: every rank creates every rank's group.
    """
    mine = sorted(dist.get_process_group_ranks(group))
    backend, timeout = dist.get_backend(group), _timeout(group)
    # new_group needs every rank, member or not, and the same order on all of them
    every = sorted({tuple(r) for r in all_gather_json(mine)})
    made = {r: dist.new_group(list(r), timeout=timeout, backend=backend) for r in every}
    return made[tuple(mine)]


def _timeout(group: dist.ProcessGroup):
    """`group`'s collective timeout (a timedelta), or None (torch's default) if unreadable."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None
