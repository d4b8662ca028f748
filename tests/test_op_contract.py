"""The one contract test every registered `torch.ops.dmuon` op goes through.

For each sample of each op: `torch.library.opcheck` (schema, fake, autograd registration,
AOT dispatch), the fake impl under FakeTensorMode against the real output's metadata, and
`torch.compile(fullgraph=True)` against eager values.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

import custom_ops
from custom_ops import _collectives

SPECS = custom_ops.registered_ops()
CASES = [
    pytest.param(spec, i, id=f"{spec.name.split('::')[1]}-{i}")
    for spec in SPECS
    for i, _ in enumerate(spec.samples())
]


def _sample(spec, i):
    return list(spec.samples())[i]


def _flat(out, spec=None):
    """The op's tensor outputs as a list (none for an op that returns nothing); for an op that
    returns a ticket, what redeeming it gives."""
    if out is None:
        return []
    if spec is not None and spec.ticket:
        return _collectives.redeem(out)
    return list(out) if isinstance(out, tuple | list) else [out]


def test_every_op_file_is_registered():
    names = {s.name for s in SPECS}
    expected = {f"dmuon::{n}" for n in ("syrk", "ns_step", "gram_ns_step", "lpt_partition")}
    assert expected <= names


# An op that returns a ticket returns a new one on every call, so opcheck's comparison of eager
# and AOT-traced outputs cannot hold for it; test_compiles_fullgraph compares what the tickets
# redeem for instead.
TICKET_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize(("spec", "i"), CASES)
def test_opcheck(spec, i):
    args, kwargs = _sample(spec, i)
    if spec.ticket:
        torch.library.opcheck(spec.op, args, kwargs, test_utils=TICKET_CHECKS)
    else:
        torch.library.opcheck(spec.op, args, kwargs)


@pytest.mark.parametrize(("spec", "i"), CASES)
def test_fake_matches_real(spec, i):
    args, kwargs = _sample(spec, i)
    real = _flat(spec.op(*args, **kwargs))
    with FakeTensorMode() as mode:
        fargs, fkw = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
        fake = _flat(spec.op(*fargs, **fkw))
    assert len(fake) == len(real)
    for f, r in zip(fake, real, strict=True):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


@pytest.mark.parametrize(("spec", "i"), CASES)
def test_compiles_fullgraph(spec, i):
    args, kwargs = _sample(spec, i)
    torch._dynamo.reset()
    eager = _flat(spec.op(*args, **kwargs), spec)
    compiled = _flat(torch.compile(spec.op, fullgraph=True)(*args, **kwargs), spec)
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
