"""Peak memory of one call, from the CPU allocator's own records (torch.profiler).

With profile_memory=True the profiler logs every CPU allocation and free (pointer, bytes, the
op it happened in), eager or compiled alike: inductor's buffers and the custom ops' outputs go
through the same allocator. Two peaks over the call, both relative to its start:

- gathered: bytes live in tensors allocated inside dmuon::owner_broadcast — the gathered
  copies of parameters (the owner's own copy included; the token is 0 bytes);
- total: every tensor allocated during the call (activations, gradients, temporaries).

Add the rank's local parameters (allocated before the call) for its parameter memory.
"""

from __future__ import annotations

from collections.abc import Callable

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

GATHER_OP = "dmuon::owner_broadcast"


def _allocations(roots):
    """(time, ptr, bytes, inside the gather op) for every allocation event (frees negative)."""
    out, stack = [], [(r, False) for r in roots]
    while stack:
        node, inside = stack.pop()
        inside = inside or node.name == GATHER_OP
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            out.append((node.start_time_ns, f.ptr, f.alloc_size, inside))
        stack.extend((c, inside) for c in node.children)
    return sorted(out, key=lambda e: (e[0], e[2] > 0))  # at equal times, frees first


def peak_bytes(fn: Callable[[], object]) -> tuple[object, dict[str, int]]:
    """(fn(), {"gathered": peak bytes, "total": peak bytes}) over one call of fn."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = _allocations(prof.profiler.kineto_results.experimental_event_tree())
    gathered_ptrs: dict[int, int] = {}
    total = gathered = peak_total = peak_gathered = 0
    for _, ptr, size, inside in events:
        total += size
        if size > 0 and inside:
            gathered -= gathered_ptrs.pop(ptr, 0)  # the allocator reused it: that one was freed
            gathered_ptrs[ptr] = size
            gathered += size
        elif size < 0 and ptr in gathered_ptrs:
            gathered -= gathered_ptrs.pop(ptr)
        peak_total, peak_gathered = max(peak_total, total), max(peak_gathered, gathered)
    return result, {"gathered": peak_gathered, "total": peak_total}
