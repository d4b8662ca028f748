"""Setup records agreed between ranks as JSON in uint8 tensors, never pickled: two collectives
per call on `group`, on the current CUDA device for NCCL, else the CPU (proofs/comm_notes.md)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist


def _agree(value: object, send: bool, move: Callable[[torch.Tensor], list], group) -> list:
    """What `move` (one collective: lengths, then bytes) delivers here; `value` goes if `send`."""
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode() if send else b""
    backend = str(dist.get_backend(group))
    on_cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(n) for t in move(length) for n in t.tolist()]
    buf = torch.zeros(max(1, *sizes), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = move(buf.to(device))
    return [json.loads(bytes(b[:n].tolist())) for b, n in zip(bufs, sizes, strict=True)]


def all_gather_json(value: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's JSON-encodable `value`, parsed, in group rank order."""

    def move(t: torch.Tensor) -> list:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return out

    return _agree(value, True, move, group)


def broadcast_json(value: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Group rank `src`'s JSON-encodable `value`, parsed, on every rank (others' are not sent)."""
    root = src if group is None else dist.get_global_rank(group, src)

    def move(t: torch.Tensor) -> list:
        dist.broadcast(t, root, group=group)
        return [t]

    return _agree(value, dist.get_rank(group) == src, move, group)[0]
