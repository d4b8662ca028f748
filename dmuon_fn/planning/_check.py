"""Cross-rank check that every rank computed the same partition plan.

Ranks that disagree on an owner hang in the first broadcast or reduce (a rank waits for a
sender that never sends), so the plans are compared once, before any parameter collective, by
gathering a small record from every rank: the plan digest, the sizes, and one int64 per
parameter (32 bits of the name's hash, 32 bits of the (name, shape, owner) hash; with tensor
parallelism the layout and tensor slot join the second). Every rank sees every record, so
either all ranks return or all raise, naming the first differing parameter.

Records travel as JSON in uint8 tensors (dmuon_fn/comm/_exchange.py), never pickled.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

import custom_ops

from ..comm._exchange import all_gather_json
from ._partition import Plan


class PlanMismatchError(RuntimeError):
    """Ranks computed different partition plans."""


def _h32(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big")


def param_hashes(plan: Plan) -> list[int]:
    """One int64 per parameter in name order: name hash << 32 | (name, shape, slot) hash."""
    out = []
    tensor = list(zip(plan.layouts, plan.tensor_slots, strict=True)) if plan.tensor_slots else []
    for i, (n, sh, s) in enumerate(zip(plan.names, plan.shapes, plan.slots, strict=True)):
        v = _h32(n) << 32 | _h32(json.dumps([n, list(sh), s, *(tensor[i] if tensor else ())]))
        out.append(v - (1 << 64) if v >= 1 << 63 else v)
    return out


def _record(plan: Plan) -> list:
    return [plan.digest(), plan.world_size, plan.replicate_size, param_hashes(plan)]


def _first_difference(x: list[int], y: list[int]) -> tuple[int, bool]:
    """Index of the first differing parameter and whether the two ranks agree on its name."""
    for i, (u, v) in enumerate(zip(x, y, strict=False)):
        if u != v:
            return i, (u >> 32) == (v >> 32)
    return min(len(x), len(y)), False


def check_plan_consistent(plan: Plan, group: dist.ProcessGroup | None = None) -> str:
    """Raise `PlanMismatchError` on every rank unless all ranks of `group` hold the same plan.

    Two small all_gathers over `group` (default: the world; with NCCL the current CUDA device
    must be set). Returns the common digest.
    """
    records = all_gather_json(_record(plan), group)
    ref = records[0]
    bad = next((r for r, rec in enumerate(records) if rec != ref), None)
    if bad is None:
        return ref[0]
    other = records[bad]
    here = dist.get_rank(group)
    i, same_name = _first_difference(ref[3], other[3])
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
    `fields` (e.g. the Newton-Schulz kernel each rank resolved): two small all_gathers.

    A rank that runs another kernel or configuration would not hang, but its owners' updates
    would silently differ from the rest of the job; a different step structure would hang.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    records = all_gather_json(dict(fields), group)
    for r, rec in enumerate(records):
        if rec == records[0]:
            continue
        keys = [*records[0], *(k for k in rec if k not in records[0])]
        key = next(k for k in keys if rec.get(k) != records[0].get(k))
        raise PlanMismatchError(
            f"ranks 0 and {r} disagree on {key}: {records[0].get(key)!r} on rank 0, "
            f"{rec.get(key)!r} on rank {r}. Every rank must run the same configuration (check "
            "$DMUON_NS_KERNEL, installed kernel packages and the GPU type on every node)"
        )


def kernel_field(name: str | None, device: torch.device) -> tuple[str, Exception | None]:
    """The NS kernel this rank resolves, for `check_setup_consistent`, and the error if it
    cannot: raised only after the check, so a rank that cannot run the requested kernel makes
    every rank raise instead of leaving the others waiting in the check's collective."""
    try:
        return custom_ops.resolve_kernel(name, device).name, None
    except (ValueError, RuntimeError) as e:
        return f"unavailable ({e})", e
