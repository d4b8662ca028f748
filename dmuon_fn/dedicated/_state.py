"""What `dedicate_params` attaches to a model (who holds what: dedicated/_entries.py), and the
HSDP publish after each step: the global owner broadcasts the new value, in the model dtype, to
the other replicas' local owners.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..tp._layout import TensorMesh
from ._entries import Entry, Topology, broadcast_start
from ._schedule import Scheduler

STATE_ATTR = "_dmuon_state"


@dataclass(eq=False)
class DedicatedState(Topology):
    """What `dedicate_params` attaches to the model (`model._dmuon_state`)."""

    entries: list[Entry] = field(default_factory=list)
    scheduler: Scheduler | None = None
    by_param: dict[int, Entry] = field(default_factory=dict)  # id(param) -> its entry
    tensor: TensorMesh | None = None  # the tensor-parallel ranks

    def entry(self, p: torch.Tensor) -> Entry | None:
        return self.by_param.get(id(p))

    def wait_publish(self, e: Entry) -> None:
        e.wait_publish()

    def publish(self, asynchronous: bool) -> None:
        """Every entry forgets `touched`; under HSDP the local owners of the touched ones take
        the global owner's value (`asynchronous`: waited for before its next gather or update)."""
        for e in self.entries:
            touched = e.touched
            e.next_step()
            if self.replicate_group is None or not (self.is_local_owner(e) and touched):
                continue
            e.wait_publish()
            # the global owner sends a cast copy of its fp32 master; `to` is a no-op elsewhere
            buf = e.param.detach().to(e.dtype)
            what = f"step (HSDP publish of {e.name})"
            e.publish = broadcast_start(buf, e.owner_replica, self.replicate_group, what)
            if not asynchronous:
                e.wait_publish()


def dedicated_state(model: nn.Module) -> DedicatedState | None:
    return getattr(model, STATE_ATTR, None)
