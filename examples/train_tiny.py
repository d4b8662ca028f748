"""A small single-process training run: dmuon_fn's pure Muon/AdamW updates vs plain AdamW.

A student MLP (the Quick Start's TinyMLP layout: gate/up/down projections, LayerNorm, head)
learns a fixed random teacher of the same shape by regression. Matrices ("proj" weights) take
`dmuon_fn.muon_update`; everything else `dmuon_fn.adamw_update`. The baseline trains the same
initial weights with torch.optim.AdamW. Prints the loss every `--log` steps and a summary.

Run: python examples/train_tiny.py [--steps 300]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import dmuon_fn


class TinyMLP(nn.Module):
    def __init__(self, d: int = 128, ff: int = 512, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(d, ff, bias=False),
                    "up_proj": nn.Linear(d, ff, bias=False),
                    "down_proj": nn.Linear(ff, d, bias=False),
                    "ln": nn.LayerNorm(d),
                }
            )
            for _ in range(n_layers)
        )
        self.head = nn.Linear(d, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer["ln"](x)
            x = x + layer["down_proj"](
                torch.nn.functional.silu(layer["gate_proj"](h)) * layer["up_proj"](h)
            )
        return self.head(x)


def is_muon(name: str, p: torch.Tensor) -> bool:
    return "proj" in name and p.ndim == 2


def train_dmuon(model, teacher, data, steps, log):
    params = dict(model.named_parameters())
    state = {
        n: dmuon_fn.muon_init(p) if is_muon(n, p) else dmuon_fn.adamw_init(p)
        for n, p in params.items()
    }
    muon_lr, adamw_lr = torch.tensor(0.02), torch.tensor(3e-3)
    losses = []
    for step in range(steps):
        x = data(step)
        loss = nn.functional.mse_loss(model(x), teacher(x))
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for n, p in params.items():
                if is_muon(n, p):
                    new, state[n] = dmuon_fn.muon_update(
                        p, p.grad, state[n], lr=muon_lr, weight_decay=0.01
                    )
                else:
                    new, state[n] = dmuon_fn.adamw_update(p, p.grad, state[n], lr=adamw_lr)
                p.copy_(new)
        losses.append(loss.item())
        if step % log == 0 or step == steps - 1:
            print(f"  dmuon_fn  step {step:4d}  loss={loss.item():.5f}", flush=True)
    return losses


def train_adamw(model, teacher, data, steps, log):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x = data(step)
        loss = nn.functional.mse_loss(model(x), teacher(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % log == 0 or step == steps - 1:
            print(f"  AdamW     step {step:4d}  loss={loss.item():.5f}", flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    teacher = TinyMLP().requires_grad_(False)
    init = TinyMLP().state_dict()

    def data(step: int) -> torch.Tensor:
        return torch.randn(64, 128, generator=torch.Generator().manual_seed(step))

    print(dmuon_fn.get_ns_backend())
    results = {}
    for name, fn in (("dmuon_fn", train_dmuon), ("AdamW", train_adamw)):
        model = TinyMLP()
        model.load_state_dict(init)
        t0 = time.perf_counter()
        losses = fn(model, teacher, data, args.steps, args.log)
        results[name] = (losses, time.perf_counter() - t0)
    print("\n| optimizer | final loss (mean of last 20) | wall s |")
    print("|---|---|---|")
    for name, (losses, secs) in results.items():
        tail = losses[-20:]
        print(f"| {name} | {sum(tail) / len(tail):.5f} | {secs:.1f} |")


if __name__ == "__main__":
    main()
