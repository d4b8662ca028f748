"""How a parameter is made of matrices, and Newton-Schulz on each of them (proofs/blocks.md).

A `Blocks` spec reads a parameter as independent matrix blocks: with `batch` = K, a tensor
(*lead, m, n) whose K leading dims index separate (m, n) matrices (MoE experts); with `flatten`,
(d0, *rest) as one (d0, prod(rest)) matrix (conv weights). Each matrix may then be split along
its rows or columns: by explicit sizes (fused qkv, gate_up), into H equal contiguous blocks
(heads), or into S interleaved blocks (block j = indices j::S). Every block is orthogonalized
on its own.

Grammar (`str(spec)` writes it, `Blocks.parse` reads it back; only this form is accepted):

    spec  := "matrix" | "flatten" | "batch" K | ["batch" K ","] axis split
    axis  := "rows" | "cols"
    split := "=" N "+" N ["+" N]...     explicit sizes, in order along the axis
           | "/" H                      H equal contiguous blocks
           | "%" S                      S interleaved blocks: block j = indices j::S
    K, N ≥ 1 and H, S ≥ 2: decimal, no sign, no leading zero, no spaces

    "matrix"               (m, n): one matrix (a 2-D parameter's default)
    "flatten"              (d0, d1, ...): one (d0, d1·...) matrix (a conv weight's default)
    "batch1"               (E, m, n): E matrices (the default of a 3-D non-conv parameter)
    "rows=64+16+16"        fused qkv with GQA: q, k and v row blocks
    "batch1,rows=768+768"  Qwen3-MoE experts.gate_up_proj (128, 1536, 2048): 256 (768, 2048)
    "batch1,cols%2"        gpt-oss experts.gate_up_proj (32, 2880, 5760): gate [..., 0::2],
                           up [..., 1::2], 64 (2880, 2880) blocks
    "rows/32", "cols/32"   q_proj per head (rows), o_proj per head (columns)
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch import Tensor

from ._orthogonalize import NSConfig, orthogonalize_with

_AXES = ("rows", "cols")
_N = "[1-9][0-9]*"
_BATCH = re.compile(f"batch({_N})")
_SPLIT = re.compile(rf"(rows|cols)(?:=({_N}(?:\+{_N})+)|/({_N})|%({_N}))")
_FORMS = "matrix, flatten, batchK, [batchK,]rows|cols=N+N..., rows|cols/H or rows|cols%S"


def _count(value: object, what: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True)
class Blocks:
    """How a parameter is made of matrices; the module docstring gives the grammar.

    batch: leading dims that index independent matrices (0: the parameter is one matrix).
    flatten: (d0, *rest) is one (d0, prod(rest)) matrix; takes no batch and no split.
    axis: "rows" or "cols", the axis of each matrix that `sizes`, `heads` or `stride` splits.
    sizes: block sizes in order along the axis (two or more). heads: that many equal
    contiguous blocks. stride: that many interleaved blocks (block j = indices j::stride).
    """

    batch: int = 0
    flatten: bool = False
    axis: str | None = None
    sizes: tuple[int, ...] = ()
    heads: int = 0
    stride: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(self.sizes))
        _count(self.batch, "batch", 0)
        _count(self.heads, "heads", 0)
        _count(self.stride, "stride", 0)
        for s in self.sizes:
            _count(s, "each of sizes", 1)
        if not isinstance(self.flatten, bool):
            raise ValueError(f"flatten must be a bool, got {self.flatten!r}")
        ways = [f for f in ("sizes", "heads", "stride") if getattr(self, f)]
        if len(ways) > 1:
            raise ValueError(f"one split per matrix: give one of sizes, heads, stride, not {ways}")
        if self.axis not in (None, *_AXES):
            raise ValueError(f"axis must be 'rows', 'cols' or None, got {self.axis!r}")
        if (self.axis is None) != (not ways):
            raise ValueError(
                "a split needs both an axis ('rows' or 'cols') and one of sizes, heads, stride; "
                f"got axis={self.axis!r} with {ways or 'no split'}"
            )
        if self.flatten and (self.batch or self.axis):
            raise ValueError(
                "flatten makes one (d0, d1·...) matrix and takes no batch or split: for a batch "
                "of matrices write 'batchK', for blocks of a matrix e.g. 'rows/H'"
            )
        if len(self.sizes) == 1 or 1 in (self.heads, self.stride):
            raise ValueError(
                f"{self.axis} split into one block is the whole matrix: write "
                f"{str(replace(self, axis=None, sizes=(), heads=0, stride=0))!r} "
                "or split into two or more blocks"
            )

    def __str__(self) -> str:
        if self.flatten:
            return "flatten"
        parts = [f"batch{self.batch}"] if self.batch else []
        if self.sizes:
            parts.append(f"{self.axis}=" + "+".join(map(str, self.sizes)))
        elif self.heads:
            parts.append(f"{self.axis}/{self.heads}")
        elif self.stride:
            parts.append(f"{self.axis}%{self.stride}")
        return ",".join(parts) or "matrix"

    @classmethod
    def parse(cls, text: str) -> Blocks:
        """The spec `text` writes (the inverse of `str`); ValueError if it is not in the grammar."""
        if text in ("matrix", "flatten"):
            return cls(flatten=text == "flatten")
        words = text.split(",") if isinstance(text, str) else []
        batch = _BATCH.fullmatch(words[0]) if len(words) in (1, 2) else None
        split = _SPLIT.fullmatch(words[-1]) if words and (len(words) == 1 or batch) else None
        if not (batch or split) or (len(words) == 2 and not split):
            raise ValueError(f"blocks spec {text!r} is not one of: {_FORMS} (e.g. 'batch1,cols%2')")
        b = int(batch.group(1)) if batch else 0
        if not split:
            return cls(batch=b)
        axis, sizes, heads, stride = split.groups()
        return cls(
            batch=b,
            axis=axis,
            sizes=tuple(int(s) for s in sizes.split("+")) if sizes else (),
            heads=int(heads or 0),
            stride=int(stride or 0),
        )


def default_blocks(shape: Sequence[int], *, conv: bool) -> Blocks:
    """A conv weight: "flatten" (its (out, in·kh·kw) matrix); otherwise every leading dim beyond
    the last two indexes separate matrices ("batch1" for 3-D, "matrix" for 2-D)."""
    return Blocks(flatten=True) if conv else Blocks(batch=max(len(shape) - 2, 0))


def _divisor_near(length: int, want: int) -> int:
    return min((d for d in range(2, length + 1) if length % d == 0), key=lambda d: abs(d - want))


def check(spec: Blocks | str, shape: Sequence[int], name: str) -> Blocks:
    """`spec` (a Blocks or its string) validated against the parameter `name` of `shape`;
    ValueError naming the parameter and what to write instead if it does not fit."""
    shape = tuple(int(d) for d in shape)
    where = f"{name} of shape {shape}"
    if isinstance(spec, str):
        try:
            spec = Blocks.parse(spec)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    nd = len(shape)
    if nd < 2:
        raise ValueError(f"{where}: blocks {spec} needs 2 or more dims (1-D is AdamW's)")
    if spec.flatten:
        return spec
    if nd - spec.batch != 2:
        fix = repr(str(replace(spec, batch=nd - 2)))
        if nd > 2 and not spec.axis:
            fix += " (matrices over the leading dims) or 'flatten' (one matrix, as conv weights)"
        raise ValueError(
            f"{where}: blocks {spec} leaves {nd - spec.batch} of its {nd} dims to each matrix, "
            f"not 2: write {fix}"
        )
    if spec.axis is None:
        return spec
    length = shape[-2] if spec.axis == "rows" else shape[-1]
    its = f"its {length} {spec.axis}"
    if spec.sizes and sum(spec.sizes) != length:
        raise ValueError(
            f"{where}: blocks {spec} has sizes summing to {sum(spec.sizes)}, not {its}: write "
            f"sizes that sum to {length}"
        )
    count = spec.heads or spec.stride
    if count and length % count:
        verb, sign = ("divide", "/") if spec.heads else ("tile", "%")
        fix = (
            f"a count that divides {length}, e.g. '{spec.axis}{sign}{_divisor_near(length, count)}'"
            if length > 1
            else repr(str(replace(spec, axis=None, heads=0, stride=0)))
        )
        raise ValueError(f"{where}: blocks {spec}: {count} blocks do not {verb} {its}: write {fix}")
    return spec


@dataclass(frozen=True)
class _Layout:
    """A checked spec on a shape: the tensor read as (B, L, W), each matrix transposed first when
    the split runs along columns (`cols`), so blocks always split L. groups: (size, runs) per
    distinct block size in order of first appearance, runs the (start, count) of its adjacent
    blocks along L; `stride` > 0 instead: L holds that many interleaved blocks."""

    B: int
    m: int
    n: int
    cols: bool
    stride: int
    groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    @property
    def L(self) -> int:
        return self.n if self.cols else self.m

    @property
    def W(self) -> int:
        return self.m if self.cols else self.n

    def shapes(self) -> list[tuple[int, tuple[int, int]]]:
        sizes = [(self.stride, self.L // self.stride)] if self.stride else []
        sizes += [(sum(c for _, c in runs), size) for size, runs in self.groups]
        return [(self.B * c, (self.W, s) if self.cols else (s, self.W)) for c, s in sizes]


def _layout(spec: Blocks, shape: Sequence[int]) -> _Layout:
    spec = check(spec, shape, "a tensor")
    shape = tuple(int(d) for d in shape)
    if spec.flatten:
        B, m, n = 1, shape[0], math.prod(shape[1:])
    else:
        B, (m, n) = math.prod(shape[:-2]), shape[-2:]
    cols = spec.axis == "cols"
    L = n if cols else m
    sizes = spec.sizes or ((L // spec.heads,) * spec.heads if spec.heads else (L,))
    groups: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for i, size in enumerate(() if spec.stride else sizes):
        runs = groups.setdefault(size, [])
        if i and sizes[i - 1] == size:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)  # adjacent to the previous block: one run
        else:
            runs.append((start, 1))
        start += size
    return _Layout(B, m, n, cols, spec.stride, tuple((s, tuple(r)) for s, r in groups.items()))


def block_shapes(spec: Blocks, shape: Sequence[int]) -> list[tuple[int, tuple[int, int]]]:
    """(count, (m, n)) per distinct block shape of a parameter of `shape`, in `to_blocks`' order
    (first appearance along the split axis); the counts sum to the number of blocks."""
    return _layout(spec, shape).shapes()


def block_count(spec: Blocks, shape: Sequence[int]) -> int:
    """How many matrices a parameter of `shape` read as `spec` is."""
    return sum(k for k, _ in block_shapes(spec, shape))


def to_blocks(x: Tensor, spec: Blocks) -> list[Tensor]:
    """x's blocks: one (k, m, n) tensor per entry of `block_shapes(spec, x.shape)`, in its order,
    k running over the batch (outer) then the blocks' order along the axis (inner). Views of x
    where strides allow (a batch, equal contiguous blocks of rows, any split of one matrix)."""
    lay = _layout(spec, x.shape)
    B, L, W = lay.B, lay.L, lay.W
    xt = x.reshape(B, lay.m, lay.n)
    xt = xt.mT if lay.cols else xt
    if lay.stride:
        S = lay.stride
        parts = [xt.reshape(B, L // S, S, W).transpose(1, 2).reshape(B * S, L // S, W)]
    else:
        parts = []
        for size, runs in lay.groups:
            slabs = [xt.narrow(1, start, c * size).reshape(B, c, size, W) for start, c in runs]
            count = sum(c for _, c in runs)
            part = slabs[0] if len(slabs) == 1 else torch.cat(slabs, dim=1)
            parts.append(part.reshape(B * count, size, W))
    return [p.mT for p in parts] if lay.cols else parts


def from_blocks(parts: Sequence[Tensor], spec: Blocks, shape: Sequence[int]) -> Tensor:
    """The tensor of `shape` whose `to_blocks` are `parts` (its exact inverse)."""
    lay = _layout(spec, shape)
    got = [tuple(p.shape) for p in parts]
    want = [(c, *s) for c, s in lay.shapes()]
    if got != want:
        raise ValueError(f"blocks {spec} of shape {tuple(shape)} are {want}, got {got}")
    B, L, W = lay.B, lay.L, lay.W
    pt = [p.mT for p in parts] if lay.cols else list(parts)
    if lay.stride:
        S = lay.stride
        xt = pt[0].reshape(B, S, L // S, W).transpose(1, 2).reshape(B, L, W)
    else:
        slabs = []
        for (size, runs), p in zip(lay.groups, pt, strict=True):
            p4, at = p.reshape(B, sum(c for _, c in runs), size, W), 0
            for start, c in runs:
                slabs.append((start, p4.narrow(1, at, c).reshape(B, c * size, W)))
                at += c
        slabs.sort(key=lambda s: s[0])
        xt = slabs[0][1] if len(slabs) == 1 else torch.cat([s for _, s in slabs], dim=1)
    return (xt.mT if lay.cols else xt).reshape(shape)


def orthogonalize_blocks(
    G: Tensor,
    spec: Blocks,
    cfg: NSConfig,
    *,
    scale: Callable[[int, int], float] | None = None,
) -> Tensor:
    """Each block of G (any floating dtype) orthogonalized on its own, blocks of one shape in one
    batched `orthogonalize_with` call, each result times `scale(m, n)` of its block's shape if
    given; G's shape and dtype. A spec of one block ("matrix", "flatten") gives bitwise
    `orthogonalize_with(G.reshape(d0, -1), cfg).reshape(G.shape)`."""
    out = []
    for p in to_blocks(G, spec):
        # one block runs as the 2-D matrix it is, exactly as an unsplit parameter always has
        O = orthogonalize_with(p[0], cfg)[None] if p.shape[0] == 1 else orthogonalize_with(p, cfg)
        out.append(O if scale is None else O.mul_(scale(p.shape[-2], p.shape[-1])))
    return from_blocks(out, spec, G.shape)


def model_blocks(
    model: nn.Module, matrices: Collection[str], given: Mapping[str, Blocks | str] | None
) -> dict[str, Blocks | str]:
    """The specs the faces plan `matrices` (names of `model`'s Muon parameters) with: `given`'s
    keys are names or fnmatch patterns (the first that matches a name wins), a conv weight not
    given is "flatten"; names left out take `partition`'s default. ValueError for a key that
    matches none of `matrices`."""
    convs = {
        f"{prefix}.weight".lstrip(".")
        for prefix, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, nn.modules.conv._ConvNd)
    }
    out: dict[str, Blocks | str] = {}
    for key, spec in (given or {}).items():
        hits = [n for n in matrices if fnmatch.fnmatchcase(n, key)]
        if not hits:
            raise ValueError(
                f"blocks: {key!r} names none of the Muon matrices; keys are parameter names or "
                f"fnmatch patterns of them, e.g. '*.experts.gate_up_proj'"
            )
        out.update((n, spec) for n in hits if n not in out)
    out.update((n, Blocks(flatten=True)) for n in matrices if n in convs and n not in out)
    return out
