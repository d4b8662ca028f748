"""What the character-level training examples share (train_gpt.py, train_moe.py): the encoding
of the grammar corpus, the train and validation rows each rank reads, the lr schedule."""

from __future__ import annotations

import math

import torch
from data.grammar import corpus

VOCAB = 96  # "\n" -> 0, printable ASCII " ".."~" -> 1..95


def encode(text: str) -> torch.Tensor:
    b = torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()
    return torch.where(b == 10, 0, b - 31)


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """Rows data[s : s + seq + 1]: seq inputs and their next-character targets."""
    return data[starts[:, None] + torch.arange(seq + 1)]


def train_batch(data: torch.Tensor, step: int, args, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of global batch `step`: the same for every run with the same seed."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
    per = args.batch // world
    return windows(data, starts[rank * per : (rank + 1) * per], args.seq)


def schedule(args):
    """Linear warmup, then cosine decay to a tenth: the same shape for both optimizers."""
    warm = max(1, round(args.warmup * args.steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, args.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return factor


def split(
    args, rank: int, world: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train characters, validation characters, this rank's share of the `args.val_rows`
    validation rows, on `device`) of a corpus of `args.chars` characters of seed `args.seed`."""
    if args.batch % world or args.val_rows % world:
        raise ValueError(
            f"--batch {args.batch} and --val-rows {args.val_rows} must be multiples of the world "
            f"size {world}"
        )
    data = encode(corpus(args.chars, seed=args.seed))
    cut = int(0.9 * len(data))
    train_data, val_data = data[:cut], data[cut:]
    per = args.val_rows // world
    starts = torch.linspace(0, len(val_data) - args.seq - 2, args.val_rows).long()
    val_rows = windows(val_data, starts[rank * per : (rank + 1) * per], args.seq).to(device)
    return train_data, val_data, val_rows
