"""The object API's records: one `Entry` per dedicated parameter, and the `Topology` of the
groups it is gathered and reduced over. Plain data below every module that moves parameters.

Who holds what (G ranks in the shard group, R replicas under HSDP):
- the *local owner* of a parameter is shard rank `owner_shard` in every replica; it holds the
  full parameter between steps. The *global owner*, (owner_shard, owner_replica), holds it in
  fp32 (the master, when the model is lower precision), its optimizer state, and is the only
  rank that runs Newton-Schulz on it. Every other rank holds a 0-size placeholder.
- under tensor parallelism "the parameter" is this tensor rank's part of it (`Entry.tp`): every
  tensor rank of the global owner holds its part's master and state, and one of them (the
  layout's `root`) runs the matrix's Newton-Schulz (dmuon_fn/tp/_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm._counters import blocked
from ..comm._errors import phase
from ..tp._layout import TensorLayout


@dataclass(eq=False)
class Entry:
    """One dedicated parameter (tied names share one entry)."""

    name: str
    names: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype  # compute and gather dtype (the model's, or param_dtype)
    reduce_dtype: torch.dtype  # gradient reduction dtype
    owner_shard: int
    owner_replica: int
    param: nn.Parameter  # full on local owners (fp32 master on the global owner), else 0-size
    publish: dist.Work | None = None
    # one per module slot of the entry (custom_ops._handles; dedicated/_gather.py's `Slot`),
    # naming it to dmuon::param_gather/param_reduce: each requires grad as `param` does, and
    # backward sets its .grad when it reaches that slot's gather
    handles: list[torch.Tensor] = field(default_factory=list)
    device: torch.device | None = None  # param's: compiled hooks read this, never `param`
    # tensor parallelism: `shape` and `param` are this tensor rank's part of the parameter, whose
    # layout (and whole shape) this is (dmuon_fn/tp/_layout.py); None without
    tp: TensorLayout | None = None

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) >= 2

    @property
    def full_shape(self) -> torch.Size:
        """The whole parameter's shape (`shape`, unless tensor parallelism splits it)."""
        return self.shape if self.tp is None else self.tp.full_shape

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def touched(self) -> bool:
        """Backward reached this parameter's gather since the last step (the same on every rank
        that took part)."""
        return any(h.grad is not None for h in self.handles)

    def next_step(self) -> None:
        """Forget this step's `touched`; follow `param.requires_grad` (set since by the user)."""
        for h in self.handles:
            h.grad = None
        self.follow_requires_grad()

    def follow_requires_grad(self) -> None:
        """The handles require grad as the parameter does: a compiled block reads a handle's
        flag, never the parameter's."""
        for h in self.handles:
            if h.requires_grad != self.param.requires_grad:
                h.requires_grad_(self.param.requires_grad)

    def wait_publish(self) -> None:
        """Block until the HSDP publish into `param` (if one is pending) has landed."""
        if self.publish is not None:
            with blocked(), phase(f"the HSDP publish of {self.name}"):
                self.publish.wait()
            self.publish = None


@dataclass(eq=False)
class Topology:
    """The groups dedicated parameters move over, and this rank's place in them."""

    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    shard_rank: int
    replica_rank: int
    shard_size: int
    replicate_size: int
    reshard_after_forward: bool

    def is_local_owner(self, e: Entry) -> bool:
        return self.shard_rank == e.owner_shard

    def is_global_owner(self, e: Entry) -> bool:
        return self.shard_rank == e.owner_shard and self.replica_rank == e.owner_replica
