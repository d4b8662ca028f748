"""The plan summary (proofs/summary.md): its numbers against the plan it reads and against
Newton-Schulz FLOPs counted by hand, its table, its JSON, its errors."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_fn
from dmuon_fn.dedicated._state import STATE_ATTR, DedicatedState
from dmuon_fn.ns._cost import ns_flops
from dmuon_fn.planning._partition import partition
from dmuon_fn.planning._summary import plan_summary
from dmuon_fn.planning._view import RankView
from tests._plans import owned_by

PROPS = settings(max_examples=100, deadline=None)

# ---------------------------------------------------------------- models and references

# (leaf, dims): matrices of 2 and 4 dims (a conv, flattened), vectors, and an embedding-like
# matrix the tests may mark elementwise
LEAVES = [("attn.q.weight", 2), ("mlp.up.weight", 2), ("mlp.down.weight", 2),
          ("conv.weight", 4), ("ln.weight", 1), ("ln.bias", 1)]  # fmt: skip


@st.composite
def models(draw):
    """{name: shape} of a few blocks (sides up to 160, so some matrices run Gram NS) and maybe
    an embedding; and the names to update elementwise."""
    leaves = draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=4, unique=True))
    side = st.integers(1, 160)
    named = {}
    for i in range(draw(st.integers(1, 4))):
        for leaf, nd in leaves:
            rest = tuple(draw(st.integers(1, 3)) for _ in range(nd - 2))  # a conv's kernel
            named[f"blocks.{i}.{leaf}"] = (*(draw(side) for _ in range(min(nd, 2))), *rest)
    if draw(st.booleans()):
        named["embed.weight"] = (draw(side), draw(side))
    vectors = [n for n, s in named.items() if len(s) < 2]
    extra = draw(st.lists(st.sampled_from(sorted(named)), max_size=3, unique=True))
    return named, sorted(set(vectors) | set(extra))


def reference_ns(
    shape: tuple[int, ...], aspect: float = 1.5, steps: int = 5, sym: float = 0.5
) -> float:
    """The NS FLOPs `orthogonalize` runs for a matrix of `shape` (trailing dims flattened),
    counted by hand from what each step multiplies (2 FLOPs per multiply-add; a product whose
    result is symmetric costs `sym` of its GEMM), with the method `auto` picks: Gram when
    long ≥ aspect·short and short ≥ 32. Short side n, long side m:

    standard, every step: A = X·Xᵀ (sym·2n²m), A·A (sym·2n³), (bA + cA²)·X (2n²m).
    Gram, restarting every second step, so in segments of two steps and, for odd `steps`, a
    last one of one step: each segment R = X·Xᵀ (sym·2n²m) and its closing Q·X (2n²m); each
    step P = aI + bR + cR² (the R² in it: sym·2n³); a segment's second step Q ← P·Q
    (sym·2n³); its first, when a second follows, R ← P·(P·R) (2·sym·2n³). A two-step segment
    is (2·sym + 2)·n²m + 10·sym·n³, a one-step one (2·sym + 2)·n²m + 2·sym·n³.

    Nothing here reads the planner's count (`ns_flops`), so a miscount there fails the tests
    that compare with this."""
    n, m = sorted((shape[0], math.prod(shape[1:])))
    per_segment = (2 * sym + 2) * n * n * m
    if m >= aspect * n and n >= 32:
        pairs, single = divmod(steps, 2)
        return pairs * (per_segment + 10 * sym * n**3) + single * (per_segment + 2 * sym * n**3)
    return steps * ((2 * sym + 2) * n * n * m + 2 * sym * n**3)


def gpt2(layers: int = 12, d: int = 768) -> tuple[dict, list[str]]:
    """GPT-2 small's shapes; embeddings and vectors elementwise."""
    named = {"wte.weight": (50257, d), "wpe.weight": (1024, d)}
    for i in range(layers):
        p = f"h.{i}."
        named.update({
            p + "ln_1.weight": (d,), p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_proj.weight": (d, d), p + "mlp.c_fc.weight": (d, 4 * d),
            p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,),
        })  # fmt: skip
    return named, ["wte.weight", "wpe.weight"] + [n for n, s in named.items() if len(s) < 2]


