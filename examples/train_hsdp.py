"""The Quick Start's HSDP script: a (replicate, shard) mesh, two-stage reduce, async publish.

torchrun --nproc_per_node=4 examples/train_hsdp.py      (CUDA + NCCL, or CPU + gloo)
"""

import torch
import torch.distributed as dist
from _launch import init
from model import TinyMLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon


def main() -> None:
    device, rank, world_size = init(multiple_of=2)

    replicate_size = 2
    shard_size = world_size // replicate_size
    hsdp = init_device_mesh(
        device,
        (replicate_size, shard_size),
        mesh_dim_names=("replicate", "shard"),
    )
    torch.manual_seed(42)
    model = TinyMLP().to(device)

    dmuon.dedicate_params(
        model,
        hsdp["shard"],
        predicate=lambda n, p: "proj" in n and p.ndim == 2,
        replicate_mesh=hsdp["replicate"],
    )
    for layer in model.layers:
        fully_shard(layer, mesh=hsdp)
    fully_shard(model, mesh=hsdp)

    optimizer = dmuon.Muon(
        model, lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3, replicate_async=True
    )

    for step in range(20):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 512, device=device))
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss={loss.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
