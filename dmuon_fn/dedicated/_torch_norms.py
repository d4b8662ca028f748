"""torch.nn.utils' gradient norm and clipping on models with dedicated parameters. A dedicated
gradient lives on one rank (its global owner) as a plain tensor, which torch's total norm would
count as that rank's alone; `install` (at `import dmuon_fn`) wraps `get_total_norm` and
`clip_grads_with_norm_` (which `clip_grad_norm_` and `clip_grad_norm` call) so that the
dedicated gradients in the list count once, summed over the model's ranks, and every rank
clips by the same coefficient; and `clip_grad_value_`, which clamps each element where it is
held. The other gradients go to torch's own functions (DTensor-aware); proofs/torch_surface.md."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.utils as nn_utils
from torch import Tensor
from torch.nn.utils import clip_grad

from . import _fsdp_adapter as fsdp
from ._state import LIVE, DedicatedState, Entry

_PATCHED = "_dmuon_patched"


def _dedicated_grads() -> dict[int, tuple[DedicatedState, Entry]]:
    """id(.grad) -> (state, entry) of every live dedicated parameter that has a gradient here
    (a 0-size one on ranks that do not own it: dedicated/_schedule.py)."""
    out = {}
    for st in list(LIVE):
        for e in st.entries:
            if e.param.grad is not None:
                out[id(e.param.grad)] = (st, e)
    return out


def _counted(st: DedicatedState, e: Entry) -> bool:
    """Whether this rank's gradient of `e` counts in the model's norm: its global owner's, and
    of a copy every tensor rank holds (TP's unsplit layouts), tensor rank 0's only."""
    if not st.is_global_owner(e):
        return False
    tp = st.tensor
    return e.tp is None or e.tp.sharded or tp is None or tp.rank == 0


def _dedicated_part(found: list[tuple[DedicatedState, Entry, Tensor]], p: float) -> Tensor:
    """Σ|g|^p (p = inf: max |g|) over the dedicated gradients `found`, each counted once, over
    each model's ranks (its shard, replicate and tensor groups), float64."""
    per_state: dict[int, tuple[DedicatedState, list[Tensor]]] = {}
    for st, e, g in found:
        per_state.setdefault(id(st), (st, []))[1].extend([g] if _counted(st, e) else [])
    device = found[0][2].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for st, grads in per_state.values():
        norms = [torch.linalg.vector_norm(g, p).to(device, torch.float64) for g in grads]
        part = torch.stack(norms) if norms else total.new_zeros(1)
        part = part.max() if math.isinf(p) else part.pow(p).sum()
        for group in (st.shard_group, st.replicate_group, st.tensor and st.tensor.group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(part, op=op, group=group)
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    return total


def _plain(norm: Tensor) -> Tensor:
    """A norm as a plain tensor, equal on every rank (a DTensor's full value)."""
    return norm.full_tensor() if fsdp.is_dtensor(norm) else norm


def _total_norm(original, tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch's `get_total_norm`, the dedicated gradients counted once over the model's ranks."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    known = _dedicated_grads() if LIVE else {}
    found = [(*known[id(t)], t) for t in tensors if id(t) in known]
    if not found:
        return original(tensors, norm_type, error_if_nonfinite, foreach)
    p = float(norm_type)
    ids = {id(g) for *_, g in found}
    rest = [t for t in tensors if id(t) not in ids]
    ded = _dedicated_part(found, p)
    by_mesh: dict = {}  # torch stacks the norms of one mesh only (FSDP2's 1-D shards beside
    for t in rest:  # FSDP2 + TP's 2-D ones raise there): its norm per mesh, combined here
        by_mesh.setdefault(t.device_mesh if fsdp.is_dtensor(t) else None, []).append(t)
    parts = [original(ts, p, False, foreach) for ts in by_mesh.values()]
    theirs = next((t for t in parts if fsdp.is_dtensor(t)), parts[0] if parts else None)
    total = ded
    for part in parts:
        other = _plain(part).to(ded.device, torch.float64)
        total = torch.maximum(total, other) if math.isinf(p) else total + other.pow(p)
    total = total if math.isinf(p) else total.pow(1.0 / p)
    dtype = theirs.dtype if theirs is not None else found[0][2].dtype
    total = total.to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    if theirs is not None and fsdp.is_dtensor(theirs):
        return fsdp.replicated_like(total, theirs)
    return total


def _clip_with_norm(original, parameters, max_norm, total_norm, foreach=None):
    """torch's `clip_grads_with_norm_`; with dedicated parameters, every gradient's local part
    scaled by min(1, max_norm / (total_norm + 1e-6)) (equal on every rank)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if not _has_dedicated(params):
        return original(params, max_norm, total_norm, foreach)
    total = _plain(total_norm)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = fsdp.local(p.grad)
            g.mul_(coef.to(g.device, g.dtype))
    return None


def _clip_value(original, parameters, clip_value, foreach=None):
    """torch's `clip_grad_value_`; with dedicated parameters, every gradient's local part
    clamped where it is held (torch's foreach mixes no plain tensor with DTensors)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if not _has_dedicated(params):
        return original(params, clip_value, foreach)
    v = float(clip_value)
    for p in params:
        if p.grad is not None:
            fsdp.local(p.grad).clamp_(min=-v, max=v)
    return None


def _has_dedicated(params: list[Tensor]) -> bool:
    return any(getattr(p, fsdp.DEDICATED_ATTR, False) for p in params)


def _wrap(original, body):
    @functools.wraps(original)
    @torch.no_grad()
    def patched(*args, **kwargs):
        return body(original, *args, **kwargs)

    setattr(patched, _PATCHED, True)
    return patched


def install() -> None:
    """Wrap torch.nn.utils' `get_total_norm`, `clip_grads_with_norm_` (and clip_grad's own
    names for them, which `clip_grad_norm_` calls) and `clip_grad_value_`, once (idempotent)."""
    for private, public, body in (
        ("_get_total_norm", "get_total_norm", _total_norm),
        ("_clip_grads_with_norm_", "clip_grads_with_norm_", _clip_with_norm),
        ("clip_grad_value_", "clip_grad_value_", _clip_value),
    ):
        original = getattr(clip_grad, private)
        if getattr(original, _PATCHED, False):
            continue
        patched = _wrap(original, body)
        setattr(clip_grad, private, patched)
        setattr(nn_utils, public, patched)
