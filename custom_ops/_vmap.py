"""vmap rules for the ops that already batch over leading dims: move the vmapped dim to the front
(materializing an unbatched operand along it) and call the op once."""

from __future__ import annotations

from torch import Tensor


def batch_first(x: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    if x is None:
        return None
    if bdim is None:
        return x.unsqueeze(0).expand(size, *x.shape)
    return x.movedim(bdim, 0)
