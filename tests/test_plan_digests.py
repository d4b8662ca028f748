"""The planner's output for real models is pinned: the digests of the plans for every shape list
in ../shared/data/model_shapes/ (block matrices only, and every matrix; 1-D meshes, HSDP and a
tensor-parallel degree) equal the ones recorded in tests/data/plan_digests.json. A change that
moves any owner, on any of these models, fails here; a deliberate one records the digests anew:

    python -m tests.test_plan_digests --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import dmuon_fn

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT.parent / "shared" / "data" / "model_shapes"
RECORD = ROOT / "tests" / "data" / "plan_digests.json"
# (world size, replicate size, tensor size)
MESHES = [(8, 1, 1), (64, 1, 1), (1024, 1, 1), (64, 2, 1), (64, 1, 2)]


def _in_block(name: str) -> bool:
    return any(part.isdigit() for part in name.split("."))


def digests(path: Path) -> dict[str, str]:
    spec = json.loads(path.read_text())
    named = {n: tuple(s) for n, s in spec["params"]}
    out = {}
    for matrices in ("block", "all"):
        ew = [
            n for n, s in named.items() if len(s) < 2 or (matrices == "block" and not _in_block(n))
        ]
        for world, rep, tp in MESHES:
            plan = dmuon_fn.partition(
                named, world, replicate_size=rep, tensor_size=tp, elementwise=ew
            )
            out[f"{matrices} w{world} r{rep} t{tp}"] = plan.digest()
    return out


def _files() -> list[Path]:
    return sorted(SHAPES.glob("*.json"))


@pytest.mark.slow
@pytest.mark.skipif(not SHAPES.is_dir(), reason=f"no shape lists at {SHAPES}")
@pytest.mark.parametrize("path", _files(), ids=[p.stem for p in _files()])
def test_plans_of_real_models_are_the_recorded_ones(path):
    recorded = json.loads(RECORD.read_text())
    assert path.stem in recorded, f"no digests recorded for {path.name}: run --record"
    assert digests(path) == recorded[path.stem]


def test_every_shape_list_has_recorded_digests():
    recorded = json.loads(RECORD.read_text())
    assert set(recorded) >= {p.stem for p in _files()}
    assert all(len(d) == 2 * len(MESHES) for d in recorded.values())


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({p.stem: digests(p) for p in _files()}, indent=1) + "\n")
    print(f"recorded {RECORD}")
