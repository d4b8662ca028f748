"""Blocking c10d collectives behind the communication ops and dmuon_fn's object API.

Groups are a ProcessGroup or its name (ops can carry only the name in their schema). Inside an
op the collective is opaque to tracing: a compiled graph calls the op, the op calls c10d. A group
of size 1 returns at once without torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | str


def _group(group: Group) -> dist.ProcessGroup:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def broadcast_into(t: Tensor, src: int, group: Group, size: int) -> Tensor:
    """In place, from group rank `src`."""
    if size > 1:
        pg = _group(group)
        dist.broadcast(t, src=dist.get_global_rank(pg, src), group=pg)
    return t


def reduce_sum(t: Tensor, dst: int, group: Group, size: int) -> Tensor:
    """In place, the sum onto group rank `dst` (gloo has no AVG: callers scale once after)."""
    if size > 1:
        pg = _group(group)
        dist.reduce(t, dst=dist.get_global_rank(pg, dst), op=dist.ReduceOp.SUM, group=pg)
    return t


def define_collective(qualname: str, schema: str) -> None:
    """torch.library.define for an op that issues collectives.

    Defined with torch.library.define rather than custom_op: custom_op wraps every call in an
    autograd.Function without setup_context, which torch.func's transforms reject, and these
    ops run inside functions that torch.func differentiates. Tagged never to be recomputed by
    graph partitioners and registered side-effectful, so it is never dead-code eliminated where
    a rank ignores its result: the other ranks would wait for it forever.
    """
    torch.library.define(qualname, schema, tags=(torch.Tag.nondeterministic_seeded,))
    ns, name = qualname.split("::")
    torch.fx.node.has_side_effect(getattr(getattr(torch.ops, ns), name).default)
