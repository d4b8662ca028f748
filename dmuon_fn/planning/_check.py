"""Cross-rank checks of one plan and setup (proofs/partition.md §6): each gathers a JSON record from
every rank of the group; all ranks return, or all raise `PlanMismatchError` naming what differs."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

import custom_ops

from ..comm._mesh import all_gather_json
from ._plan import Plan


class PlanMismatchError(RuntimeError):
    """Ranks computed different partition plans."""


def _h32(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big")


def param_hashes(plan: Plan) -> list[int]:
    """One int64 per parameter in name order: name hash << 32 | (name, shape, slot[, layout,
    tensor slot]) hash."""
    out = []
    tensor = list(zip(plan.layouts, plan.tensor_slots, strict=True)) if plan.tensor_slots else []
    for i, (n, sh, s) in enumerate(zip(plan.names, plan.shapes, plan.slots, strict=True)):
        v = _h32(n) << 32 | _h32(json.dumps([n, list(sh), s, *(tensor[i] if tensor else ())]))
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


def _disagreement(record: object, group: dist.ProcessGroup | None) -> tuple[list, int | None]:
    """Every rank's `record`, and the first group rank whose record differs from rank 0's."""
    records = all_gather_json(record, group)
    return records, next((r for r, rec in enumerate(records) if rec != records[0]), None)


def check_plan_consistent(plan: Plan, group: dist.ProcessGroup | None = None) -> str:
    """The common digest, or `PlanMismatchError` on every rank unless all ranks of `group`
    (default: the world; NCCL: set the CUDA device) hold the same plan."""
    record = [plan.digest(), plan.world_size, plan.replicate_size, param_hashes(plan)]
    records, bad = _disagreement(record, group)
    ref = records[0]
    if bad is None:
        return ref[0]
    other, here = records[bad], dist.get_rank(group)
    pairs = list(zip(ref[3], other[3], strict=False))
    i = next((j for j, (u, v) in enumerate(pairs) if u != v), len(pairs))
    same_name = i < len(pairs) and (pairs[i][0] >> 32) == (pairs[i][1] >> 32)
    if i < len(plan.names):
        local = (
            f"on this rank ({here}) that is {plan.names[i]!r} with shape {plan.shapes[i]} "
            f"owned by {plan.owner(plan.names[i])}"
        )
    else:
        local = f"this rank ({here}) has only {len(plan.names)} parameters"
    what = "agree on its name but not on its shape or owner" if same_name else "differ in name"
    sizes = ""
    if ref[1:3] != other[1:3]:
        sizes = f" (world_size, replicate_size): {ref[1:3]} on rank 0, {other[1:3]} on {bad};"
    raise PlanMismatchError(
        f"partition plans differ between group ranks 0 and {bad} (digests {ref[0][:12]} vs "
        f"{other[0][:12]});{sizes} first difference at parameter #{i} in name order: {local}; "
        f"ranks 0 and {bad} {what}. Every rank must call partition() with the same parameter "
        "names, shapes and sizes (check the dedication filter and the model config per rank)."
    )


def check_setup_consistent(fields: dict[str, str], group: dist.ProcessGroup | None = None) -> None:
    """Raise `PlanMismatchError` on every rank unless all ranks of `group` report the same
    `fields` (e.g. each rank's NS kernel); nothing without a process group or on one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    records, r = _disagreement(dict(fields), group)
    if r is None:
        return
    ref, rec = records[0], records[r]
    key = next(k for k in [*ref, *(k for k in rec if k not in ref)] if rec.get(k) != ref.get(k))
    raise PlanMismatchError(
        f"ranks 0 and {r} disagree on {key}: {ref.get(key)!r} on rank 0, {rec.get(key)!r} on "
        f"rank {r}. Every rank must run the same configuration (check $DMUON_NS_KERNEL, "
        "installed kernel packages and the GPU type on every node)"
    )


def kernel_field(name: str | None, device: torch.device) -> tuple[str, Exception | None]:
    """The NS kernel this rank resolves, or its error to raise after the check (partition.md §6)."""
    try:
        return custom_ops.resolve_kernel(name, device).name, None
    except (ValueError, RuntimeError) as e:
        return f"unavailable ({e})", e
