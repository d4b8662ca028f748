"""The registry of every `torch.ops.dmuon` op and its sample inputs, and the ops' shared vmap rule.

Each op file calls `register_op` once, right after defining the op. The single contract test
(`tests/test_op_contract.py`) walks this registry, so an op is covered by `opcheck`,
FakeTensorMode and `torch.compile(fullgraph=True)` the moment it is registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

Sample = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class OpSpec:
    """One registered op.

    name: qualified name, e.g. "dmuon::syrk".
    op: the `torch.ops.dmuon.<name>` overload packet.
    samples: returns fresh (args, kwargs) pairs covering the op's cases (dtypes, batching,
        optional arguments). Called anew for every check so no check sees another's tensors.
    differentiable: whether an autograd formula is registered (else the op file says why not).
    ticket: the op returns a ticket (custom_ops._tickets): its results are what redeeming it
        gives, and each call's ticket value is new.
    """

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


def _batch_first(x: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    if x is None:
        return None
    if bdim is None:
        return x.unsqueeze(0).expand(size, *x.shape)
    return x.movedim(bdim, 0)


def register_batched_vmap(op, tensors: int, out_dims: Any) -> None:
    """vmap for a custom op that already batches over leading dims: its first `tensors`
    arguments (Tensor or None) get the vmapped dim in front (an unbatched one expanded along
    it), and the op runs once."""

    def rule(info, in_dims, *args):
        batched = zip(args[:tensors], in_dims[:tensors], strict=True)
        lead = [_batch_first(x, d, info.batch_size) for x, d in batched]
        return op(*lead, *args[tensors:]), out_dims

    op.register_vmap(rule)
