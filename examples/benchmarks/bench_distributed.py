"""FSDP2 + AdamW vs naive FSDP2 + Muon vs dmuon_fn, on W CPU ranks (gloo).

(a) fully_shard everything, torch.optim.AdamW;
(b) fully_shard everything, Muon done naively: every rank all-gathers each matrix's Nesterov
    momentum and orthogonalizes every matrix, then updates its own shard;
(c) dmuon_fn: dedicate_params (projections) + fully_shard (the rest) + dmuon_fn.Muon.
Prints median forward+backward and step times, the step-time ratio (b)/(c), and bytes per rank
per step (CommCounter), total and for the Muon matrices.
Run: python examples/benchmarks/bench_distributed.py [--world 4] [--steps 6] [--d 512]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from _timing import machine, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon


def _model(d: int, ff: int, layers: int) -> torch.nn.Module:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from model import TinyMLP

    torch.manual_seed(0)
    return TinyMLP(d, ff, layers)


def is_proj(n: str, p: torch.Tensor) -> bool:
    return "proj" in n and p.ndim == 2


class NaiveMuon:
    """Every rank gathers every matrix's momentum and orthogonalizes it (the baseline)."""

    def __init__(self, model, lr=0.02, momentum=0.95, adamw_lr=1e-3):
        self.mats = [p for n, p in model.named_parameters() if is_proj(n, p)]
        rest = [p for n, p in model.named_parameters() if not is_proj(n, p)]
        self.adamw = torch.optim.AdamW(rest, lr=adamw_lr)
        self.bufs = [torch.zeros_like(p) for p in self.mats]
        self.lr, self.mu = lr, momentum

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.mats, self.bufs, strict=True):
            if p.grad is None:
                continue
            buf.mul_(self.mu).add_(p.grad)
            u = p.grad + self.mu * buf
            full = u.full_tensor()  # all-gather
            O = dmuon.orthogonalize(full)
            shard = p.to_local()
            rows = shard.shape[0]
            start = dist.get_rank() * math.ceil(full.shape[0] / dist.get_world_size())
            scale = 0.2 * math.sqrt(max(full.shape))
            shard.sub_(self.lr * scale * O[start : start + rows])
        self.adamw.step()

    def zero_grad(self):
        for p in self.mats:
            p.grad = None
        self.adamw.zero_grad()


def _rank(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("a2", "a3", "b", "c2", "c3"):
        z3 = kind.endswith("3")
        model = _model(args.d, 4 * args.d, args.layers)
        p_m = sum(p.numel() * 4 for n, p in model.named_parameters() if is_proj(n, p))
        p_all = sum(p.numel() * 4 for p in model.parameters())
        if kind[0] == "c":
            dmuon.dedicate_params(model, mesh, is_proj, reshard_after_forward=z3)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
        fully_shard(model, mesh=mesh, reshard_after_forward=z3)
        opt = {
            "a": lambda m=model: torch.optim.AdamW(m.parameters(), lr=1e-3),
            "b": lambda m=model: NaiveMuon(m),
            "c": lambda m=model: dmuon.Muon(m, lr=0.02, adamw_lr=1e-3),
        }[kind[0]]()
        fb, st = [], []
        comm = dmuon.CommCounter()
        with comm:
            for step in range(args.steps):
                opt.zero_grad()
                x = torch.randn(8, args.d, generator=torch.Generator().manual_seed(step + rank))
                dist.barrier()
                t0 = time.perf_counter()
                with comm.phase("fwdbwd"):
                    model(x).backward()
                t1 = time.perf_counter()
                with comm.phase("step"):
                    opt.step()
                dist.barrier()
                t2 = time.perf_counter()
                if step >= 1:  # the first step builds state
                    fb.append(t1 - t0)
                    st.append(t2 - t1)
        total = comm.total_bytes() / args.steps
        ours = sum(s.op_bytes["broadcast_"] + s.op_bytes["reduce_"] for s in comm.stats.values())
        step_bytes = comm.stats["step"].bytes / args.steps
        out[kind] = dict(
            fb=statistics.median(fb),
            step=statistics.median(st),
            total=total,
            muon=ours / args.steps,
            step_bytes=step_bytes,
            p_m=p_m,
            p_all=p_all,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    r = run_ranks(_rank, args.world, args)
    W = args.world
    print(
        f"# distributed step, W={W} CPU ranks (gloo, 1 thread each), TinyMLP d={args.d} "
        f"ff={4 * args.d} layers={args.layers}, {machine()}"
    )
    pm = r["a2"]["p_m"]
    print(
        f"# P_M (projection matrices) = {pm / 2**20:.1f} MiB fp32, all params "
        f"{r['a2']['p_all'] / 2**20:.2f} MiB; floors 2(W-1)/W·P_M = "
        f"{2 * (W - 1) / W * pm / 2**20:.1f} MiB (Z2), 3(W-1)/W·P_M = "
        f"{3 * (W - 1) / W * pm / 2**20:.1f} MiB (Z3)"
    )
    print(
        "| config | fwd+bwd ms | step ms | bytes/rank/step MiB | in step() MiB "
        "| dedicated-matrix MiB |"
    )
    print("|---|---|---|---|---|---|")
    names = {
        "a2": "(a) FSDP2 + AdamW, Z2",
        "a3": "(a) FSDP2 + AdamW, Z3",
        "b": "(b) FSDP2 + naive Muon, Z2",
        "c2": "(c) dmuon_fn, Z2",
        "c3": "(c) dmuon_fn, Z3",
    }
    for k in names:
        x = r[k]
        print(
            f"| {names[k]} | {x['fb'] * 1e3:.0f} | {x['step'] * 1e3:.0f} "
            f"| {x['total'] / 2**20:.2f} | {x['step_bytes'] / 2**20:.2f} "
            f"| {x['muon'] / 2**20:.2f} |"
        )
    print(
        f"\nstep time (b)/(c): {r['b']['step'] / r['c2']['step']:.2f}x (Z2)   "
        f"total bytes (c)/(a): Z2 {r['c2']['total'] / r['a2']['total']:.3f}, "
        f"Z3 {r['c3']['total'] / r['a3']['total']:.3f}"
    )
    print(
        "(a)'s ModuleDict layers are skipped by fully_shard (torch 2.13), so all its params sit "
        "in the root group; reshard_after_forward is passed explicitly to every call."
    )


if __name__ == "__main__":
    main()
