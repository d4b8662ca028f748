"""Layer keys (proofs/partition.md §4): the layer each dedicated parameter belongs to, by its
name, for the planner's spreading and the object face's per-layer gathers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable


def _numeric(part: str) -> bool:
    return part.isascii() and part.isdigit()


def layer_keys(names: Iterable[str]) -> dict[str, str]:
    """Layer key of each name: the prefix up to its outermost numeric component whose siblings
    take two or more values (`model.0.layers.3`), else up to its outermost numeric component, else
    the parent module (`lm_head`); proofs/partition.md §4."""
    split = {n: n.split(".") for n in names}
    seen: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for parts in split.values():
        for i, p in enumerate(parts[:-1]):
            if _numeric(p):
                seen[tuple(parts[:i])].add(p)
    keys = {}
    for n, parts in split.items():
        idx = [i for i, p in enumerate(parts[:-1]) if _numeric(p)]
        rep = [i for i in idx if len(seen[tuple(parts[:i])]) > 1]
        cut = rep[0] + 1 if rep else idx[0] + 1 if idx else len(parts) - 1
        keys[n] = ".".join(parts[:cut])
    return keys
