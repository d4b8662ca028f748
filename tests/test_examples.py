"""The Quick Start's scripts run as written (with `import dmuon_fn as dmuon`) under torchrun on
CPU ranks with gloo: ModuleDict layers through fully_shard, 1-D FSDP2, (2, 1) HSDP and
(dp 1, tp 2) tensor-parallel meshes.
The main job, train_gpt.py, shows its progress and writes its figure and table. The MoE example,
train_moe.py, trains Muon with QK-clip against AdamW on 4 ranks, in transformers' Qwen3-MoE and
in its own model, which computes what Qwen3-MoE computes."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _torchrun(*script: str, torchrun: bool = True, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=<nproc> <script...>` from examples/ (torchrun=False: plain
    python), with the repository root on the path so the ranks import dmuon_fn even where it is
    not installed."""
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"] if torchrun else []
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


def _steps(out: str, run: str) -> list[tuple[float, float, int]]:
    """(loss, max logit, heads over tau) per printed step of one run of train_moe.py."""
    pattern = rf"^{run} +step +\d+ +loss (\S+) +max logit +(\S+) +heads [a-z ]+ (\d+)/8$"
    return [(float(a), float(b), int(c)) for a, b, c in re.findall(pattern, out, re.MULTILINE)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, flags",
    [
        # as documented: transformers' Qwen3-MoE where installed (qk-norm; τ above its logits)
        ("auto", ()),
        # the fallback model, with a τ below the first step's logits: every step clips
        ("own", ("--tau", "2")),
    ],
)
def test_train_moe_trains_muon_with_qk_clip_against_adamw(model, flags):
    if model == "auto":
        pytest.importorskip("transformers")
    proc = _torchrun("train_moe.py", "--steps", "12", "--model", model, *flags, nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "model.layers.0.mlp.experts.gate_up_proj" in out  # the plan summary
    muon, adamw = _steps(out, "Muon"), _steps(out, "AdamW")
    assert len(muon) == len(adamw) == 12, out
    assert all(math.isfinite(v) for row in muon + adamw for v in row[:2]), out
    # from the same weights on the same first batch; from ln(96) = 4.56 nats/char, Muon goes down
    assert muon[0][0] == adamw[0][0]
    assert sum(r[0] for r in muon[-3:]) / 3 < muon[0][0] - 0.5, out
    clipped = sum(r[2] for r in muon)
    if model == "own":
        assert muon[0][2] > 0 and clipped > 0, out
    assert f"QK-clip: {clipped} head-steps clipped" in out
    assert re.search(r"after 12 steps: train loss .* Muon \S+ vs AdamW \S+, val loss", out), out


def test_the_fallback_moe_model_computes_what_qwen3_moe_computes(monkeypatch):
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("_moe_model", EXAMPLES / "_moe_model.py")
    own_module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, own_module)  # its dataclass looks itself up
    spec.loader.exec_module(own_module)
    for qk_norm in (True, False):
        shape = dict(
            vocab_size=96,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
        torch.manual_seed(0)
        cfg = transformers.Qwen3MoeConfig(**shape, tie_word_embeddings=False)
        theirs = transformers.Qwen3MoeForCausalLM(cfg).float()
        if not qk_norm:
            for layer in theirs.model.layers:
                layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
        with torch.no_grad():
            for p in theirs.parameters():  # norms, router and experts far from their init
                p.normal_()
        own = own_module.MoeForCausalLM(own_module.MoeConfig(**shape, qk_norm=qk_norm))
        own.load_state_dict(theirs.state_dict(), strict=True)  # the same names and shapes
        ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
        want = theirs(input_ids=ids, output_router_logits=True)
        got = own(input_ids=ids, output_router_logits=True)
        scale = want.logits.abs().max()
        assert (got.logits - want.logits).abs().max() <= 1e-5 * scale, qk_norm
        torch.testing.assert_close(got.aux_loss, want.aux_loss)


@pytest.mark.slow
def test_the_accelerate_example_says_where_its_fsdp_path_runs():
    """examples/accelerate_fsdp2.py is a GPU check (accelerate's FSDP plugin is off on CPU):
    here it says so and exits 2; tests/test_accelerate.py runs that path on CPU ranks."""
    pytest.importorskip("accelerate")
    proc = _torchrun("accelerate_fsdp2.py", torchrun=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "its FSDP plugin is on only for accelerator devices" in proc.stderr
