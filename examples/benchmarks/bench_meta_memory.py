"""Peak memory per rank of a model built on the meta device against the same model built on the
CPU, side by side in one run (proofs/meta_init.md claim 5).

A stack of LAYERS pre-norm MLP blocks (gate/up/down projections of WIDTH × HIDDEN, dedicated;
LayerNorms on FSDP2) goes through dedicate_params → fully_shard per block → to_empty →
`init_weights` → `Muon` → 2 training steps, built once under `torch.device("meta")` and once on
the CPU. Each rank's peak is every tensor allocated from the build to the end of the steps (the
CPU allocator's records: examples/benchmarks/_memory.py), printed against

- its share: its masters, their gradients and Muon momentum, FSDP2's shards with theirs and
  AdamW's two moments, and 2·prefetch + 3 of the largest layer's gathered bytes (Z3's
  prefetch + 1 copies, as many layers' gradient sums in flight to their owners, one layer's
  gradients being made);
- the whole model's fp32 size, which no rank of the meta build may reach.

    torchrun --nproc_per_node=4 examples/benchmarks/bench_meta_memory.py [--layers 48]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _memory import peak_bytes

import dmuon_fn as dmuon


class Stack(nn.Module):
    def __init__(self, layers: int, width: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(width, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate_proj, self.up_proj = (
            nn.Linear(width, hidden, bias=False),
            nn.Linear(width, hidden, bias=False),
        )
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down_proj(self.gate_proj(h) * self.up_proj(h))


def _reset(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def measure(rank: int, world: int, meta: bool, layers: int = 48, width: int = 128,
            hidden: int = 512, prefetch: int = 1) -> dict[str, int]:  # fmt: skip
    """This rank's peak bytes, its share and the whole model's bytes (see the module doc)."""
    mesh = init_device_mesh("cpu", (world,))

    def flow() -> nn.Module:
        with torch.device("meta" if meta else "cpu"):
            model = Stack(layers, width, hidden)
        dmuon.dedicate_params(
            model, mesh, lambda n, p: n.endswith("proj.weight"), prefetch=prefetch
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        dmuon.init_weights(model, _reset, seed=0)
        opt = dmuon.Muon(model, ns_dtype=torch.float32)
        for step in range(2):
            opt.zero_grad()
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(100 * step + rank))
            model(x).backward()
            opt.step()
        return model

    model, peak = peak_bytes(flow)
    st = model._dmuon_state
    held = sum(4 * e.param.numel() for e in st.entries if st.is_global_owner(e))
    shards = sum(4 * p.to_local().numel() for p in model.parameters() if st.entry(p) is None)
    unit = max(sum(4 * g.numel for g in u.groups) for u in st.scheduler.units)
    share = 3 * held + 4 * shards + (2 * prefetch + 3) * unit
    full = sum(4 * p.numel() for p in Stack(layers, width, hidden).parameters())
    return dict(peak=peak["total"], share=share, full=full)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    args = parser.parse_args()
    from _launch import init

    _, rank, world = init()
    torch.set_num_threads(1)
    rows = {kind: measure(rank, world, kind == "meta", args.layers) for kind in ("meta", "eager")}
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        mib = 2**20
        whole = rows["meta"]["full"] / mib
        print(f"{args.layers} layers, {whole:.1f} MiB of fp32 parameters, {world} ranks")
        print("| build | rank | peak MiB | share MiB | peak / share | peak / whole model |")
        print("|---|--:|--:|--:|--:|--:|")
        for kind in ("meta", "eager"):
            for r, row in enumerate(x[kind] for x in every):
                peak, share, full = row["peak"], row["share"], row["full"]
                print(f"| {kind} | {r} | {peak / mib:.2f} | {share / mib:.2f} | "
                      f"{peak / share:.3f} | {peak / full:.3f} |")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
