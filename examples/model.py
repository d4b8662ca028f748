"""The Quick Start's model, shared by the example scripts."""

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    def __init__(self, d: int = 512, ff: int = 2048, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {
                        "gate_proj": nn.Linear(d, ff, bias=False),
                        "up_proj": nn.Linear(d, ff, bias=False),
                        "down_proj": nn.Linear(ff, d, bias=False),
                        "ln": nn.LayerNorm(d),
                    }
                )
                for _ in range(n_layers)
            ]
        )
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer["ln"](x)
            x = x + layer["down_proj"](layer["gate_proj"](h) * layer["up_proj"](h))
        return self.head(x).sum()
