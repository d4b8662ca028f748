"""torch's state dicts of a model with dedicated parameters (proofs/torch_surface.md).

In `model.state_dict()` each dedicated parameter is a DTensor of its whole shape, Shard(0) over
every data rank of the model in slot order (torch.chunk's rows per rank), its rows sent by the
global owners of its pieces (on a model of one rank: a plain tensor): DCP saves each value
once, in even chunks, and reloads it on any world size; `get_model_state_dict(...,
full_state_dict=True)` gathers the full value as it does FSDP2's. `load_state_dict` takes such
a DTensor (its rows sent back to every local owner of each piece), another DTensor (its full
value), or a plain tensor of the whole shape (each local owner copies its part; no
communication). Both are collective: every rank of the model calls them together, as torch's
distributed state-dict functions do."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm._mesh import master_dtype
from ..planning._slices import parse_piece
from ._state import DedicatedState, Entry

_FLAT = "_dmuon_flat_mesh"


def rows(n: int, world: int, r: int) -> tuple[int, int]:
    """[start, stop) of the rows Shard(0) gives rank r of `world` out of `n` (torch.chunk)."""
    size = -(-n // world)
    start = min(r * size, n)
    return start, min(start + size, n)


def flat_mesh(st: DedicatedState) -> tuple[DeviceMesh, list[int]]:
    """A 1-D mesh over the model's data ranks in slot order and their global ranks, built once
    (collective: every rank of the model)."""
    got = getattr(st, _FLAT, None)
    if got is not None:
        return got
    if st.tensor is not None:
        raise NotImplementedError(
            "torch's state_dict of a tensor-parallel model with dedicated parameters is not "
            "supported: save and load it with dmuon_fn.save_checkpoint / load_checkpoint"
        )
    W = st.shard_size * st.replicate_size
    if dist.get_world_size() != W:
        raise NotImplementedError(
            f"the model's {W} data ranks are not the whole job ({dist.get_world_size()} ranks): "
            "save and load it with dmuon_fn.save_checkpoint / load_checkpoint"
        )
    slot = st.view.replica_rank * st.shard_size + st.view.shard_rank
    slots = [None] * W
    dist.all_gather_object(slots, slot)
    ranks = [0] * W
    for rank, s in enumerate(slots):
        ranks[s] = rank
    mesh = DeviceMesh(st.entries[0].device.type, ranks)
    setattr(st, _FLAT, (mesh, ranks))
    return mesh, ranks


def owner_slot(st: DedicatedState, e: Entry, replica: int | None = None) -> int:
    """The slot of `e`'s global owner (`replica`: its local owner in that replica)."""
    return (e.owner_replica if replica is None else replica) * st.shard_size + e.owner_shard


def _regions(e: Entry, start: int, stop: int):
    """(index into the piece, index into the shard of rows [start, stop)) of the part of `e`
    (a piece or a whole parameter) in those rows of its parameter, or None if they share none."""
    index = () if e.piece is None else e.piece.index
    a = 0 if e.piece is None else e.piece.offsets[0]  # the piece's rows [a, a + its dim 0)
    lo, hi = max(a, start), min(a + e.shape[0], stop)
    if lo >= hi:
        return None
    return (slice(lo - a, hi - a),), (slice(lo - start, hi - start), *index[1:])


