"""Block specs (proofs/blocks.md): each block of a fused or batched parameter orthogonalized on
its own equals the blocks sliced out by hand and orthogonalized one at a time; one-block specs
are bitwise today's flattened matrix; the string form round-trips; to_blocks / from_blocks are
exact inverses, also under torch.compile(fullgraph=True)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from dmuon_fn.ns._blocks import (
    Blocks,
    block_shapes,
    check,
    default_blocks,
    from_blocks,
    orthogonalize_blocks,
    to_blocks,
)
from dmuon_fn.ns._orthogonalize import NSConfig, orthogonalize_with
from tests._tolerance import PRODUCT, rel_err

CFG64 = NSConfig(dtype=torch.float64)
CFG32 = NSConfig(dtype=torch.float32)
# batched and one-at-a-time fp32 NS differ only in the GEMMs' and reductions' summation order
FP32_SAME_MATH = 1e-6
# a wrong split moves the polar factor at order one (measured 0.3-0.8 on CASES)
WRONG_SPLIT = 0.1
ALL = slice(None)

# (spec, shape, the blocks as index tuples sliced by hand, a wrong spec for the same shape)
CASES = {
    "experts": ("batch1", (4, 24, 40), [(e,) for e in range(4)], "flatten"),
    "qkv_gqa": (
        "rows=64+16+16",
        (96, 48),
        [(slice(0, 64),), (slice(64, 80),), (slice(80, 96),)],
        "matrix",
    ),
    "unequal_apart": (
        "rows=16+32+16",
        (64, 40),
        [(slice(0, 16),), (slice(16, 48),), (slice(48, 64),)],
        "rows/4",
    ),
    "experts_gate_up": (
        "batch1,rows=24+24",
        (3, 48, 32),
        [(e, slice(a, a + 24)) for e in range(3) for a in (0, 24)],
        "batch1",
    ),
    "experts_interleaved": (
        "batch1,cols%2",
        (3, 24, 48),
        [(e, ALL, slice(j, None, 2)) for e in range(3) for j in (0, 1)],
        "batch1,cols/2",
    ),
    "heads_rows": ("rows/4", (64, 32), [(slice(16 * h, 16 * h + 16),) for h in range(4)], "matrix"),
    "heads_cols": (
        "cols/4",
        (32, 64),
        [(ALL, slice(16 * h, 16 * h + 16)) for h in range(4)],
        "matrix",
    ),
    "two_batch_dims_cols": (
        "batch2,cols=8+24+8",
        (2, 2, 20, 40),
        [
            (a, b, ALL, slice(s, s + w))
            for a in range(2)
            for b in range(2)
            for s, w in ((0, 8), (8, 24), (32, 8))
        ],
        "batch2",
    ),
}


def _g(shape, dtype=torch.float64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _by_hand(G, pieces, cfg, scale=None):
    """Each piece of G sliced out, orthogonalized alone (times scale(m, n)), put back."""
    out = torch.zeros_like(G)
    for idx in pieces:
        O = orthogonalize_with(G[idx], cfg)
        out[idx] = O if scale is None else O * scale(*O.shape)
    return out


@pytest.mark.parametrize("case", CASES)
def test_each_block_is_orthogonalized_on_its_own(case):
    spec, shape, pieces, wrong = CASES[case]
    G = _g(shape)
    ref = _by_hand(G, pieces, CFG64)
    assert rel_err(orthogonalize_blocks(G, Blocks.parse(spec), CFG64), ref) < PRODUCT[torch.float64]
    assert rel_err(orthogonalize_blocks(G, Blocks.parse(wrong), CFG64), ref) > WRONG_SPLIT
    G32 = G.float()
    got = orthogonalize_blocks(G32, Blocks.parse(spec), CFG32)
    assert got.dtype == torch.float32
    assert rel_err(got, _by_hand(G32, pieces, CFG32)) < FP32_SAME_MATH


def _match_rms(m, n):
    return 0.2 * math.sqrt(max(m, n))


@pytest.mark.parametrize("case", ["qkv_gqa", "experts_interleaved", "heads_cols"])
def test_scale_uses_each_blocks_shape(case):
    spec, shape, pieces, _wrong = CASES[case]
    G = _g(shape, seed=1)
    got = orthogonalize_blocks(G, Blocks.parse(spec), CFG64, scale=_match_rms)
    assert rel_err(got, _by_hand(G, pieces, CFG64, _match_rms)) < PRODUCT[torch.float64]
    whole = _match_rms(*shape[-2:])  # the unsplit matrix's scale on every block
    assert rel_err(got, _by_hand(G, pieces, CFG64, lambda m, n: whole)) > WRONG_SPLIT


@pytest.mark.parametrize(
    "shape", [(32, 16, 3, 3), (64, 2, 2, 2), (48, 80), (80, 48), (16, 4, 5)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_block_is_bitwise_todays_flattened_matrix(shape, dtype):
    G = _g(shape, dtype, seed=2)
    today = orthogonalize_with(G.reshape(shape[0], -1), NSConfig()).reshape(shape)
    assert torch.equal(orthogonalize_blocks(G, Blocks(flatten=True), NSConfig()), today)
    if len(shape) == 2:
        spec = default_blocks(shape, conv=False)
        assert str(spec) == "matrix"
        assert torch.equal(orthogonalize_blocks(G, spec, NSConfig()), today)


def test_defaults():
    assert str(default_blocks((64, 3, 5, 5), conv=True)) == "flatten"
    assert str(default_blocks((64, 32), conv=False)) == "matrix"
    assert str(default_blocks((128, 1536, 2048), conv=False)) == "batch1"
    assert str(default_blocks((2, 8, 16, 32), conv=False)) == "batch2"


# Shapes of Qwen3-30B-A3B's and gpt-oss-20b's published weights, and their blocks.
REAL = [
    ("batch1,rows=768+768", (128, 1536, 2048), [(256, (768, 2048))]),  # Qwen3 gate_up_proj
    ("batch1", (128, 2048, 768), [(128, (2048, 768))]),  # Qwen3 down_proj
    ("rows/32", (4096, 2048), [(32, (128, 2048))]),  # Qwen3 q_proj per head (head_dim 128)
    ("cols/32", (2048, 4096), [(32, (2048, 128))]),  # Qwen3 o_proj per head
    ("batch1,cols%2", (32, 2880, 5760), [(64, (2880, 2880))]),  # gpt-oss gate_up_proj
    ("rows=4096+512+512", (5120, 2880), [(1, (4096, 2880)), (2, (512, 2880))]),  # gpt-oss qkv
]


@pytest.mark.parametrize(("spec", "shape", "shapes"), REAL, ids=[r[0] for r in REAL])
def test_block_shapes_of_real_parameters(spec, shape, shapes):
    assert block_shapes(check(spec, shape, "w"), shape) == shapes


def test_gpt_oss_interleave_takes_gate_and_up_apart():
    x = torch.arange(2 * 3 * 8).reshape(2, 3, 8)  # 2 experts, columns g0 u0 g1 u1 ...
    (parts,) = to_blocks(x, Blocks.parse("batch1,cols%2"))
    want = [x[0][:, 0::2], x[0][:, 1::2], x[1][:, 0::2], x[1][:, 1::2]]
    assert torch.equal(parts, torch.stack(want))


def test_views_where_strides_allow_and_an_empty_batch():
    x = _g((3, 64, 40), torch.float32)
    for spec in ("batch1", "batch1,rows=32+32", "batch1,rows/4", "batch1,rows=16+48"):
        for p in to_blocks(x, Blocks.parse(spec)):
            assert p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), spec
    (p,) = to_blocks(x[0], Blocks.parse("cols/4"))  # one matrix: any split is a view
    assert p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    empty = torch.zeros(0, 8, 6)
    spec = Blocks.parse("batch1,cols%2")
    assert block_shapes(spec, empty.shape) == [(0, (8, 3))]
    assert torch.equal(from_blocks(to_blocks(empty, spec), spec, empty.shape), empty)
    assert orthogonalize_blocks(empty, spec, CFG32).shape == empty.shape


# Bad specs: (spec, shape, what the message must say besides the parameter's name).
BAD = [
    ("rows=64+16", (96, 32), "sum to 96"),
    ("rows/5", (96, 32), "'rows/4'"),
    ("cols%7", (8, 96), "'cols%6'"),
    ("batch2", (4, 5, 6), "'batch1'"),
    ("matrix", (4, 5, 6), "'flatten'"),
    ("rows/2", (4, 5, 6), "'batch1,rows/2'"),
    ("batch1,rows/2", (3, 1, 4), "'batch1'"),
    ("matrix", (7,), "1-D"),
    ("flatten", (7,), "1-D"),
    ("flatten,rows/2", (8, 8), "not one of"),
    ("batch1,flatten", (2, 8, 8), "not one of"),
    ("rows/1", (8, 8), "'matrix'"),
    ("rows=8", (8, 8), "not one of"),
    ("rows = 4+4", (8, 8), "not one of"),
]


@pytest.mark.parametrize(("spec", "shape", "says"), BAD)
def test_check_names_the_parameter_and_the_fix(spec, shape, says):
    with pytest.raises(ValueError) as e:
        check(spec, shape, "layers.3.mlp.w")
    assert "layers.3.mlp.w" in str(e.value) and says in str(e.value)


def test_constructor_rejects_what_no_shape_can_fix():
    for kw in (
        dict(flatten=True, axis="rows", heads=2),
        dict(flatten=True, batch=1),
        dict(axis="rows"),
        dict(heads=2),
        dict(axis="rows", heads=2, stride=2),
        dict(axis="diag", heads=2),
        dict(batch=-1),
        dict(axis="cols", sizes=(4, 0)),
        dict(axis="cols", stride=1),
        dict(batch=True),
    ):
        with pytest.raises(ValueError):
            Blocks(**kw)


# ---- properties ----------------------------------------------------------------------------

PROPS = settings(max_examples=150, deadline=None)


@st.composite
def specs_and_shapes(draw):
    """A valid (spec, shape): batch dims, a matrix, and a split that fits it."""
    if draw(st.booleans()) and draw(st.booleans()):
        dims = draw(st.lists(st.integers(1, 5), min_size=2, max_size=4))
        return Blocks(flatten=True), tuple(dims)
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    m, n = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    axis = draw(st.sampled_from([None, "rows", "cols"]))
    L = m if axis == "rows" else n
    kind = draw(st.sampled_from(["sizes", "heads", "stride"])) if axis and L >= 2 else None
    split = {}
    if kind == "sizes":
        cuts = draw(st.sets(st.integers(1, L - 1), min_size=1, max_size=4))
        bounds = [0, *sorted(cuts), L]
        split = dict(sizes=tuple(b - a for a, b in itertools.pairwise(bounds)))
    elif kind:
        split = {kind: draw(st.sampled_from([d for d in range(2, L + 1) if L % d == 0]))}
    return Blocks(batch=len(lead), axis=axis if kind else None, **split), (*lead, m, n)


@PROPS
@given(specs_and_shapes())
def test_string_form_round_trips(spec_shape):
    spec, _shape = spec_shape
    text = str(spec)
    assert Blocks.parse(text) == spec and str(Blocks.parse(text)) == text


@PROPS
@given(st.text(alphabet="batchrowsclfenmix0123456789=+/%, ", max_size=18))
def test_parse_accepts_only_the_canonical_form(text):
    try:
        spec = Blocks.parse(text)
    except ValueError:
        return
    assert str(spec) == text


def _by_hand_blocks(x, spec):
    """x's blocks sliced by hand and stacked per distinct shape, batch outer, axis order inner."""
    mats = [x.reshape(x.shape[0], -1)] if spec.flatten else list(x.reshape(-1, *x.shape[-2:]))
    L = mats[0].shape[0 if spec.axis != "cols" else 1]
    if spec.stride:
        idx = [slice(j, None, spec.stride) for j in range(spec.stride)]
    else:
        sizes = spec.sizes or ([L // spec.heads] * spec.heads if spec.heads else [L])
        idx = [slice(sum(sizes[:j]), sum(sizes[: j + 1])) for j in range(len(sizes))]
    cut = [[mat[:, i] if spec.axis == "cols" else mat[i] for i in idx] for mat in mats]
    groups: dict[tuple, list[int]] = {}
    for j, block in enumerate(cut[0]):
        groups.setdefault(tuple(block.shape), []).append(j)
    return [torch.stack([blocks[j] for blocks in cut for j in js]) for js in groups.values()]


@PROPS
@given(
    specs_and_shapes(),
    st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.int64]),
    st.booleans(),
)
def test_to_blocks_and_from_blocks_are_exact_inverses(spec_shape, dtype, transposed):
    spec, shape = spec_shape
    x = torch.randn(shape, dtype=torch.float64).to(dtype) if dtype.is_floating_point else None
    x = torch.randperm(math.prod(shape)).reshape(shape) if x is None else x
    if transposed:  # a non-contiguous input: the same values, other strides
        x = x.mT.contiguous().mT
    parts = to_blocks(x, spec)
    shapes = block_shapes(spec, shape)
    assert [(p.shape[0], tuple(p.shape[1:])) for p in parts] == shapes
    n_blocks = len(spec.sizes) or spec.heads or spec.stride or 1
    lead = 1 if spec.flatten else math.prod(shape[:-2])
    assert sum(c for c, _ in shapes) == lead * n_blocks
    assert sum(c * m * n for c, (m, n) in shapes) == x.numel()
    for got, want in zip(parts, _by_hand_blocks(x, spec), strict=True):
        assert torch.equal(got, want)
    back = from_blocks(parts, spec, shape)
    assert back.dtype == x.dtype and torch.equal(back, x)


