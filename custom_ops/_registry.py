"""The registry of dmuon ops and samples (tests/test_op_contract.py); shared input checks, vmap."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

Sample = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class OpSpec:
    """name: "dmuon::<op>"; op: its `torch.ops.dmuon` packet; samples: fresh (args, kwargs)
    pairs on every call; differentiable: whether autograd is registered; ticket: the op returns
    a ticket (custom_ops._collectives), new on every call, its results what redeeming it gives."""

    name: str
    op: Callable[..., Any]
    samples: Callable[[], Iterable[Sample]]
    differentiable: bool
    ticket: bool = False


_REGISTRY: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"op {spec.name!r} is registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def registered_ops() -> list[OpSpec]:
    """All registered ops, sorted by name."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def check_like(op: str, name: str, t: Tensor | None, shape, dtype=None) -> None:
    """ValueError unless `t` is None or has `shape` (and `dtype`, when given)."""
    if t is not None and (t.shape != tuple(shape) or dtype not in (None, t.dtype)):
        want = f"{tuple(shape)} {dtype}" if dtype else f"shape {tuple(shape)}"
        raise ValueError(f"{op}: {name} must be {want}, got {tuple(t.shape)} {t.dtype}")


def register_batched_vmap(op, tensors: int, out_dims: Any) -> None:
    """vmap for an op that batches over leading dims: its first `tensors` arguments (Tensor or
    None) get the vmapped dim in front (an unbatched one expanded), and the op runs once."""

    def front(x: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
        if x is None:
            return None
        if bdim is None:
            return x.unsqueeze(0).expand(size, *x.shape)
        return x.movedim(bdim, 0)

    def rule(info, in_dims, *args):
        batched = zip(args[:tensors], in_dims[:tensors], strict=True)
        lead = [front(x, d, info.batch_size) for x, d in batched]
        return op(*lead, *args[tensors:]), out_dims

    op.register_vmap(rule)
