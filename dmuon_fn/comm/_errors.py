"""Collective failures that name the phase they happened in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, hung, or ran a different program."""


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Re-raise a failing collective as a `CollectiveError` naming `what` (timeout: the group's)."""
    try:
        yield
    except (RuntimeError, TimeoutError) as e:  # DistBackendError/DistError derive from these
        if isinstance(e, CollectiveError | torch.OutOfMemoryError):
            raise  # already named, or not the collective's fault (callers catch OOM by type)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"dmuon_fn: a collective failed on rank {rank} during {what}: {e}. A peer rank "
            "died, timed out (init_process_group(timeout=...)), or took a different path"
        ) from e
