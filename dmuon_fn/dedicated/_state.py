"""What `dedicate_params` attaches to a model: the plan, the entries, the scheduler that moves
them, and the HSDP publish after each step (dmuon_fn/dedicated/_entries.py says who holds what).

After the optimizer step (HSDP), the global owner publishes the new value, in the model dtype,
to the local owners of the other replicas; with `replicate_async` the publish runs in the
background and is waited on right before the parameter's next gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm._errors import phase
from ..planning._partition import Plan
from ..tp._layout import TensorMesh
from ._entries import Entry, Topology
from ._schedule import Scheduler

STATE_ATTR = "_dmuon_state"


@dataclass(eq=False)
class DedicatedState(Topology):
    """What `dedicate_params` attaches to the model (`model._dmuon_state`)."""

    plan: Plan | None = None
    entries: list[Entry] = field(default_factory=list)
    scheduler: Scheduler | None = None
    by_param: dict[int, Entry] = field(default_factory=dict)
    tensor: TensorMesh | None = None  # the tensor-parallel ranks (dmuon_fn/tp/_layout.py)

    def entry(self, p: torch.Tensor) -> Entry | None:
        return self.by_param.get(id(p))

    def owners(self) -> dict[str, int | tuple[int, int]]:
        return {n: self.plan.owner(e.name) for e in self.entries for n in e.names}

    def wait_publish(self, e: Entry) -> None:
        e.wait_publish()

    def publish(self, asynchronous: bool) -> None:
        """Global owners send updated values to the other replicas (no-op on a 1-D mesh)."""
        if self.replicate_group is None:
            for e in self.entries:
                e.next_step()
            return
        for e in self.entries:
            touched = e.touched
            e.next_step()
            if not (self.is_local_owner(e) and touched):
                continue
            e.wait_publish()
            p = e.param
            # the parameter itself, except the global owner's fp32 master, sent as a cast copy
            # (receivers hold the model dtype, so `to` is a no-op for them)
            buf = p.detach().to(e.dtype)
            src = dist.get_global_rank(self.replicate_group, e.owner_replica)
            with phase(f"step (HSDP publish of {e.name})"):
                work = dist.broadcast(buf, src=src, group=self.replicate_group, async_op=True)
            e.publish = work
            if not asynchronous:
                e.wait_publish()


def dedicated_state(model: nn.Module) -> DedicatedState | None:
    return getattr(model, STATE_ATTR, None)
