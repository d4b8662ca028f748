"""Seeded initialization that does not depend on the world size (proofs/meta_init.md).

`init_weights(model, fn, seed=)` runs `fn(module)` on every module, as `model.apply(fn)` does,
but one parameter at a time: for parameter `name` of a module, the default random generators are
seeded from (seed, name) alone, the module's attribute `name` is a full-shape tensor that `fn`
writes, and the module's other parameters are meta stand-ins of their full shapes (their
shapes readable, writes to them free, reads of their values an error). So each parameter's value
is a function of (seed, name, shape, dtype, fn) only: on one process, on any number of ranks, on
any mesh, the same bits. A rank computes only what it holds: a dedicated parameter on its global
owner (a piece or a tensor rank's part cut from the full value), an FSDP2 or tensor-parallel
DTensor's local shard on every rank (from a transient full value: one parameter at a time), a
plain tensor in place. A module's buffers are written last, by one more call with every
parameter a stand-in, seeded from (seed, the module's name)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from . import _fsdp_adapter as fsdp
from ._state import DedicatedState, dedicated_state

# path components that wrappers add to a module's name (activation checkpointing, compile, FSDP1)
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def param_seed(seed: int, name: str) -> int:
    """The seed of parameter (or module) `name`: 63 bits of sha256(f"{seed}:{name}")."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def clean_name(name: str) -> str:
    """`name` without the wrappers' path components: the plain model's name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


@dataclass
class _Target:
    """What `fn` writes for one parameter on this rank (`full`: a full-shape tensor) and how the
    value lands in what the rank holds (`store`: None when `full` is the held tensor itself)."""

    full: Tensor
    store: Callable[[Tensor], None] | None = None


def init_weights(model: nn.Module, fn: Callable[[nn.Module], None], *, seed: int) -> None:
    """Initialize every parameter and buffer of `model` with `fn(module)` (as `model.apply(fn)`:
    e.g. `lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None`), each
    parameter from its own generator seeded by (seed, its name): the same values on 1 process,
    on any number of ranks, under HSDP and tensor parallelism.

    Call it after `model.to_empty(device=...)` (a meta model) or on a real one, on every rank.
    `fn` must write each parameter from its shape and the generator alone: the module's other
    parameters are meta stand-ins while `fn` writes one, so reading their values raises."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    st = dedicated_state(model)
    on_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if on_meta:
        raise ValueError(
            f"{on_meta[0]} is still on the meta device ({len(on_meta)} parameters): call "
            "model.to_empty(device=...) first (after dedicate_params and fully_shard), then "
            "init_weights"
        )

    def shape_of(p: Tensor) -> torch.Size:
        e = None if st is None else st.entry(p)
        return p.shape if e is None else e.full_shape

    with torch.no_grad():
        for mname, module in model.named_modules():
            targets = {}
            for attr, p in module._parameters.items():
                if p is not None and (t := _target(st, p)) is not None:
                    targets[attr] = t
            real = {k: t.full for k, t in targets.items()}
            run_init(module, fn, seed, clean_name(mname), real, shape_of)
            for t in targets.values():
                if t.store is not None:
                    t.store(t.full)
    if st is not None:
        st.sync_copies("init_weights")


def run_init(
    module: nn.Module,
    fn: Callable[[nn.Module], None],
    seed: int,
    mname: str,
    real: dict[str, Tensor],
    shape_of: Callable[[Tensor], torch.Size] = lambda p: p.shape,
) -> None:
    """`fn(module)` once per attribute in `real` ({attribute: the full tensor fn writes}), the
    others stand-ins (`shape_of(param)`: a parameter's full shape), generators seeded from the
    parameter's name; then, where the module has buffers, once more with every parameter a
    stand-in, seeded from the module's name. `mname`: the module's name in the plain model."""
    prefix = f"{mname}." if mname else ""
    for attr, full in real.items():
        _call(module, fn, param_seed(seed, prefix + attr), {attr: full}, shape_of, prefix + attr)
    if any(b is not None for b in module._buffers.values()):
        what = mname or "the root module's buffers"
        _call(module, fn, param_seed(seed, mname), {}, shape_of, what)


def _call(module: nn.Module, fn, seed: int, real: dict, shape_of, what: str) -> None:
    devices = [t.device for t in (*real.values(), *module._buffers.values()) if t is not None]
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with _swapped(module, real, shape_of), torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        try:
            fn(module)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            others = [k for k, p in module._parameters.items() if p is not None and k not in real]
            if not others or "meta" not in str(err):
                raise
            raise ValueError(
                f"init_weights: fn({type(module).__name__}) failed while it wrote {what}: it "
                f"reads {others} of the same module, which are meta stand-ins during that call "
                "(each parameter is written from its own seed, whatever rank holds the others). "
                "Write each parameter from its shape and the random generator alone"
            ) from err


@contextlib.contextmanager
def _swapped(module: nn.Module, real: dict[str, Tensor], shape_of) -> Iterator[None]:
    """The module's parameters: `real`'s as Parameters around those tensors, the others meta
    stand-ins of their full shapes; restored afterwards."""
    saved = dict(module._parameters)
    for k, p in saved.items():
        if p is None:
            continue
        t = real[k] if k in real else torch.empty(shape_of(p), dtype=p.dtype, device="meta")
        module._parameters[k] = nn.Parameter(t, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        module._parameters.update(saved)


def _target(st: DedicatedState | None, p: Tensor) -> _Target | None:
    """What this rank writes for parameter `p` (None: nothing, another rank holds it)."""
    e = None if st is None else st.entry(p)
    if e is None:
        if fsdp.is_dtensor(p):  # FSDP2's or tensor parallelism's shard, cut from a full value
            full = torch.empty(p.shape, dtype=p.dtype, device=fsdp.local(p).device)
            return _Target(full, lambda v, p=p: fsdp.local(p).copy_(fsdp.shard_like(v, p)))
        return _Target(p.detach())
    if not st.is_global_owner(e):  # replicas' local owners take the owner's value (sync_copies)
        return None
    if (e.whole is None and e.tp is None) or (e.tp is not None and not e.tp.sharded):
        return _Target(e.param.detach())  # the whole value
    full = torch.empty(e.full_shape, dtype=e.param.dtype, device=e.param.device)
    if e.tp is None:  # a piece: its part of the whole
        return _Target(full, lambda v: e.param.detach().copy_(v[e.piece.index]))
    at, dim = e.tp.offset(st.tensor.rank), e.tp.dim  # this tensor rank's part
    size = e.shape[dim]
    return _Target(full, lambda v: e.param.detach().copy_(v.narrow(dim, at, size)))


def held_values(
    model: nn.Module,
    names: set[str],
    fn: Callable[[nn.Module], None],
    *,
    seed: int,
    device: torch.device,
) -> dict[str, Tensor]:
    """The full values `init_weights` gives the parameters `names` (of a model on the meta
    device, by `named_parameters` name), computed on `device`; the model's buffers get storage
    on `device` and their values, its parameters stay on meta (the functional face's `init`)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    values: dict[str, Tensor] = {}
    with torch.no_grad():
        for mname, module in model.named_modules():
            for k, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[k] = torch.empty_like(b, device=device)
            real = {}
            for attr, p in module._parameters.items():
                if p is not None and (n := canonical[id(p)]) in names:
                    real[attr] = values.get(n)
                    if real[attr] is None:
                        real[attr] = values[n] = torch.empty(p.shape, dtype=p.dtype, device=device)
            run_init(module, fn, seed, clean_name(mname), real)
    return values
