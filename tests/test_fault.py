"""A rank dies mid-run: the others fail fast with an error instead of hanging, and a restart of
every rank from the last checkpoint finishes the run bit-exactly.

Real processes: W ranks (started from the suite's fork server, tests/_dist.py) with a gloo group
whose timeout is TIMEOUT s, training the Quick Start model (dedicate_params + fully_shard + Muon)
and checkpointing every EVERY steps. Rank
VICTIM SIGKILLs itself in step DIE_AT, after its forward (the others are then in backward's
collectives). `run_ranks` expects every rank to report, so this file has its own launcher.
The final checkpoints of the resumed and of an uninterrupted run are compared key by key
(parameters, masters, optimizer state, hyperparameters), exactly.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from tests._dist import init_rank, kill_all, rank_context, rank_store
from tests._models import batch, is_proj, make, muon_fp32

W, STEPS, EVERY, DIE_AT, VICTIM = 3, 6, 2, 5, 1
TIMEOUT = 30  # the process group's: a survivor that saw no error would raise after this
BOUND = 60  # survivors must have failed within this many seconds of the kill


def _last_checkpoint(root: Path) -> int:
    """The latest complete checkpoint (DCP writes .metadata last, after every rank's data)."""
    done = [int(d.name.split("_")[1]) for d in root.glob("step_*") if (d / ".metadata").exists()]
    return max(done, default=0)


def _train(rank: int, world: int, root: Path, out: Path, die: bool, resume: bool) -> int:
    mesh = init_device_mesh("cpu", (world,))
    model = make("mlp")
    dmuon.dedicate_params(model, mesh, is_proj)
    fully_shard(model, mesh=mesh)
    opt = muon_fp32(model)
    start = _last_checkpoint(root) if resume else 0
    if start:
        dmuon.load_checkpoint(root / f"step_{start}", model, opt)
    for s in range(start, STEPS):
        opt.zero_grad()
        loss = model(batch("mlp", s, rank))
        if die and rank == VICTIM and s == DIE_AT:
            (out / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        if (s + 1) % EVERY == 0:
            dmuon.save_checkpoint(root / f"step_{s + 1}", model, opt)
    return start


def _worker(rank: int, world: int, port: int, root: str, out: str, die: bool, resume: bool):
    torch.set_num_threads(1)  # W ranks share the machine's cores
    init_rank(rank, world, port, TIMEOUT)
    try:
        start = _train(rank, world, Path(root), Path(out), die, resume)
    except Exception as e:
        mro = [c.__name__ for c in type(e).__mro__]
        record = ("error", time.time(), mro, traceback.format_exc())
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(record))
        os._exit(1)  # a group with a dead peer need not shut down cleanly: don't wait on it
    dist.destroy_process_group()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(("ok", time.time(), [], start)))


def _launch(root: Path, out: Path, *, die: bool, resume: bool, deadline: float = 120.0):
    """Run W ranks to completion (or death); {rank: (record or None, exit code)}."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = rank_context()
    store = rank_store(W)  # the rendezvous, alive until every rank has finished
    procs = [
        ctx.Process(target=_worker, args=(r, W, store.port, str(root), str(out), die, resume))
        for r in range(W)
    ]
    try:
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:  # never leave a rank running: a timeout, a failure or an interrupt alike
        kill_all(procs)
    del store
    assert not hung, f"ranks {hung} still running after {deadline} s: a hang"
    results = {}
    for r, p in enumerate(procs):
        f = out / f"{r}.pkl"
        results[r] = (pickle.loads(f.read_bytes()) if f.exists() else None, p.exitcode)
    return results


def _contents(ckpt: Path, tmp: Path) -> dict:
    """Every value of a DCP checkpoint, read in this one process."""
    dst = tmp / f"{ckpt.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, dst)
    return torch.load(dst, weights_only=False)


@pytest.mark.slow
def test_killed_rank_fails_the_others_fast_and_a_restart_finishes_exactly(tmp_path):
    ref = _launch(tmp_path / "ref", tmp_path / "ref_out", die=False, resume=False)
    assert all(rec[0] == "ok" and code == 0 for rec, code in ref.values()), ref

    run, out = tmp_path / "run", tmp_path / "run_out"
    killed = _launch(run, out, die=True, resume=False)
    t_kill = float((out / "killed").read_text())
    assert killed[VICTIM] == (None, -signal.SIGKILL)
    for r, (rec, code) in killed.items():
        if r == VICTIM:
            continue
        status, t_err, mro, tb = rec
        assert status == "error" and code == 1, (r, rec)
        assert "RuntimeError" in mro, tb  # the collective's error (gloo / dmuon_fn's guard)
        assert t_err - t_kill < BOUND, (r, t_err - t_kill, tb)
    last = DIE_AT - DIE_AT % EVERY
    assert _last_checkpoint(run) == last

    resumed = _launch(run, tmp_path / "resume_out", die=False, resume=True)
    assert all(rec[0] == "ok" and code == 0 for rec, code in resumed.values()), resumed
    assert all(rec[3] == last for rec, _ in resumed.values()), "did not resume from the last"
    want = _contents(tmp_path / "ref" / f"step_{STEPS}", tmp_path)
    got = _contents(run / f"step_{STEPS}", tmp_path)
    assert got.keys() == want.keys()
    assert any(k.startswith("model.") for k in want) and any(k.startswith("optim.") for k in want)
    for k, v in want.items():
        if torch.is_tensor(v):
            assert v.dtype == got[k].dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k
