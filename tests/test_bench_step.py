"""The step-by-phase benchmark (examples/benchmarks/bench_step.py) runs with a couple of steps
and prints every row it promises: the phase table per optimizer with finite times, the
collectives table, the Muon / AdamW ratios and the step-phase comparison."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
import bench_step

NUMBER = r"\d+\.\d+ / \d+\.\d+"


def _rows(text: str, config: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith(f"| {config} |")
    ]


@pytest.mark.slow
def test_tiny_run_prints_every_row():
    text = bench_step.main(["--world", "2", "--steps", "2", "--warmup", "1", "--batch", "4"])
    for config in bench_step.CONFIGS:
        times, comm = _rows(text, config)
        assert len(times) == 8 and len(comm) == 6, (times, comm)
        for cell in times[1:]:
            if cell == "-":
                assert config.startswith("FSDP2")
                continue
            assert re.fullmatch(NUMBER, cell), cell
            assert all(math.isfinite(float(v)) for v in cell.split(" / "))
        assert int(comm[1]) > 0 and float(comm[4].split(" / ")[0]) > 0
    assert "allreduce_ 1" in _rows(text, "Muon")[1][2]  # the guard's global norm
    assert "allreduce_" not in _rows(text, "Muon, nonfinite=ignore")[1][2]
    assert re.search(r"Muon / AdamW: ms/step \d+\.\d\dx", text)
    assert text.count("Step phase vs AdamW step + Newton-Schulz + 2 ms") == 2