@PROPS
@given(
    st.sampled_from(["matrix", "flatten", "batch1", "batch2", "rows/2", "cols%3", "rows=2+4"]),
    st.sampled_from([(), ("batch1",)]),
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.sampled_from(["wte", "layers.7.attn.qkv"]),
)
def test_check_accepts_a_fitting_spec_or_names_the_parameter(base, prefix, shape, name):
    text = ",".join([*prefix, base])
    try:
        spec = check(text, shape, name)
    except ValueError as e:
        assert name in str(e)
        return
    x = torch.randn(shape)
    assert torch.equal(from_blocks(to_blocks(x, spec), spec, shape), x)


# ---- torch.compile ---------------------------------------------------------------------------


def _compiled(fn):
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


@pytest.mark.parametrize("case", ["unequal_apart", "experts_interleaved", "heads_cols"])
def test_blocks_trace_whole(case):
    spec, shape, _pieces, _wrong = CASES[case]
    spec = Blocks.parse(spec)
    x = _g(shape, torch.float32, seed=3)

    def round_trip(x):
        return from_blocks([2 * p for p in to_blocks(x, spec)], spec, x.shape)

    f, cnt = _compiled(round_trip)
    assert torch.equal(f(x), 2 * x)
    assert cnt.frame_count == 1 and not counters["graph_break"]
    g, cnt = _compiled(orthogonalize_blocks)
    got = g(x, spec, CFG32, scale=_match_rms)
    assert cnt.frame_count == 1 and not counters["graph_break"]
    assert rel_err(got, orthogonalize_blocks(x, spec, CFG32, scale=_match_rms)) < FP32_SAME_MATH


@pytest.mark.slow
def test_blocks_compile_with_inductor():
    spec, shape, pieces, _wrong = CASES["experts_interleaved"]
    G = _g(shape, torch.float32, seed=4)
    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(orthogonalize_blocks, fullgraph=True)(G, Blocks.parse(spec), CFG32)
    assert not counters["graph_break"]
    assert rel_err(got, _by_hand(G, pieces, CFG32)) < 1e-5  # inductor fuses the normalization
