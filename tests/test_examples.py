"""The Quick Start's scripts run as written (with `import dmuon_fn as dmuon`) under torchrun on
CPU ranks with gloo: ModuleDict layers through fully_shard, 1-D FSDP2 and (2, 1) HSDP meshes.
The main job, train_gpt.py, writes its figure and table; its PNG writer round-trips."""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _torchrun(*script: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 <script...>` from examples/, with the repository root on the
    path so the ranks import dmuon_fn even where it is not installed."""
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *script],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_hsdp.py"])
def test_quick_start_script_trains(script):
    proc = _torchrun(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss=(\S+)", proc.stdout)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), proc.stdout
    # the Quick Start's objective is the raw sum of the head's outputs: training drives it down
    assert losses[-1] < losses[0]


def _png_rows(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB, non-interlaced PNG whose rows all use filter 0 (as _png writes):
    check the signature and every chunk's CRC, return (width, height, rows of RGB bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + n
    assert list(chunks)[-1] == b"IEND"
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color, interlace) == (8, 2, 0)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w) : (y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def _pixel(rows: list[bytes], x: int, y: int) -> tuple[int, ...]:
    return tuple(rows[y][3 * x : 3 * x + 3])


def test_png_canvas_round_trips():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from _png import Canvas, Series, nice_ticks, plot
    finally:
        sys.path.remove(str(EXAMPLES))
    cv = Canvas(37, 23)
    cv.line(2, 3, 30, 3, (255, 0, 0))  # horizontal
    cv.line(5, 5, 15, 20, (0, 0, 255), width=3)  # steep, thick
    cv.text(20, 8, "7", (0, 128, 0), scale=1)
    w, h, rows = _png_rows(cv.png())
    assert (w, h) == (37, 23)
    assert [_pixel(rows, x, 3) for x in (2, 16, 30)] == [(255, 0, 0)] * 3
    assert _pixel(rows, 1, 3) == _pixel(rows, 31, 3) == (255, 255, 255)
    assert _pixel(rows, 5, 5) == _pixel(rows, 15, 20) == (0, 0, 255)
    assert _pixel(rows, 20, 8) == (0, 128, 0)  # the top row of a 7 is full: 1F
    assert _pixel(rows, 20, 9) == (255, 255, 255)
    # every pixel the canvas holds is the one decoded
    assert b"".join(rows) == bytes(cv.pixels)

    assert nice_ticks(1.13, 4.61) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert nice_ticks(0.95, 2.3) == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert nice_ticks(0, 300) == [0, 50, 100, 150, 200, 250, 300]
    fig = plot(
        [Series("a", [0, 1, 2], [3.0, 2.0, 1.0], (200, 0, 0))],
        title="t",
        xlabel="x",
        ylabel="y",
        width=300,
        height=200,
    )
    w, h, rows = _png_rows(fig.png())
    assert (w, h) == (300, 200)
    assert sum(r.count(bytes((200, 0, 0))) for r in rows) > 100  # the curve and its legend key


@pytest.mark.slow
def test_train_gpt_writes_figure_and_table(tmp_path):
    proc = _torchrun("train_gpt.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "100%  step   20/20" in proc.stderr  # the progress lines, written without a TTY
    w, h, _ = _png_rows((tmp_path / "gpt_loss.png").read_bytes())
    assert (w, h) == (800, 500)
    table = (tmp_path / "gpt_summary.md").read_text()
    assert table in proc.stdout
    # | optimizer | lr | steps | tokens | train loss | val loss | wall s | ms/step |
    cells = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    rows = {c[0].strip(): c for c in cells if c[2].strip() == "20"}
    assert set(rows) == {"Muon", "AdamW"}, table
    for c in rows.values():
        # from ln(96) = 4.56 nats/char at initialization; 20 steps reach about 2.3
        assert float(c[4]) < 3.5 and float(c[5]) < 3.5, table
