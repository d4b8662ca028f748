"""Peak memory of one call, from the CPU allocator's own records (torch.profiler).

With profile_memory=True the profiler logs every CPU allocation and free (pointer, bytes, the
op it happened in), eager or compiled alike: inductor's buffers and the custom ops' outputs go
through the same allocator. Two peaks over the call, both relative to its start:

- gathered: bytes live in tensors allocated inside dmuon::owner_broadcast (the functional
  API) or a "dmuon::param_gather" region (the object API's grouped gathers) — the gathered
  copies of parameters (the owner's own copy included; the token is 0 bytes) and, under HSDP,
  the update's publish over the replicate group: the rank's new local parameters, made after
  the last gathered copy is gone;
- total: every tensor allocated during the call (activations, gradients, temporaries).

Add the rank's local parameters (allocated before the call) for its parameter memory.

The profiler sees only the frees made on the profiled thread. gloo runs each collective on a
worker thread that may still hold the tensor for a moment after `wait()` returns; if the program
drops it first (a stage as short as an embedding lookup), the last reference goes, and the
memory is freed, on that thread, unseen, and the copy would count as live until its address came
back from the allocator. So during the call every `torch.distributed.broadcast` and `reduce`
runs on a scratch copy (allocated in a "memory probe scratch" region and counted nowhere) that
is copied back (for an asynchronous one, when its work is waited on): gloo never holds a tensor
of the program's, whose every free is then made, and recorded, on the calling thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

GATHER_OPS = ("dmuon::owner_broadcast", "dmuon::owner_broadcast_start", "dmuon::param_gather")
SCRATCH = "memory probe scratch"


def _allocations(roots):
    """(time, ptr, bytes, region) for every allocation event (frees negative); region is
    SCRATCH, "gather" (one of GATHER_OPS) or None, the innermost the event happened in (a
    ticket of custom_ops._collectives, made inside a gather op, counts in the total only)."""
    out, stack = [], [(r, None) for r in roots]
    while stack:
        node, region = stack.pop()
        if node.name in GATHER_OPS:
            region = "gather"
        elif node.name == SCRATCH:
            region = node.name
        elif node.name == "dmuon::ticket":  # an asynchronous collective's 8-byte ticket
            region = None
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            out.append((node.start_time_ns, f.ptr, f.alloc_size, region))
        stack.extend((c, region) for c in node.children)
    return sorted(out, key=lambda e: (e[0], e[2] > 0))  # at equal times, frees first


class _CopyBack:
    """An asynchronous collective's work on a scratch copy: waiting copies the result back."""

    def __init__(self, work, scratch, tensor) -> None:
        self.work, self.scratch, self.tensor = work, scratch, tensor

    def wait(self) -> bool:
        self.work.wait()
        if self.scratch is not None:
            self.tensor.copy_(self.scratch)
            self.scratch = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _through_scratch(collective: Callable) -> Callable:
    def run(tensor, *args, async_op: bool = False, **kwargs):
        with record_function(SCRATCH):
            scratch = tensor.clone()
            work = collective(scratch, *args, async_op=async_op, **kwargs)
            if async_op:
                return _CopyBack(work, scratch, tensor)
            tensor.copy_(scratch)
        return None

    return run


@contextlib.contextmanager
def _collectives_through_scratch() -> Iterator[None]:
    saved = dist.broadcast, dist.reduce
    dist.broadcast, dist.reduce = (_through_scratch(c) for c in saved)
    try:
        yield
    finally:
        dist.broadcast, dist.reduce = saved


# Every profiler a measurement made, kept: a torch 2.13 profiler object sits in reference cycles
# (bound methods, partials), and the garbage collector segfaults when it frees one (seen inside
# a later backward's collective). Kept alive, none is ever collected.
_PROFILERS: list = []


def peak_bytes(fn: Callable[[], object]) -> tuple[object, dict[str, int]]:
    """(fn(), {"gathered": peak bytes, "total": peak bytes}) over one call of fn."""
    with (
        _collectives_through_scratch(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        result = fn()
    counts = {None: ("total",), "gather": ("total", "gathered"), SCRATCH: ()}  # by region
    live: dict[int, tuple[int, str | None]] = {}  # allocated during the call, by address
    now = {"gathered": 0, "total": 0}
    peak = dict(now)

    def add(size: int, region: str | None) -> None:
        for k in counts[region]:
            now[k] += size

    events = _allocations(prof.profiler.kineto_results.experimental_event_tree())
    _PROFILERS.append(prof)
    for _, ptr, size, region in events:
        if ptr in live:  # freed, or handed out again: freed unseen (a scratch copy, on gloo's)
            old, old_region = live.pop(ptr)
            add(-old, old_region)
        elif size < 0:  # a tensor from before the call
            now["total"] += size
        if size > 0:
            live[ptr] = (size, region)
            add(size, region)
        for k in peak:
            peak[k] = max(peak[k], now[k])
    return result, peak
