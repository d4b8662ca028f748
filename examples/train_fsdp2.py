"""The Quick Start's FSDP2 script: dedicate_params -> fully_shard -> dmuon_fn.Muon.

torchrun --nproc_per_node=4 examples/train_fsdp2.py     (CUDA + NCCL, or CPU + gloo)
"""

import torch
import torch.distributed as dist
from _launch import init
from model import TinyMLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon


def main() -> None:
    device, rank, world_size = init()

    mesh = init_device_mesh(device, (world_size,))
    torch.manual_seed(42)
    model = TinyMLP().to(device)

    # dedicate_params BEFORE fully_shard — order matters
    dmuon.dedicate_params(
        model,
        mesh,
        predicate=lambda n, p: "proj" in n and p.ndim == 2,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3)
    if rank == 0:
        print(dmuon.get_ns_backend())

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