def _exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
    """Point-to-point sends and receives (tensor, global peer), issued together and waited."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()


def entries_of(st: DedicatedState, p: Tensor) -> list[Entry]:
    """The entries of the dedicated parameter a module holds as `p`: its pieces in order, or
    its one entry."""
    e = st.entry(p)
    if e.whole is None:
        return [e]
    by_name = {x.name: x for x in st.entries}
    return [by_name[n] for n in st.plan.pieces(parse_piece(e.name).param)]


def whole_value(st: DedicatedState, es: list[Entry], get=None, dtype=None) -> Tensor:
    """The parameter made of `es` (its pieces in order, or its one entry) as a DTensor,
    Shard(0) over `flat_mesh`: each global owner sends every rank its rows. `get(e)`: what
    to send of a piece its global owner holds (default: the master), in `dtype` (default: the
    master's). On a model of one rank, the plain whole tensor (what safetensors and HF's
    `save_pretrained` take)."""
    mesh, ranks = flat_mesh(st)
    W, me = len(ranks), ranks.index(dist.get_rank())
    whole, dtype = es[0].full_shape, dtype or master_dtype(es[0].dtype)
    get = get or (lambda e: e.param.detach())
    start, stop = rows(whole[0], W, me)
    local = torch.empty((stop - start, *whole[1:]), dtype=dtype, device=es[0].device)
    sends, recvs, into = [], [], []
    for e in es:
        owner = owner_slot(st, e)
        for r in range(W):
            reg = _regions(e, *rows(whole[0], W, r))
            if reg is None or me not in (owner, r):
                continue
            piece, shard = reg
            if owner == me:
                part = get(e)[piece].to(dtype)
                if r == me:
                    local[shard].copy_(part)
                else:
                    sends.append((part.contiguous(), ranks[r]))
            else:
                buf = torch.empty(local[shard].shape, dtype=dtype, device=local.device)
                recvs.append((buf, ranks[owner]))
                into.append((shard, buf))
    _exchange(sends, recvs)
    for shard, buf in into:
        local[shard].copy_(buf)
    if W == 1:
        return local
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=whole, stride=_contiguous(whole)
    )


def load_whole(st: DedicatedState, es: list[Entry], value: Tensor, key: str, put=None) -> None:
    """Write `value` (the whole parameter: a `whole_value`-laid DTensor, another DTensor, or
    a plain tensor) into every local owner's copy of each of `es`; `put(e)`: the tensor to
    write instead, on the global owner only (an optimizer state), None elsewhere."""
    whole = es[0].full_shape
    if tuple(value.shape) != tuple(whole):
        raise ValueError(
            f"{key}: the state dict's value has shape {tuple(value.shape)}, the model's "
            f"parameter {tuple(whole)} (dedicated parameters load whole tensors)"
        )
    for e in es:
        e.wait_publish()
    if isinstance(value, DTensor) and not _laid_out(value, flat_mesh(st)[0]):
        value = value.full_tensor()
    target = put or (lambda e: e.param if st.is_local_owner(e) else None)
    with torch.no_grad():
        if not isinstance(value, DTensor):
            for e in es:
                if (t := target(e)) is not None:
                    part = value.detach() if e.piece is None else value.detach()[e.piece.index]
                    t.copy_(part.to(t.device, t.dtype))
            return
        replicas = (lambda e: (e.owner_replica,)) if put else (lambda e: range(st.replicate_size))
        _scatter_back(st, es, value.to_local(), flat_mesh(st)[1], target, replicas)


def _scatter_back(st, es: list[Entry], local: Tensor, ranks: list[int], target, replicas) -> None:
    """Each rank sends its rows of the whole to the owners of each piece in `replicas(e)`,
    which write them into `target(e)`."""
    W, me = len(ranks), ranks.index(dist.get_rank())
    n = es[0].full_shape[0]
    sends, recvs, into = [], [], []
    for e in es:
        for q in replicas(e):
            dst = owner_slot(st, e, q)
            for r in range(W):
                reg = _regions(e, *rows(n, W, r))
                if reg is None or me not in (dst, r):
                    continue
                piece, shard = reg
                if r == me and dst == me:
                    target(e)[piece].copy_(local[shard])
                elif r == me:
                    sends.append((local[shard].contiguous(), ranks[dst]))
                else:
                    shape = target(e)[piece].shape
                    buf = torch.empty(shape, dtype=local.dtype, device=local.device)
                    recvs.append((buf, ranks[r]))
                    into.append((e, piece, buf))
    _exchange(sends, recvs)
    for e, piece, buf in into:
        target(e)[piece].copy_(buf)


def _laid_out(value: DTensor, mesh: DeviceMesh) -> bool:
    """Whether `value` is laid out as `whole_value` lays it (Shard(0) over the same ranks)."""
    same = value.device_mesh.mesh.flatten().tolist() == mesh.mesh.flatten().tolist()
    return same and tuple(value.placements) == (Shard(0),)


def _contiguous(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def install(st: DedicatedState, uses: dict[nn.Module, list[tuple[str, list[Entry]]]]) -> None:
    """Register the hooks on each module holding dedicated parameters (`uses`: module -> its
    (attribute, entries) pairs)."""
    for module, attrs in uses.items():

        def post(module, state_dict, prefix, local_metadata, attrs=attrs):
            if st.on_meta():  # nothing to send yet (torch's functions drop meta values)
                return
            for attr, es in attrs:
                if prefix + attr in state_dict:
                    state_dict[prefix + attr] = whole_value(st, es)

        def pre(module, state_dict, prefix, *args, attrs=attrs):
            st.scheduler.drop_ahead()  # gathers issued before carry the values being replaced
            for attr, es in attrs:
                key = prefix + attr
                if key in state_dict and torch.is_tensor(state_dict[key]):
                    load_whole(st, es, state_dict[key], key)
                    # the module's own copy then copies the held tensor onto itself
                    state_dict[key] = module._parameters[attr]

        module.register_state_dict_post_hook(post)
        module.register_load_state_dict_pre_hook(pre)
