"""`CommCounter` books every collective a rank issues, `CommTimer` the seconds it waits for
them (`blocked()`), each by phase; bytes per rank by proofs/comm_notes.md's rule."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from custom_ops._collectives import SEND_TAG

# op name -> (factor of (W-1)/W, which argument carries the payload: reduce-scatters' full input)
_C10D = {
    "allreduce_": (2, 0),
    **dict.fromkeys(("broadcast_", "reduce_", "send", "recv_"), (1, 0)),
    **dict.fromkeys(("_allgather_base_", "allgather_into_tensor_coalesced_"), (1, 0)),
    **dict.fromkeys(("allgather_", "reduce_scatter_", "_reduce_scatter_base_"), (1, 1)),
    **dict.fromkeys(("reduce_scatter_tensor_coalesced_", "alltoall_base_"), (1, 1)),
}
_FUNCOL = {
    "all_reduce": (2, 0),
    **dict.fromkeys(("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"), (1, 0)),
}


def _nbytes(x: object) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(args: tuple, kwargs: dict) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.ScriptObject):  # c10d ops: the process group, boxed
            with contextlib.suppress(RuntimeError, AttributeError, TypeError):
                return int(dist.ProcessGroup.unbox(a).size())
        if isinstance(a, list) and a and all(isinstance(r, int) for r in a):
            return len(a)  # functional collectives: explicit rank list
        if isinstance(a, str):
            with contextlib.suppress(RuntimeError, ValueError, AttributeError):
                return dist.get_world_size(dist.distributed_c10d._resolve_process_group(a))
    return dist.get_world_size() if dist.is_initialized() else 1


def _send_reduce_share(name: str, args: tuple, payload: int) -> tuple[int, float, int]:
    """(W, payload, calls) to book for one transfer of a reduce over a group of W gloo ranks
    made of direct transfers (custom_ops._collectives.SendReduce): what its rank books for the
    reduce it implements, (W-1)/W of the payload and one call, spread over its transfers (the
    owner's W-1 receives book 1/(W-1) of it each, the call on the first one)."""
    pg = dist.ProcessGroup.unbox(args[1])
    w = int(pg.size())
    if name == "send":
        return w, payload, 1
    first = 1 if pg.rank() == 0 else 0  # the owner receives from its peers in group-rank order
    return w, payload / (w - 1), int(args[2] == first)


@dataclass
class PhaseStats:
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    op_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def bytes(self) -> float:
        return sum(self.op_bytes.values())


class _Phases:
    _phase = "other"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev


class CommCounter(_Phases, TorchDispatchMode):
    """Calls and per-rank bytes (`stats[phase]`) of every c10d op and functional collective the
    rank dispatches, by phase: `with CommCounter() as comm, comm.phase("step"): opt.step()`."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, PhaseStats] = defaultdict(PhaseStats)

    def total_bytes(self, *phases: str) -> float:
        return sum(self.stats[p].bytes for p in (phases or tuple(self.stats)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        table = _C10D if ns == "c10d" else _FUNCOL if ns == "_c10d_functional" else None
        if table is not None and name in table:
            factor, which = table[name]
            p2p = name in ("send", "recv_")
            w = 2 if p2p else _group_size(args, kwargs)
            payload = _nbytes(args[which]) if which < len(args) else 0
            calls = 1
            if p2p and len(args) > 3 and args[3] == SEND_TAG:
                name, w, payload, calls = "reduce_", *_send_reduce_share(name, args, payload)
            if name == "all_gather_into_tensor":
                payload *= w  # args[0] is this rank's shard
            st = self.stats[self._phase]
            st.calls[name] += calls
            st.op_bytes[name] += factor * (w - 1) / w * payload if w > 1 else 0.0
        return func(*args, **kwargs)


class CommTimer(_Phases):
    """Seconds (`seconds[phase]`) and count (`waits[phase]`) of the calling thread's waits for
    dmuon_fn's collectives (`blocked()`), by phase; nested timers each count."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.waits: dict[str, int] = defaultdict(int)

    def total(self, *phases: str) -> float:
        return sum(self.seconds[p] for p in (phases or tuple(self.seconds)))

    def __enter__(self) -> CommTimer:
        _TIMERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TIMERS.remove(self)


_TIMERS: list[CommTimer] = []


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Time the enclosed wait for every active `CommTimer`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        for timer in _TIMERS:
            timer.seconds[timer._phase] += dt
            timer.waits[timer._phase] += 1
