"""What the trainer clients' tests share (tests/test_accelerate.py, tests/test_hf_trainer.py): a
small Llama from a config with its matrices dedicated and the rest on FSDP2, its batches, the
plain loop every trainer is held to, and accelerate's FSDP2 path on CPU ranks.

accelerate turns its FSDP plugin on only where the ranks run on an accelerator: its
`AcceleratorState` sets the FSDP distributed type for MULTI_GPU, MULTI_XPU, MULTI_NPU and the
other device types, never for MULTI_CPU, which it wraps in DDP instead (a dedicated model
fails there: DDP refuses DTensors, and a rank's 0-size placeholders do not match the owner's
matrix). `fsdp2_on_cpu` sets the type that a GPU job gets, so that accelerate's own FSDP2 code
(`prepare`, `clip_grad_norm_`, `save_state` / `load_state`, `get_state_dict`) runs on gloo
ranks; examples/accelerate_fsdp2.py runs that path on GPUs as it is
(examples/benchmarks/gpu_checks.sh, step `trainers`)."""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon
from tests._models import muon_fp32
from tests.test_meta_clients import SEQ, VOCAB, _build  # its small Llama config

STEPS, BATCH, SEED, MAX_NORM = 5, 4, 5, 0.5


def llama(world: int) -> torch.nn.Module:
    """transformers' LlamaForCausalLM (2 layers, width 32), the same seeded values on any world;
    the decoder layers' matrices dedicated, each layer and the rest on FSDP2 over the world
    (on one rank, plain parameters: nothing to shard)."""
    torch.manual_seed(SEED)
    model = _build("llama")
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, is_matrix)
    if world == 1:
        return model
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and ".layers." in name


def ids(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's part of step `step`'s global batch."""
    g = torch.Generator().manual_seed(100 + step)
    every = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    per = BATCH // world
    return every[rank * per : (rank + 1) * per]


def plain_losses(rank: int, world: int, schedule=None) -> list[float]:
    """The plain torchrun loop: backward, torch's clip_grad_norm_, Muon's step (then torch's
    LambdaLR of `schedule`, if given)."""
    model = llama(world)
    opt = muon_fp32(model)
    sched = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x = ids(step, rank, world)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def trainer_env(rank: int, world: int) -> None:
    """The variables torchrun sets, which accelerate reads (the process group exists already)."""
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # (read, never bound: the group exists)


def fsdp2_on_cpu(plugin) -> None:
    """accelerate's state as on a GPU job with `plugin` (see the module's docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    for state in (PartialState(), AcceleratorState()):
        state.distributed_type = DistributedType.FSDP
    AcceleratorState().fsdp_plugin = plugin
