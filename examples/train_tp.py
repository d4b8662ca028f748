"""The Quick Start's model with tensor parallelism: FSDP2 + TP on a (dp, tp) mesh.

torchrun --nproc_per_node=4 examples/train_tp.py      (CUDA + NCCL, or CPU + gloo)

Each MLP is split over the tensor ranks (gate/up ColwiseParallel, down RowwiseParallel); the
matrices are dedicated over the data ranks, one tensor-parallel part per rank, and Muon
orthogonalizes each matrix once in the job. The ranks of a tensor group read the same batch.
"""

import torch
import torch.distributed as dist
from _launch import init
from model import TinyMLP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon_fn as dmuon


def main() -> None:
    device, rank, world_size = init(multiple_of=2)

    tp = 2
    mesh = init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(42)
    model = TinyMLP().to(device)
    for layer in model.layers:
        parallelize_module(
            layer,
            mesh["tp"],
            {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
             "down_proj": RowwiseParallel()},
        )  # fmt: skip

    dmuon.dedicate_params(model, mesh["dp"], predicate=lambda n, p: "proj" in n and p.ndim == 2)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = dmuon.Muon(model, lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3)

    data = torch.Generator(device).manual_seed(mesh["dp"].get_local_rank())
    for step in range(20):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 512, device=device, generator=data))
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss={loss.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
