"""Small records agreed between ranks at setup: JSON in uint8 tensors, never pickled.

Unlike torch's `all_gather_object` / `broadcast_object_list`, nothing a peer sends is unpickled
and numpy is not needed. Each call is two collectives on `group`: the lengths, then the bytes
padded to the longest (on the current CUDA device for NCCL, else the CPU).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist


def _agree(data: bytes, move: Callable[[torch.Tensor], list], group) -> list:
    """The values whose encodings `move` delivers here: it runs one collective on a tensor and
    returns the tensors received (its length, then its bytes)."""
    backend = str(dist.get_backend(group))
    on_cuda = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(n) for t in move(length) for n in t.tolist()]
    buf = torch.zeros(max(1, *sizes), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = move(buf.to(device))
    return [
        json.loads(bytes(b[:n].tolist()).decode("utf-8")) for b, n in zip(bufs, sizes, strict=True)
    ]


def _encode(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def all_gather_json(value: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's JSON-encodable `value`, parsed, in group rank order."""

    def move(t: torch.Tensor) -> list:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return out

    return _agree(_encode(value), move, group)


def broadcast_json(value: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Group rank `src`'s JSON-encodable `value`, parsed, on every rank of `group` (the others
    pass any value; it is not sent)."""
    root = src if group is None else dist.get_global_rank(group, src)

    def move(t: torch.Tensor) -> list:
        dist.broadcast(t, root, group=group)
        return [t]

    return _agree(_encode(value) if dist.get_rank(group) == src else b"", move, group)[0]
