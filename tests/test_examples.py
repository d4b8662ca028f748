"""The Quick Start's scripts run as written (with `import dmuon_fn as dmuon`) under torchrun on
CPU ranks with gloo: ModuleDict layers through fully_shard, 1-D FSDP2 and (2, 1) HSDP meshes."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_fsdp2.py", "train_hsdp.py"])
def test_quick_start_script_trains(script):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", script],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss=(\S+)", proc.stdout)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), proc.stdout
    # the Quick Start's objective is the raw sum of the head's outputs: training drives it down
    assert losses[-1] < losses[0]
