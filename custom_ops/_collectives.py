"""Blocking c10d collectives behind the communication ops, addressed by process-group name.

Inside an op they are opaque to tracing: a compiled graph calls the op, the op calls c10d. A
group of size 1 returns at once without torch.distributed.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def _group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def broadcast_into(t: Tensor, src: int, group: str, size: int) -> Tensor:
    if size > 1:
        pg = _group(group)
        dist.broadcast(t, src=dist.get_global_rank(pg, src), group=pg)
    return t


def reduce_sum(t: Tensor, dst: int, group: str, size: int) -> Tensor:
    if size > 1:
        pg = _group(group)
        dist.reduce(t, dst=dist.get_global_rank(pg, dst), op=dist.ReduceOp.SUM, group=pg)
    return t
