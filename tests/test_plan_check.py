"""Cross-rank plan check on two gloo processes: agreeing plans pass, a disagreement raises on
every rank and names the first differing parameter (proofs/partition.md, "Determinism")."""

from __future__ import annotations

import pytest

from dmuon_fn.planning._check import PlanMismatchError, check_plan_consistent, param_hashes
from dmuon_fn.planning._partition import partition
from tests._dist import run_ranks

pytestmark = pytest.mark.slow


def _model(attn_rows: int = 32) -> dict:
    out = {}
    for i in range(3):
        out |= {f"blocks.{i}.attn.w": (attn_rows, 32), f"blocks.{i}.mlp.up.w": (64, 32),
                f"blocks.{i}.mlp.down.w": (32, 64), f"blocks.{i}.norm.w": (32,)}  # fmt: skip
    return out


def _worker(rank: int, world: int) -> dict:
    result: dict = {}
    plan = partition(_model(), 4)
    result["same"] = check_plan_consistent(plan)
    # Rank 1 sees a different shape for one parameter, as with a mismatched model config.
    other = partition(_model(attn_rows=32 if rank == 0 else 48), 4)
    try:
        check_plan_consistent(other)
        result["mismatch"] = None
    except PlanMismatchError as e:
        result["mismatch"] = str(e)
    # Tensor parallelism: rank 1 split a matrix rank 0 kept whole (a TP plan applied apart)
    layouts = dict.fromkeys(_model(), "plain")
    if rank == 1:
        layouts["blocks.1.mlp.up.w"] = "Shard(0)"
    try:
        check_plan_consistent(partition(_model(), 2, tensor_size=2, layouts=layouts))
        result["layout"] = None
    except PlanMismatchError as e:
        result["layout"] = str(e)
    return result


def test_ranks_agree_or_all_raise_naming_the_first_differing_parameter():
    res = run_ranks(_worker, 2)
    digest = partition(_model(), 4).digest()
    assert res[0]["same"] == res[1]["same"] == digest
    # blocks.0.attn.w comes first in name order and its shape differs, so it is the first
    # difference whatever else moved; both ranks raise, each describing its own copy.
    for r, shape in ((0, "(32, 32)"), (1, "(48, 32)")):
        msg = res[r]["mismatch"]
        assert msg is not None
        assert "'blocks.0.attn.w'" in msg and shape in msg, msg
        assert "agree on its name but not on its shape or owner" in msg
        assert "ranks 0 and 1" in msg
        assert "'blocks.1.mlp.up.w'" in res[r]["layout"], res[r]["layout"]


def test_param_hashes_locate_the_change():
    a, b = partition(_model(), 4), partition(_model(attn_rows=48), 4)
    ha, hb = param_hashes(a), param_hashes(b)
    first = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=True)) if x != y)
    assert first == 0 and a.names[0] == "blocks.0.attn.w"
    assert all(-(2**63) <= h < 2**63 for h in ha)
    assert [h >> 32 for h in ha] == [h >> 32 for h in hb]  # same names: same high halves
