"""Resident bytes in the plan (dmuon_fn/planning/_memory.py; proofs/partition.md §11): what each
rank holds, the byte balance that never lengthens the busiest Newton-Schulz load, the cap."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import hypothesis.strategies as hs
import pytest
from hypothesis import given, settings

import dmuon_fn
from dmuon_fn.planning._memory import rebalance, resident

SHAPES = Path(__file__).resolve().parents[2] / "shared" / "data" / "model_shapes"


@settings(max_examples=60, deadline=None)
@given(
    data=hs.data(),
    world=hs.integers(2, 12),
    n=hs.integers(1, 40),
)
def test_rebalance_keeps_the_load_bound_columns_and_lowers_no_peak(data, world, n):
    columns = data.draw(hs.sampled_from([c for c in range(1, world + 1) if world % c == 0]))
    ns = data.draw(hs.lists(hs.floats(0, 100), min_size=n, max_size=n))
    nbytes = data.draw(hs.lists(hs.integers(0, 1000), min_size=n, max_size=n))
    # pieces of parameters "p0".."p2": at most `columns` each, on distinct columns
    parents, slots, used = [], [], {}
    for _ in range(n):
        p = data.draw(hs.sampled_from([None, "p0", "p1", "p2"]))
        free = [s for s in range(world) if p is None or s % columns not in used.get(p, set())]
        if not free:
            p, free = None, list(range(world))
        s = data.draw(hs.sampled_from(free))
        used.setdefault(p, set()).add(s % columns)
        parents.append(p)
        slots.append(s)
    costs = data.draw(hs.lists(hs.floats(0, 100), min_size=n, max_size=n))
    out = rebalance(slots, ns, costs, nbytes, world, parents, columns)

    def per_slot(values, where):
        acc = [0.0] * world
        for v, s in zip(values, where, strict=True):
            acc[s] += v
        return acc

    assert sorted(range(n)) == sorted(range(len(out))) and all(0 <= s < world for s in out)
    assert max(per_slot(ns, out)) <= max(per_slot(ns, slots)) * (1 + 1e-9) + 1e-9
    assert max(per_slot(costs, out)) <= max(per_slot(costs, slots)) * (1 + 1e-9) + 1e-9
    assert max(per_slot(nbytes, out)) <= max(per_slot(nbytes, slots))
    for p in ("p0", "p1", "p2"):
        cols = [s % columns for s, q in zip(out, parents, strict=True) if q == p]
        assert len(cols) == len(set(cols)), (p, cols)


def test_resident_counts_masters_states_and_hsdp_copies():
    shapes = {"l.0.w": (8, 4), "l.0.b": (8,), "l.1.w": (4, 8)}
    plan = dmuon_fn.partition(shapes, 4, replicate_size=2, elementwise=["l.0.b"])
    got = resident(plan)
    want = {k: [0] * 4 for k in ("masters", "states", "copies")}
    for n, s in zip(plan.names, plan.slots, strict=True):
        numel, matrix = math.prod(plan.shape(n)), n != "l.0.b"
        want["masters"][s] += 4 * numel
        want["states"][s] += (4 if matrix else 8) * numel
        want["copies"][(s + 2) % 4] += 4 * numel  # the other replica's same shard column
    assert (list(got.masters), list(got.states), list(got.copies)) == (
        want["masters"],
        want["states"],
        want["copies"],
    )
    summary = dmuon_fn.plan_summary(plan)
    assert [r.resident for r in summary.slots] == list(got.total)
    assert summary.as_dict()["resident_imbalance"] == pytest.approx(got.imbalance)
    assert re.search(r"resident per rank: up to .*\n  of it masters .*, copies ", str(summary))


def _llama_like(layers: int = 6) -> dict[str, tuple[int, ...]]:
    out = {"embed.weight": (512, 64)}
    for i in range(layers):
        out |= {f"layers.{i}.q.weight": (64, 64), f"layers.{i}.up.weight": (256, 64)}
        out |= {f"layers.{i}.norm.weight": (64,)}
    return out


def test_a_cap_is_honoured_or_refused_with_the_smallest_world_that_fits():
    shapes = _llama_like()
    ew = [n for n, s in shapes.items() if len(s) < 2]
    plan = dmuon_fn.partition(shapes, 8, elementwise=ew)
    need = max(resident(plan).total)
    same = dmuon_fn.partition(shapes, 8, elementwise=ew, max_bytes_per_rank=need)
    assert same.digest() == plan.digest()
    cap = need * 9 // 10
    with pytest.raises(ValueError, match=r"smallest world size that fits is (\d+) ranks") as err:
        dmuon_fn.partition(shapes, 8, elementwise=ew, max_bytes_per_rank=cap)
    w = int(re.search(r"fits is (\d+) ranks", str(err.value)).group(1))
    assert w > 8
    assert max(resident(dmuon_fn.partition(shapes, w, elementwise=ew)).total) <= cap
    assert max(resident(dmuon_fn.partition(shapes, w - 1, elementwise=ew)).total) > cap
    with pytest.raises(ValueError, match="no world size up to"):
        dmuon_fn.partition(shapes, 8, elementwise=ew, max_bytes_per_rank=1000)
    with pytest.raises(ValueError, match="max_bytes_per_rank must be an int >= 1"):
        dmuon_fn.partition(shapes, 8, elementwise=ew, max_bytes_per_rank=0)


def _rows(path: Path, world: int, balance: bool):
    named = {n: tuple(s) for n, s in json.loads(path.read_text())["params"]}
    ew = [n for n, s in named.items() if len(s) < 2]
    plan = dmuon_fn.partition(named, world, elementwise=ew, balance_bytes=balance)
    return resident(plan).imbalance, dmuon_fn.plan_summary(plan, gemm_flops=4e14).busiest_seconds


@pytest.mark.slow
@pytest.mark.skipif(not SHAPES.is_dir(), reason=f"no shape lists at {SHAPES}")
@pytest.mark.parametrize("world", [64, 256])
def test_the_byte_balance_costs_no_newton_schulz_time_on_real_models(world):
    """Every model, every 2+-D parameter on Muon: the busiest rank's NS seconds within 5% of
    the plan by seconds alone; the MoE models' bytes much more even (examples/benchmarks/
    bench_plan_memory.py prints every row)."""
    for path in sorted(SHAPES.glob("*.json")):
        b0, s0 = _rows(path, world, False)
        b1, s1 = _rows(path, world, True)
        assert s1 <= 1.05 * s0, (path.stem, world, s0, s1)
        if path.stem in ("deepseek-v3", "qwen3-30b-a3b"):
            assert b1 < 0.8 * b0, (path.stem, world, b0, b1)
