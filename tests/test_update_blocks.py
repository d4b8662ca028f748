"""Muon on parameters made of several matrices (`muon_update(..., blocks=)`) against Muon run on
each piece separately: experts, fused qkv with GQA sizes, gpt-oss's interleaved gate_up, heads
along rows and columns. The pieces are sliced by hand here, not by dmuon_fn.ns._blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn import MuonState, NSConfig, muon_update

HYPER = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True}


def _rows(sizes):
    out, at = [], 0
    for s in sizes:
        out.append((slice(at, at + s), slice(None)))
        at += s
    return out


# (shape, spec, index of each piece: a tuple of slices into the parameter)
CASES = [
    ((3, 12, 20), "batch1", [(e,) for e in range(3)]),
    ((24, 16), "rows=16+4+4", _rows((16, 4, 4))),
    (
        (2, 10, 12),
        "batch1,cols%2",
        [(e, slice(None), slice(j, None, 2)) for e in range(2) for j in (0, 1)],
    ),
    ((2, 16, 12), "batch1,rows=8+8", [(e, *r) for e in range(2) for r in _rows((8, 8))]),
    ((16, 20), "rows/4", _rows((4,) * 4)),
    ((12, 16), "cols/4", [(slice(None), slice(4 * h, 4 * h + 4)) for h in range(4)]),
]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def _piecewise(p, grad, buf, index, ns):
    """Muon on each piece alone (its own momentum, shape and lr scale), put back in place."""
    new_p, new_buf = p.clone(), buf.clone()
    for ix in index:
        np_, st_ = muon_update(
            p[ix].clone(), grad[ix].clone(), MuonState(buf[ix].clone()), **HYPER, ns=ns
        )
        new_p[ix], new_buf[ix] = np_, st_.momentum
    return new_p, new_buf


@pytest.mark.parametrize(("shape", "spec", "index"), CASES, ids=[c[1] for c in CASES])
def test_blocks_equal_separate_muons_in_float64(shape, spec, index):
    p, grad, buf = _inputs(shape, torch.float64)
    ns = NSConfig()
    want_p, want_buf = _piecewise(p, grad, buf, index, ns)
    got_p, got_state = muon_update(p, grad, MuonState(buf), **HYPER, ns=ns, blocks=spec)
    torch.testing.assert_close(got_p, want_p, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state.momentum, want_buf, rtol=0, atol=0)
    # the whole tensor as one matrix is a different update, by far
    whole, _ = muon_update(p, grad, MuonState(buf), **HYPER, ns=ns)
    assert (whole - want_p).abs().max() > 1e-3


@pytest.mark.parametrize(("shape", "spec", "index"), CASES, ids=[c[1] for c in CASES])
def test_blocks_in_fp32_within_1e6_of_separate_fp32_muons(shape, spec, index):
    p, grad, buf = _inputs(shape, torch.float32, seed=1)
    ns = NSConfig(dtype=torch.float32)
    want_p, _ = _piecewise(p, grad, buf, index, ns)
    got_p, _ = muon_update(p, grad, MuonState(buf), **HYPER, ns=ns, blocks=spec)
    rel = (got_p - want_p).norm() / want_p.norm()
    assert rel <= 1e-6, rel


@pytest.mark.parametrize("shape", [(8, 3, 3, 3), (6, 4, 5), (16, 12), (12, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flatten_and_matrix_are_bitwise_todays_update(shape, dtype):
    p, grad, buf = _inputs(shape, dtype, seed=2)
    today, s0 = muon_update(p, grad, MuonState(buf), **HYPER)
    spec = "matrix" if len(shape) == 2 else "flatten"
    got, s1 = muon_update(p, grad, MuonState(buf), **HYPER, blocks=spec)
    assert torch.equal(got, today) and torch.equal(s1.momentum, s0.momentum)


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 3),
    heads=st.integers(2, 4),
    d=st.integers(2, 5),
    cols=st.integers(2, 9),
    by_rows=st.booleans(),
)
def test_heads_property_equal_separate_muons(experts, heads, d, cols, by_rows):
    """`batch1,rows/H` (or cols/H) on (E, H·d, c) equals E·H separate Muons, float64."""
    shape = (experts, heads * d, cols) if by_rows else (experts, cols, heads * d)
    spec = f"batch1,{'rows' if by_rows else 'cols'}/{heads}"
    cut = [slice(h * d, (h + 1) * d) for h in range(heads)]
    index = [
        (e, c, slice(None)) if by_rows else (e, slice(None), c) for e in range(experts) for c in cut
    ]
    p, grad, buf = _inputs(shape, torch.float64, seed=experts * 100 + heads * 10 + d)
    want_p, want_buf = _piecewise(p, grad, buf, index, NSConfig())
    got_p, got_state = muon_update(p, grad, MuonState(buf), **HYPER, blocks=spec)
    torch.testing.assert_close(got_p, want_p, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_state.momentum, want_buf)


def test_a_bad_spec_names_the_parameter():
    p, grad, buf = _inputs((24, 16), torch.float32)
    with pytest.raises(ValueError, match=r"the parameter.*rows=16\+4\+5"):
        muon_update(p, grad, MuonState(buf), **HYPER, blocks="rows=16+4+5")
