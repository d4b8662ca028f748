"""What both faces accept (meshes, mixed-precision dtypes), dmuon_fn's own process groups, setup
records agreed as JSON in uint8 tensors (proofs/comm_notes.md), and `CollectiveError`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def check_dtype(what: str, dtype: object) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{what} must be a floating torch.dtype or None, got {dtype!r}")


def check_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
    check_dtype("param_dtype", param_dtype)
    check_dtype("reduce_dtype", reduce_dtype)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the global owner keeps a parameter's master in: `dtype`, at least fp32."""
    return torch.promote_types(dtype, torch.float32)


def check_meshes(
    mesh: DeviceMesh, replicate_mesh: DeviceMesh | None, *, tensor_size: int = 1
) -> None:
    """Raise ValueError unless `mesh` is 1-D and, under HSDP, `replicate_mesh` is the 'replicate'
    dim of the same ('replicate', 'shard'[, tensor]) mesh spanning the world."""
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
    shard_ranks, rep_ranks = (set(m.mesh.flatten().tolist()) for m in (mesh, replicate_mesh))
    if shard_ranks & rep_ranks != {dist.get_rank()}:
        raise ValueError(
            "mesh and replicate_mesh disagree: they must be the 'shard' and 'replicate' dims of "
            "the same 2-D mesh (their groups must cross in exactly this rank)"
        )


def own_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group over `group`'s ranks, backend and timeout, for dmuon_fn's traffic alone
    (proofs/comm_notes.md). Collective over the world: every rank creates every rank's group."""
    mine = sorted(dist.get_process_group_ranks(group))
    backend, timeout = dist.get_backend(group), None  # None: torch's default, if unreadable
    for device in ("cpu", "cuda"):
        with contextlib.suppress(RuntimeError, AttributeError):
            timeout = group._get_backend(torch.device(device)).options._timeout
            break
    every = sorted({tuple(r) for r in all_gather_json(mine)})
    made = {r: dist.new_group(list(r), timeout=timeout, backend=backend) for r in every}
    return made[tuple(mine)]


def team_groups(
    plan: Any, shard_rank: int, replica_rank: int
) -> dict[str, tuple[dist.ProcessGroup, tuple[int, ...]]]:
    """{key: (its group, the group rank holding each piece, in piece order)} for each team
    (key: the matrix) and gathered group (key: its first piece) of `plan` (a `Plan`) this rank
    is a member of: a new group over the members' global ranks (found by one all-gather of
    every rank's slot), with the default group's backend. Collective over the world: every rank
    creates every group, in the plan's order; {} without any (no collective)."""
    teams = [(n, plan.team(n)) for n in plan.teams] + [(g[0], g) for g in plan.gathered]
    if not teams:
        return {}
    rank_of = {
        s: r for r, s in enumerate(all_gather_json(replica_rank * plan.shard_size + shard_rank))
    }
    out = {}
    for name, pieces in teams:
        held = [rank_of[plan.slot(p)] for p in pieces]
        ranks = sorted(held)
        group = dist.new_group(ranks, backend=dist.get_backend())
        if dist.get_rank() in ranks:
            out[name] = (group, tuple(ranks.index(r) for r in held))
    return out


def _agree(value: object, send: bool, move: Callable[[torch.Tensor], list], group) -> list:
    """What `move` (one collective: lengths, then bytes) delivers here; `value` goes if `send`."""
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode() if send else b""
    backend = str(dist.get_backend(group))
    on_cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(n) for t in move(length) for n in t.tolist()]
    buf = torch.zeros(max(1, *sizes), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = move(buf.to(device))
    return [json.loads(bytes(b[:n].tolist())) for b, n in zip(bufs, sizes, strict=True)]


def all_gather_json(value: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's JSON-encodable `value`, parsed, in group rank order."""

    def move(t: torch.Tensor) -> list:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return out

    return _agree(value, True, move, group)


def broadcast_json(value: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Group rank `src`'s JSON-encodable `value`, parsed, on every rank (others' are not sent)."""
    root = src if group is None else dist.get_global_rank(group, src)

    def move(t: torch.Tensor) -> list:
        dist.broadcast(t, root, group=group)
        return [t]

    return _agree(value, dist.get_rank(group) == src, move, group)[0]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, hung, or ran a different program."""


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Re-raise a failing collective as a `CollectiveError` naming `what` (timeout: the group's)."""
    try:
        yield
    except (RuntimeError, TimeoutError) as e:  # DistBackendError/DistError derive from these
        if isinstance(e, CollectiveError | torch.OutOfMemoryError):
            raise  # already named, or not the collective's fault (callers catch OOM by type)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"dmuon_fn: a collective failed on rank {rank} during {what}: {e}. A peer rank "
            "died, timed out (init_process_group(timeout=...)), or took a different path"
        ) from e
