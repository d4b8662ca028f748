"""The library needs torch alone (`pip install torch==2.13.0 -e .`): no numpy at run time.

Two real ranks (plain subprocesses, as torchrun starts them) in which `import numpy` fails before
torch is imported, so torch runs without numpy exactly as in a fresh venv without it. They run
every setup collective (the dispatch agreement, the plan and setup checks, the HSDP-free object
API and the functional API) and one training step of each face. torch's pickle-based
`all_gather_object` fails there ("Numpy is not available"), which shows the environment is the
one that broke the main command.

The ranks rendezvous as torchrun's do: at a TCPStore that the launcher (here the test) holds open
on a port the kernel picked (TORCHELASTIC_USE_AGENT_STORE), so no port is picked and then raced
for. Both are killed if they have not finished within TIMEOUT s, or if the test fails or is
interrupted while they run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._dist import HOST, rank_store

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # s, for both ranks together

_RANK = """
import sys
sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn
from tests._models import batch, is_proj, make

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    dist.all_gather_object([None, None], rank)
    print("all_gather_object: ok")
except RuntimeError as e:
    print(f"all_gather_object: {e}")
mesh = init_device_mesh("cpu", (2,))
model = make("mlp")
dmuon_fn.dedicate_params(model, mesh, is_proj)
fully_shard(model, mesh=mesh)
opt = dmuon_fn.Muon(model, lr=0.01)
model(batch("mlp", 0, rank)).backward()
opt.step()

fn_model = make("mlp")
plan = dmuon_fn.plan(fn_model, mesh)
state = dmuon_fn.init(fn_model, plan)
loss_fn = lambda p, x: torch.func.functional_call(fn_model, p, (x,))
loss, grads = dmuon_fn.value_and_grad(loss_fn, plan)(state.params, batch("mlp", 0, rank))
state = dmuon_fn.update(grads, state, lr=torch.tensor(0.01))
print(f"trained: {float(loss):.4f}", dmuon_fn.get_ns_backend("cpu"))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_library_runs_without_numpy(tmp_path):
    store = rank_store(2)  # open until both ranks have finished
    env = {
        **os.environ,
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank joins the store as a client
        "WORLD_SIZE": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs = []
    try:
        for r in range(2):
            # files, not pipes: a rank blocked on a full pipe would hang the other in a collective
            with open(tmp_path / f"{r}.out", "w") as out, open(tmp_path / f"{r}.err", "w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _RANK],
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        cwd=tmp_path,
                        stdout=out,
                        stderr=err,
                    )
                )
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:  # a rank still running here timed out or outlived a failure
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        out = (tmp_path / f"{r}.out").read_text()
        err = (tmp_path / f"{r}.err").read_text()
        assert p.returncode == 0, err[-3000:]
        assert "all_gather_object: Numpy is not available" in out, out
        assert "trained: " in out, out
