"""Handles: (1,) float64 CPU tensors keying a weak registry of the object API's `Handler`s,
taken by dmuon::gather_start, param_gather and param_reduce (proofs/custom_ops_notes.md)."""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Protocol

import torch
from torch import Tensor


class Handler(Protocol):
    """start(): issue the gathers of the handler's unit, returning at once. gather(): the
    parameter's full value on this rank (a collective on every rank of its group). reduce(grad):
    sum the full-shape gradient of the gathered value onto the owner."""

    def start(self) -> None: ...
    def gather(self) -> Tensor: ...
    def reduce(self, grad: Tensor) -> None: ...


_HANDLERS: weakref.WeakValueDictionary[int, Handler] = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def new_handle(handler: Handler) -> Tensor:
    """Register `handler`; return its handle (shape (1,), float64 on the CPU: exact to 2**53)."""
    key = next(_NEXT)
    _HANDLERS[key] = handler
    return torch.tensor([float(key)], dtype=torch.float64, device="cpu")  # never a default device


def handler(handle: Tensor) -> Handler:
    key = int(handle.item())
    try:
        return _HANDLERS[key]
    except KeyError:
        msg = f"dmuon: no live handler for handle {key}: its parameter's owner was deleted"
        raise RuntimeError(msg) from None


class SampleHandler:
    """Single-process handler of the contract test's samples: gathers `value`, sums into `grad`."""

    def __init__(self, value: Tensor) -> None:
        self.value, self.grad, self.started = value, torch.zeros_like(value), 0
        self.handle = new_handle(self)

    def start(self) -> None:
        self.started += 1

    def gather(self) -> Tensor:
        return self.value.clone()

    def reduce(self, grad: Tensor) -> None:
        self.grad += grad


@functools.cache  # holds them: the registry holds handlers weakly
def sample_handlers() -> list[SampleHandler]:
    """The samples' handlers (fp32 2-D, bf16 3-D), made once, shared by the handle ops."""
    g = torch.Generator().manual_seed(5)
    shapes = (((6, 4), torch.float32), ((3, 5, 2), torch.bfloat16))
    return [SampleHandler(torch.randn(*s, generator=g, dtype=dt)) for s, dt in shapes]
