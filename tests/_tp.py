"""A small transformer for the tensor-parallel tests, its TP plan, and test-only gathers.

Block 0 is tensor parallel (attention heads and MLP split: ColwiseParallel q/k/v/up, RowwiseParallel
o/down, with biases on the MLP: Shard(0) and Replicate()); block 1 is left replicated; the head
is ColwiseParallel over an odd vocabulary (uneven shards, 25 and 24 rows over two ranks) with
its output replicated. The same model unparallelized is the single-process reference.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests._models import Block

V, D, HEADS = 49, 32, 4


class TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(D, HEADS) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def parallelize(model: TPModel, tp_mesh) -> TPModel:
    """Block 0 and the head tensor parallel; block 1 left replicated."""
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {f"layers.0.{n}": col for n in ("q_proj", "k_proj", "v_proj", "up_proj")}
    plan.update({"layers.0.o_proj": row, "layers.0.down_proj": row})
    plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(model, tp_mesh, plan)


def tokens(step: int, data_rank: int = 0, data_size: int = 1) -> torch.Tensor:
    """Data rank `data_rank`'s rows of step `step`'s global batch of 8 sequences (equal parts,
    so the mean of the ranks' losses is the global batch's for 1, 2, 4 or 8 data ranks)."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = 8 // data_size
    return torch.randint(0, V, (8, 8), generator=g)[data_rank * rows : (data_rank + 1) * rows]


def is_matrix(name: str, p: torch.Tensor) -> bool:
    """The dedicated matrices (the embedding is left to FSDP2 and AdamW)."""
    return p.ndim == 2 and "embed" not in name
