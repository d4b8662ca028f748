"""Small records exchanged between ranks as JSON in uint8 tensors, never pickled.

torch's `all_gather_object` / `broadcast_object_list` unpickle whatever a peer sends and need
numpy at run time; these parse a peer's bytes as JSON data and need nothing beyond torch. Each
call is two collectives: the lengths, then the bytes padded to the longest.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a group's collectives take tensors: the current CUDA device for NCCL."""
    if "nccl" in str(dist.get_backend(group)) and "gloo" not in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, group: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in group rank order: two all_gathers of tensors (the lengths, then
    the bytes padded to the longest), nothing pickled."""
    world, device = dist.get_world_size(group), _device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t) for t in torch.cat(lengths).tolist()]
    buf = _padded(data, max(sizes), device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[:n].tolist()) for b, n in zip(bufs, sizes, strict=True)]


def all_gather_json(value: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's JSON-encodable `value`, parsed, in group rank order (`all_gather_bytes`)."""
    data = _encode(value)
    return [json.loads(b.decode("utf-8")) for b in all_gather_bytes(data, group)]


def broadcast_json(value: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Group rank `src`'s JSON-encodable `value`, parsed, on every rank of `group` (the others
    pass any value; it is not sent)."""
    here = dist.get_rank(group)
    data = _encode(value) if here == src else b""
    device = _device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    root = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast(length, root, group=group)
    size = int(length.item())
    buf = _padded(data, size, device)
    dist.broadcast(buf, root, group=group)
    return json.loads(bytes(buf[:size].tolist()).decode("utf-8"))


def _encode(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """`data` in a uint8 tensor of `size` (at least 1) bytes on `device`, zero-padded."""
    buf = torch.zeros(max(1, size), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)
