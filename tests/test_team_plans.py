"""The planner's teams on real models' shapes (`../shared/data/model_shapes/`, proofs/partition.md
§10): no matrix costing no more than a fair share gets a team; a team's members sit on distinct
shard columns of one replica; the plan with teams is lighter than without; the summary reports
the teams, their FLOPs and their collectives; the digest covers them; bad `teams=` raise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dmuon_fn import partition, plan_summary
from dmuon_fn.planning._gathered import LOAD_SLACK
from dmuon_fn.planning._slices import parse_piece
from tests.test_partition import llama

SHAPES = Path(__file__).resolve().parents[2] / "shared" / "data" / "model_shapes"
MODELS = sorted(p.stem for p in SHAPES.glob("*.json")) if SHAPES.is_dir() else []
needs_shapes = pytest.mark.skipif(not MODELS, reason="no model shape files next to the project")


def _named(model: str, all_matrices: bool):
    spec = json.loads((SHAPES / f"{model}.json").read_text())
    named = {n: tuple(s) for n, s in spec["params"]}
    block = lambda n: any(part.isdigit() for part in n.split("."))  # noqa: E731
    ew = [n for n, s in named.items() if len(s) < 2 or not (all_matrices or block(n))]
    return named, ew


@needs_shapes
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("world", "reps"), [(1024, 1), (1024, 4), (64, 1)])
def test_teams_only_past_a_share_in_one_replica_and_lighter(model, world, reps):
    named, ew = _named(model, all_matrices=True)
    plan = partition(named, world, replicate_size=reps, elementwise=ew)
    whole = partition(named, world, replicate_size=reps, elementwise=ew, slices=False)
    mean = math.fsum(whole.costs) / world
    cost = dict(zip(whole.names, whole.costs, strict=True))
    G = world // reps
    for n in plan.teams:
        assert cost[n] > mean, (n, cost[n], mean)  # never a team under the mean
        ps = plan.pieces(n)
        dims = {parse_piece(p).dim for p in ps}
        assert dims == {0 if named[n][0] >= named[n][1] else 1}  # the long side
        coords = [plan.coords(plan.slot(p)) for p in ps]  # a member's gathered pieces too
        assert len({c for c, _ in coords}) == len(ps)
        members = [plan.coords(plan.slot(p)) for p in plan.team(n)]
        assert len(members) >= 2 and len({r for _, r in members}) == 1
        assert len(ps) <= G
    # lighter, but for gathered pieces' per-byte costs (at most LOAD_SLACK over, §12)
    assert max(plan.slot_loads) <= max(whole.slot_loads) * LOAD_SLACK
    if plan.teams:
        assert plan.digest() != whole.digest() and '"teams"' in plan.canonical()


@pytest.mark.parametrize("size", ["8b", "70b"])
def test_teams_shorten_the_busiest_rank_at_1024(size):
    """At 1,024 ranks one owner per matrix leaves the busiest rank at the largest matrix; the
    teams' plan, collectives counted at the stated bandwidth, takes less time on its busiest."""
    dims = {"8b": {"layers": 32, "d": 4096, "ff": 14336}, "70b": {}}[size]
    named = llama(**dims)  # llama3's shapes, embeddings and head too
    ew = [n for n, s in named.items() if len(s) < 2]
    rate, bw = 4e14, 4e14 / 1024  # the cost model's default FLOP/byte
    teams = plan_summary(partition(named, 1024, elementwise=ew), gemm_flops=rate, bandwidth=bw)
    whole = plan_summary(
        partition(named, 1024, elementwise=ew, slices=False), gemm_flops=rate, bandwidth=bw
    )
    assert teams.teams and teams.busiest_seconds < whole.busiest_seconds / 3
    text = str(teams)
    assert "teams:" in text and "one owner's FLOPs" in text and "B/s for team collectives" in text
    for _, k, together, alone in teams.teams:
        assert k >= 2 and together >= 0.9 * alone  # the standard form's work, not less
    assert sum(r.team_bytes for r in teams.slots) == pytest.approx(
        math.fsum(partition(named, 1024, elementwise=ew).team_bytes)
    )


def test_asked_teams_and_their_errors():
    plan = partition({"w": (64, 256), "v": (32, 32)}, 4, teams={"w": 4})
    assert plan.teams == ("w",) and plan.pieces("w") == tuple(
        f"w[:, {a}:{a + 64}]" for a in range(0, 256, 64)
    )
    assert sorted(plan.slot(p) for p in plan.pieces("w")) == [0, 1, 2, 3]
    assert plan.team("w") == plan.pieces("w") and plan.team("v") == ()
    assert partition({"w": (4096, 1024)}, 4).teams == ("w",)  # the planner's own choice
    assert partition({"w": (4096, 1024)}, 4, teams={"w": 1}).teams == ()  # kept whole
    with pytest.raises(ValueError, match="2 or more shard columns"):
        partition({"w": (64, 256)}, 4, replicate_size=4, teams={"w": 2})
    for bad, match in [({"w": 5}, "2..4"), ({"w": 0}, "2..4"), ({"x": 2}, "one\\s+matrix"),
                       ({"e": 2}, "one\\s+matrix")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            partition({"w": (64, 256), "e": (4, 8, 8)}, 4, teams=bad)