def table_rows(text: str) -> list[str]:
    """The table's slot rows (after the header line), elision lines left out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    return [line for line in lines[start + 1 :] if "not shown" not in line]


# ---------------------------------------------------------------- the numbers


@PROPS
@given(
    models(), st.integers(1, 9), st.sampled_from([1, 2, 3]), st.sampled_from([1.5, 3.0, math.inf])
)
def test_summary_matches_the_plan(model, shards, reps, aspect):
    named, ew = model
    world = shards * reps
    convs = {n: "flatten" for n, sh in named.items() if len(sh) > 2 and n not in ew}
    kw = {"elementwise": ew, "gram_min_aspect": aspect, "blocks": convs, "slices": False}
    plan = partition(named, world, replicate_size=reps, **kw)  # whole matrices (teams: below)
    s = plan_summary(plan)
    assert (s.world_size, s.replicate_size, len(s.slots)) == (world, reps, world)

    # every matrix listed exactly once, on the slot the plan gives it; the rest counted
    listed = [n for r in s.slots for n in r.matrices]
    assert sorted(listed) == sorted(n for n in named if n not in ew)
    for i, r in enumerate(s.slots):
        assert r.slot == i
        assert all(plan.slot(n) == r.slot for n in r.matrices)
        assert r.others == sum(1 for n in owned_by(plan, r.slot) if n in ew)
        if reps > 1:
            assert r.owner == (r.slot % shards, r.slot // shards)
        else:
            assert r.owner == r.slot

    # bytes: fp32 numel of what the slot owns
    for r in s.slots:
        assert r.nbytes == sum(4 * math.prod(named[n]) for n in owned_by(plan, r.slot))
        assert r.nbytes == plan.slot_bytes[r.slot]
    assert s.total_bytes == sum(4 * math.prod(sh) for sh in named.values())

    # NS FLOPs: the planner's count, per slot and job
    ref = {n: reference_ns(named[n], aspect) for n in listed}
    for r in s.slots:
        assert r.ns_flops == pytest.approx(math.fsum(ref[n] for n in r.matrices), rel=1e-12)
        if r.matrices:
            assert r.largest_ns_flops == max(ref[n] for n in r.matrices) == ref[r.largest]
            assert r.largest_shape == named[r.largest]
        else:
            assert (r.largest, r.largest_shape, r.largest_ns_flops) == (None, None, 0.0)
    assert s.total_ns_flops == pytest.approx(math.fsum(ref.values()), rel=1e-12)

    shares = [r.share for r in s.slots]
    if listed:
        assert math.fsum(shares) == pytest.approx(1.0, abs=1e-9)
        assert s.largest_ns_flops == max(ref.values()) == ref[s.largest]
    else:  # no Newton-Schulz work: nothing to share
        assert shares == [0.0] * world and s.largest is None

    # the busiest slot against the bounds no partition can beat
    loads = [r.ns_flops for r in s.slots]
    assert s.busiest_ns_flops == max(loads) and loads[s.busiest] == max(loads)
    assert s.slots[s.least].ns_flops == min(loads)
    assert s.busiest_ns_flops >= s.bound_ns_flops >= s.largest_ns_flops
    assert s.bound_ns_flops >= s.mean_ns_flops
    assert s.imbalance >= 1.0 - 1e-12 and s.vs_bound >= 1.0 - 1e-12
    assert s.busiest_seconds is None and s.bound_seconds is None and s.imbalance_seconds is None


def test_hand_computed_counts():
    # a, 32×32, standard NS: 5 steps × (X·Xᵀ at half: 32³, the symmetric 32³ product at half:
    # 32³, one full 2·32³) = 5 · 4 · 32³ = 655,360.
    # b, 32×64, Gram NS (64 >= 1.5·32, short side 32), restarts at steps 2 and 4: R = X·Xᵀ
    # (at half: 65,536) and Q·X (131,072) at steps 0, 2, 4; P = aI + bR + cR² (32,768) at every
    # step; Q' = P·Q (32,768) at steps 1 and 3; R' = P·(P·R) (2 · 32,768) at steps 0 and 2:
    # 3 · 196,608 + 5 · 32,768 + 2 · 32,768 + 2 · 65,536 = 950,272 (standard: 1,146,880).
    plan = partition({"a": (32, 32), "b": (32, 64), "n": (8,)}, 2, elementwise=["n"])
    s = plan_summary(plan, gemm_flops=1e9)
    by_name = {n: r for r in s.slots for n in r.matrices}
    assert by_name["a"].largest_ns_flops == 655_360
    assert by_name["b"].largest_ns_flops == 950_272
    assert s.total_ns_flops == 655_360 + 950_272
    assert s.largest == "b" and s.bound_ns_flops == 950_272  # > the mean, 802,816
    assert s.busiest_ns_flops == 950_272 and s.busiest_seconds == 950_272 / 1e9
    assert [r.others for r in s.slots] == [int(plan.slot("n") == 0), int(plan.slot("n") == 1)]


def test_tensor_parallel_plan_counts_each_tensor_rank():
    # one data slot, two tensor ranks: a (655,360 FLOPs) and b (950,272) go to different tensor
    # ranks, so the busiest rank carries b alone, and the mean is over the two ranks
    layouts = {"a": "Shard(0)", "b": "plain", "n": "plain"}
    plan = partition(
        {"a": (32, 32), "b": (32, 64), "n": (8,)}, 1, elementwise=["n"], tensor_size=2,
        layouts=layouts,
    )  # fmt: skip
    assert plan.tensor_slot("a") != plan.tensor_slot("b")
    s = plan_summary(plan)
    (row,) = s.slots
    assert sorted(row.tensor_ns_flops) == [655_360, 950_272] and row.ns_flops == 1_605_632
    assert s.tensor_size == 2 and s.busiest_ns_flops == 950_272
    assert s.mean_ns_flops == 1_605_632 / 2 and s.vs_bound == 1.0
    assert "1 data slot x 2 tensor ranks = 2 ranks" in str(s)
    assert s.as_dict()["tensor_size"] == 2


@PROPS
@given(st.floats(1e3, 1e18), st.integers(1, 64))
def test_seconds_are_flops_over_the_rate(rate, world):
    named, ew = gpt2(layers=2)
    s = plan_summary(partition(named, world, elementwise=ew), gemm_flops=rate)
    assert s.gemm_flops == rate
    assert s.busiest_seconds == s.busiest_ns_flops / rate
    assert s.bound_seconds == s.bound_ns_flops / rate
    assert s.busiest_seconds >= s.bound_seconds
    ratio = s.busiest_seconds / s.mean_seconds if s.mean_seconds else 1.0
    assert s.imbalance_seconds == ratio >= 1.0 - 1e-12


# ---------------------------------------------------------------- data and table


@PROPS
@given(models(), st.integers(1, 6), st.sampled_from([1, 2]), st.none() | st.floats(1.0, 1e16))
def test_as_dict_round_trips_through_json(model, shards, reps, rate):
    named, ew = model
    s = plan_summary(
        partition(named, shards * reps, replicate_size=reps, elementwise=ew), gemm_flops=rate
    )
    d = s.as_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert [r["matrices"] for r in d["slots"]] == [list(r.matrices) for r in s.slots]
    assert d["busiest_ns_flops"] == s.busiest_ns_flops and d["imbalance"] == s.imbalance
    assert d["busiest_seconds"] == s.busiest_seconds
    assert d["matrices"] + d["others"] == len(named) + sum(k - 1 for _, k in d["sliced"])


@pytest.mark.parametrize(("world", "reps"), [(1, 1), (8, 1), (24, 1), (8, 2), (12, 3)])
def test_str_lists_every_rank_of_a_small_job(world, reps):
    named, ew = gpt2(layers=4)
    s = plan_summary(partition(named, world, replicate_size=reps, elementwise=ew), gemm_flops=4e14)
    text = str(s)
    rows = table_rows(text)
    assert [int(r.split()[0]) for r in rows] == list(range(world))
    assert "not shown" not in text
    for r, row in zip(s.slots, rows, strict=True):
        assert row.split()[1 + (reps > 1)] == str(len(r.matrices))
        if reps > 1:
            assert row.split()[1] == f"({r.owner[0]},{r.owner[1]})"
    assert sum(" <- busiest" in row for row in rows) == 1
    assert " <- busiest" in rows[s.busiest]
    assert f"{s.world_size} ranks" in text and "ms per step" in text


@pytest.mark.parametrize(("world", "reps"), [(40, 1), (40, 2), (1024, 1), (1024, 4)])
def test_str_of_a_large_job_stays_short(world, reps):
    named, ew = gpt2()
    plan = partition(named, world, replicate_size=reps, elementwise=ew)
    # the same assignment with slots relabelled, so the busiest (and at 40 ranks the least
    # loaded) land mid-table
    relabel = tuple((509 * s + world // 3) % world for s in plan.slots)
    s = plan_summary(dataclasses.replace(plan, slots=relabel))
    assert 3 <= s.busiest < world - 3 and (world > 40 or 3 <= s.least < world - 3)
    lines = str(s).splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 120
    rows = table_rows(str(s))
    shown = [int(r.split()[0]) for r in rows]
    left_out = sum(int(n) for n in re.findall(r"\.\.\. (\d+) ranks not shown", str(s)))
    assert len(shown) + left_out == world and shown == sorted(set(shown))
    assert {0, 1, 2, world - 3, world - 2, world - 1, s.busiest, s.least} <= set(shown)
    assert " <- busiest" in rows[shown.index(s.busiest)]
    assert " <- least" in rows[shown.index(s.least)]


def test_str_of_a_plan_without_matrices():
    s = plan_summary(partition({"a": (3,), "b.weight": (4, 4)}, 3, elementwise=["a", "b.weight"]))
    assert s.total_ns_flops == 0 and s.imbalance == 1.0 and s.vs_bound == 1.0
    assert "none (no matrix in the plan)" in str(s) and "busiest" not in str(s)


# ---------------------------------------------------------------- what it reads, and errors


def test_accepts_an_fn_plan_and_a_dedicated_model():
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 16))
    fn_plan = dmuon_fn.plan(model)  # one process, no process group
    assert plan_summary(fn_plan) == plan_summary(fn_plan.partition) == fn_plan.summary()
    assert str(fn_plan) == str(plan_summary(fn_plan))
    assert fn_plan.summary(gemm_flops=1e9).busiest_seconds == (
        plan_summary(fn_plan).busiest_ns_flops / 1e9
    )
    part = partition({"0.weight": (48, 16), "2.weight": (16, 48)}, 2)
    # what dedicate_params attaches (its plan is all plan_summary reads)
    state = DedicatedState(
        view=RankView(part), shard_group=None, replicate_group=None, reshard_after_forward=True
    )
    setattr(model, STATE_ATTR, state)
    assert dmuon_fn.plan_summary(model) == plan_summary(part)


def test_bad_input_is_refused():
    plan = partition(gpt2(layers=1)[0], 2)
    for bad in (0, -1.0, math.nan, math.inf, True, "4e14", [1e9]):
        with pytest.raises(ValueError, match="gemm_flops"):
            plan_summary(plan, gemm_flops=bad)
    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon_fn.plan_summary(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Plan"):
        plan_summary({"w": (4, 4)})


@pytest.mark.parametrize("options", [{"steps": 3}, {"sym_discount": 1.0}, {"flops_per_byte": 0.0}])
def test_plan_made_with_other_cost_options(options):
    """The summary reads the NS FLOPs the planner counted under its own options."""
    named, ew = gpt2(layers=1)
    plan = partition(named, 4, elementwise=ew, **options)
    ref = {
        n: reference_ns(
            named[n], steps=options.get("steps", 5), sym=options.get("sym_discount", 0.5)
        )
        for n in named
        if n not in ew
    }
    assert plan_summary(plan).total_ns_flops == pytest.approx(math.fsum(ref.values()), rel=1e-12)


# (shape, method, steps, sym_discount, FLOPs), n the short side and m the long one:
# standard, 5 steps at sym 0.5: 5·(n²m + n³ + 2n²m) = 15n²m + 5n³;
# Gram, 5 steps at sym 0.5, restarts (2, 4): two 2-step segments, 3n²m + 5n³ each, and a
# 1-step one, 3n²m + n³: 9n²m + 11n³. Gram needs m ≥ 1.5·n and n ≥ 32 under "auto".
HAND_COUNTS = [
    # 15·32³ + 5·32³ = 20·32,768
    ((32, 32), "auto", 5, 0.5, 655_360),
    # 20·768³ = 20·452,984,832
    ((768, 768), "auto", 5, 0.5, 9_059_696_640),
    # short side 16 < 32: standard although 100 ≥ 1.5·16; 15·256·100 + 5·4,096
    ((16, 100), "auto", 5, 0.5, 404_480),
    # tall: n = 40, m = 100, Gram; 9·1,600·100 + 11·64,000 = 1,440,000 + 704,000
    ((100, 40), "auto", 5, 0.5, 2_144_000),
    # the same forced standard: 15·160,000 + 5·64,000 = 2,400,000 + 320,000
    ((100, 40), "standard", 5, 0.5, 2_720_000),
    # 9·1,024·64 + 11·32,768 = 589,824 + 360,448
    ((32, 64), "auto", 5, 0.5, 950_272),
    # 15·65,536 + 5·32,768 = 983,040 + 163,840
    ((32, 64), "standard", 5, 0.5, 1_146_880),
    # GPT-2's c_fc, n²m = 589,824·3,072 = 1,811,939,328, n³ = 452,984,832:
    # 9·n²m + 11·n³ = 16,307,453,952 + 4,982,833,152
    ((768, 3072), "auto", 5, 0.5, 21_290_287_104),
    # 15·n²m + 5·n³ = 27,179,089,920 + 2,264,924,160
    ((768, 3072), "standard", 5, 0.5, 29_444_014_080),
    # a batch of three 32×32: 3·655,360
    ((3, 32, 32), "auto", 5, 0.5, 1_966_080),
    # a batch of two 32×64 (Gram): 2·950,272
    ((2, 32, 64), "auto", 5, 0.5, 1_900_544),
    # 3 steps, restart (2,): a 2-step and a 1-step segment, 6n²m + 6n³ = 6·65,536 + 6·32,768
    ((32, 64), "gram", 3, 0.5, 589_824),
    # 3 steps standard: 9n²m + 3n³ = 589,824 + 98,304
    ((32, 64), "standard", 3, 0.5, 688_128),
    # no symmetric discount, Gram: 3·4n²m + 2·10n³ + 2n³ = 12n²m + 22n³ = 786,432 + 720,896
    ((32, 64), "gram", 5, 1.0, 1_507_328),
    # no symmetric discount, standard: 5·(2n²m + 2n³ + 2n²m) = 20n²m + 10n³
    ((32, 64), "standard", 5, 1.0, 1_638_400),
]


@pytest.mark.parametrize(("shape", "method", "steps", "sym", "flops"), HAND_COUNTS)
def test_ns_flops_against_hand_counts(shape, method, steps, sym, flops):
    """The planner's count (`ns_flops`, which `partition` stores and the summary reports)
    against the products each iteration multiplies, counted by hand."""
    assert ns_flops(shape, steps=steps, method=method, sym_discount=sym) == flops
    if method == "auto" and len(shape) == 2:
        assert reference_ns(shape, steps=steps, sym=sym) == flops
        plan = partition({"w": shape}, 1)
        assert plan_summary(plan).total_ns_flops == flops


def test_measure_gemm_flops():
    rate = dmuon_fn.measure_gemm_flops("cpu", torch.float32, n=256)
    assert 1e6 < rate < 1e15  # a CPU: more than a MFLOP/s, less than a PFLOP/s
    for kw, what in (
        ({"n": 0}, "n must"),
        ({"n": 2.5}, "n must"),
        ({"dtype": torch.int32}, "dtype"),
    ):
        with pytest.raises(ValueError, match=what):
            dmuon_fn.measure_gemm_flops("cpu", **{"dtype": torch.float32, **kw})
    with pytest.raises(ValueError, match="gemm_flops figure"):
        dmuon_fn.measure_gemm_flops("meta")
