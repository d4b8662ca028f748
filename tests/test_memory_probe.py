"""The peak-memory probe (examples/benchmarks/_memory.py) sees every free of a gathered copy,
also when gloo's worker thread would drop the last reference: a copy dropped right after its
broadcast is never counted as live again."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import custom_ops  # noqa: F401  (registers torch.ops.dmuon)
from tests._dist import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
from _memory import peak_bytes

ROUTE = [0, 1, 2, 0, 1, 1]  # from group rank 0, over a group of 2


def _drop_each(rank, world, rounds):
    group = torch.distributed.group.WORLD.group_name
    route = [ROUTE[0], int(rank == 0), *ROUTE[2:]]

    def run():
        sizes = []
        for i in range(rounds):
            n = 256 + 64 * (i % 7)  # sizes vary, so an address is not always handed straight back
            local = torch.full((n,), 1.0) if rank == 0 else torch.empty(0)
            (copy,) = torch.ops.dmuon.owner_broadcast([local], [n], [1], route, group)
            assert copy[0].item() == 1.0
            sizes.append(copy.nbytes)
            del copy  # dropped at once: gloo's worker may still hold it
        return max(sizes)

    largest, mem = peak_bytes(run)
    return largest, mem["gathered"]


def test_every_dropped_copy_is_seen_freed():
    for largest, gathered in run_ranks(_drop_each, 2, 200):
        assert gathered == largest, (gathered, largest)
