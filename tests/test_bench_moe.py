"""The MoE slices benchmark (examples/benchmarks/bench_moe.py) runs in its quick mode and writes
the rows it promises: the measured layer per dtype and slices off/on, its ratios, and the three
MoE models at 64 and 1,024 ranks; at 1,024 ranks every expert tensor is sliced."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
import bench_moe


def _cells(text: str, first: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith(f"| {first} ")
    ]


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "moe.md"
    text = bench_moe.main(["--quick", "--out", str(out)])
    assert out.read_text() == text
    dtypes = {c[1] for c in _cells(text, "4")}
    assert "float32" in dtypes
    for experts in ("4", "8"):
        plans = [c for c in _cells(text, experts) if c[2] in ("off", "on")]
        assert sorted((c[1], c[2]) for c in plans) == sorted(
            (dt, sl) for dt in dtypes for sl in ("off", "on")
        )
        ratios = [c for c in _cells(text, experts) if len(c) == 5]
        assert {c[1] for c in ratios} == dtypes
        assert all(re.fullmatch(r"\d+\.\d\dx", v) for c in ratios for v in c[2:])
    for model in bench_moe.SPECS:
        rows = _cells(text, model)
        assert [(c[1], c[2]) for c in rows] == [
            (w, sl) for w in ("64", "1,024") for sl in ("off", "on")
        ]
        off, on = rows[2], rows[3]  # 1,024 ranks
        assert off[3] == "-" and re.match(r"(\d+) of \1 → ", on[3]), on
        assert float(on[5]) < float(off[5])  # busiest/mean
        assert float(on[10].rstrip("x")) > 1
