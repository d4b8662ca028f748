"""The team benchmark (examples/benchmarks/bench_team_step.py) runs with one timed step on 2
ranks and prints what it promises: one row for the head on one owner and one for a team of 2,
each with positive CPU and wall seconds, the ratios, and the at-once line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
import bench_team_step


@pytest.mark.slow
def test_tiny_run_prints_both_rows_and_the_ratios():
    text = bench_team_step.main(["--world", "2", "--steps", "1", "--dtype", "float32"])
    rows = {
        cells[0]: [float(v) for v in cells[1:]]
        for line in text.splitlines()
        if line.startswith("| one owner") or line.startswith("| a team of")
        for cells in [[c.strip() for c in line.split("|")[1:-1]]]
    }
    assert set(rows) == {"one owner", "a team of 2"}, text
    for values in rows.values():
        assert len(values) == 5 and all(v > 0 for v in values), values
    assert re.search(r"Newton-Schulz CPU: \d+\.\d+x less", text)
    assert re.search(r"on every rank at once .*: \d+\.\d+ s CPU per rank", text)
