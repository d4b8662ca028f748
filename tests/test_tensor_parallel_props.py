"""Properties behind tensor-parallel dedication (proofs/tensor_parallel.md), without ranks:

- claim 1: a Shard's parts are torch.chunk's, they tile the dim in tensor-rank order, and
  concatenating them gives the whole back;
- claim 2: the planner gives every matrix one tensor slot in [0, T) (elementwise parameters
  none: 0), spread within each owner slot by the LPT bound, independent of input order; the
  digest covers the layout and is unchanged without tensor parallelism;
- claim 3: Muon on the parts (elementwise momentum per part, Newton-Schulz on the concatenated
  u, each part's slice of O applied with the whole matrix's lr scale) equals Muon on the whole
  matrix, to fp32 rounding.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn.ns._orthogonalize import NSConfig, orthogonalize_with
from dmuon_fn.optim._update import MuonState, muon_apply, muon_momentum, muon_update
from dmuon_fn.planning._partition import partition
from dmuon_fn.tp._layout import TensorLayout, chunk_sizes


@given(st.integers(1, 300), st.integers(1, 16))
def test_parts_are_torch_chunks_and_tile_the_dim(n, parts):
    sizes = chunk_sizes(n, parts)
    chunks = [c.numel() for c in torch.arange(n).chunk(parts)]
    assert list(sizes) == chunks + [0] * (parts - len(chunks))
    assert sum(sizes) == n and len(sizes) == parts
    lay = TensorLayout(None, 0, torch.Size([n, 3]), sizes, 0, None)
    whole = torch.arange(3 * n).view(n, 3)
    pieces = [whole.narrow(0, lay.offset(t), sizes[t]) for t in range(parts)]
    assert all(p.shape == lay.part_shape(t) for t, p in enumerate(pieces))
    assert torch.equal(torch.cat(pieces), whole)


_shapes = st.lists(
    st.tuples(st.integers(1, 96), st.integers(1, 96), st.sampled_from(["Shard(0)", "plain"])),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(_shapes, st.integers(1, 4), st.integers(1, 4), st.randoms(use_true_random=False))
def test_every_matrix_gets_one_tensor_slot_spread_by_lpt(items, data, tensor, rnd):
    shapes = {f"layers.{i}.w": (m, n) for i, (m, n, _) in enumerate(items)}
    shapes["norm"] = (8,)
    layouts = {f"layers.{i}.w": lay for i, (_, _, lay) in enumerate(items)} | {"norm": "plain"}
    plan = partition(shapes, data, tensor_size=tensor, layouts=layouts, elementwise=["norm"])
    assert plan.tensor_size == tensor and len(plan.tensor_slots) == len(plan.names)
    assert all(0 <= t < tensor for t in plan.tensor_slots)
    assert plan.tensor_slot("norm") == 0
    for slot in range(data):  # per owner slot: max tensor load <= mean + largest (LPT)
        mine = [i for i, s in enumerate(plan.slots) if s == slot and plan.matrix[i]]
        loads = [0.0] * tensor
        for i in mine:
            loads[plan.tensor_slots[i]] += plan.ns_flops[i]
        if mine:
            top = max(plan.ns_flops[i] for i in mine)
            assert max(loads) <= sum(loads) / tensor + top * (1 + 1e-9)
    order = list(shapes.items())
    rnd.shuffle(order)
    again = partition(dict(order), data, tensor_size=tensor, layouts=layouts, elementwise=["norm"])
    assert again == plan and again.digest() == plan.digest()
    other = dict(layouts, **{"layers.0.w": "Shard(1)"})
    moved = partition(shapes, data, tensor_size=tensor, layouts=other, elementwise=["norm"])
    assert moved.digest() != plan.digest()  # the digest covers the layout
    plain = partition(shapes, data, elementwise=["norm"])
    assert plain.tensor_slots == () and "tensor" not in plain.canonical()
    unnamed = partition(shapes, data, tensor_size=tensor, elementwise=["norm"])
    if tensor > 1:  # no layouts: every parameter plain
        assert unnamed.layouts == ("plain",) * len(shapes) and unnamed.digest()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 40),
    st.integers(2, 40),
    st.integers(0, 1),
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_muon_on_the_parts_equals_muon_on_the_whole(m, n, dim, parts, nesterov, seed):
    g = torch.Generator().manual_seed(seed)
    W, grad, buf = (torch.randn(m, n, generator=g) for _ in range(3))
    ns = NSConfig(method="standard", dtype=torch.float32)
    kw = dict(lr=0.02, weight_decay=0.1)
    whole, whole_state = muon_update(
        W, grad, MuonState(buf), momentum=0.9, nesterov=nesterov, ns=ns, **kw
    )
    sizes = chunk_sizes(W.shape[dim], parts)
    offsets = [sum(sizes[:t]) for t in range(parts)]

    def part(x, t):
        return x.narrow(dim, offsets[t], sizes[t])

    us, states = zip(
        *(
            muon_momentum(part(grad, t), MuonState(part(buf, t)), momentum=0.9, nesterov=nesterov)
            for t in range(parts)
        ),
        strict=True,
    )
    u = torch.cat(us, dim=dim)
    O = orthogonalize_with(u, ns, overwrite=True).contiguous()
    new = torch.cat(
        [
            muon_apply(part(W, t), part(O, t).contiguous(), shape=W.shape, **kw)
            for t in range(parts)
        ],
        dim=dim,
    )
    assert torch.equal(torch.cat([s.momentum for s in states], dim=dim), whole_state.momentum)
    rel = ((new - whole).norm() / whole.norm()).item()
    # the same elementwise ops and the same O; only W·decay − step·O is formed in another
    # order where the whole's O is transposed (tall): fp32 rounding, measured <= 6e-8
    assert rel < 1e-6, rel
