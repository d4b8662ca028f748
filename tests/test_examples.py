"""The Quick Start's scripts run as written (with `import dmuon_fn as dmuon`) under torchrun on
CPU ranks with gloo: ModuleDict layers through fully_shard, 1-D FSDP2, (2, 1) HSDP and
(dp 1, tp 2) tensor-parallel meshes.
The main job, train_gpt.py, shows its progress and writes its figure and table."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _torchrun(*script: str, torchrun: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 <script...>` from examples/ (torchrun=False: plain python),
    with the repository root on the path so the ranks import dmuon_fn even where it is not
    installed."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node=2"] if torchrun else []
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, *launcher, *script],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": path},
    )


@pytest.mark.slow
def test_a_script_started_without_torchrun_runs_as_one_process_or_says_how_to_launch():
    proc = _torchrun("train_fsdp2.py", torchrun=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one process (for several ranks: torchrun" in proc.stderr
    assert len(re.findall(r"step +\d+ +loss=(\S+)", proc.stdout)) == 4, proc.stdout
    proc = _torchrun("train_hsdp.py", torchrun=False)
    assert proc.returncode == 1
    assert "needs a multiple of 2 ranks, got 1: e.g. torchrun --nproc_per_node=4" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_hsdp.py", "train_tp.py"])
def test_quick_start_script_trains(script):
    proc = _torchrun(script)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss=(\S+)", proc.stdout)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), proc.stdout
    # the Quick Start's objective is the raw sum of the head's outputs: training drives it down
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_train_gpt_writes_figure_and_table(tmp_path):
    proc = _torchrun("train_gpt.py", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the progress bar's last state, written without a TTY
    assert re.search(r"Muon .*100%.* 20/20", proc.stderr), proc.stderr[-2000:]
    assert re.search(r"AdamW .*100%.* 20/20", proc.stderr), proc.stderr[-2000:]
    from matplotlib.image import imread

    img = torch.from_numpy(imread(tmp_path / "gpt_loss.png"))  # rows × columns × RGBA in [0, 1]
    assert tuple(img.shape) == (500, 800, 4)
    for color in ((0xD6, 0x27, 0x28), (0x1F, 0x77, 0xB4)):  # Muon's and AdamW's train curves
        near = (img[..., :3] * 255 - torch.tensor(color)).abs().amax(-1) < 40
        assert int(near.sum()) > 300, color
    table = (tmp_path / "gpt_summary.md").read_text()
    assert table in proc.stdout
    # | optimizer | lr | steps | tokens | train loss | val loss | wall s | ms/step |
    cells = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    rows = {c[0].strip(): c for c in cells if c[2].strip() == "20"}
    assert set(rows) == {"Muon", "AdamW"}, table
    for c in rows.values():
        # from ln(96) = 4.56 nats/char at initialization; 20 steps reach about 2.3
        assert float(c[4]) < 3.5 and float(c[5]) < 3.5, table
