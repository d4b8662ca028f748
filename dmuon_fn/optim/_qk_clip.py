"""QK-clip (MuonClip: Kimi K2, arXiv 2507.20534, §2.1). Muon lets attention logits grow; after
each optimizer step, a query head h whose largest pre-softmax logit S_h (softmax scale included,
over every token pair the step's data produced) exceeded τ gets its query and key rows scaled
so that the same input gives a largest logit of τ. Per query head h of key head j(h):

    γ_h = τ / S_h if S_h > τ (finite), else 1          clipped: S_h > τ
    key head j:     k_j = (min over j's query heads of γ_h)^(1−α)
    query head h:   γ_h^α if γ_h is that minimum, γ_h / k_j if clipped otherwise, else 1

so every logit of a clipped head scales by γ_h (its max lands on τ) and every logit of an
unclipped head by k_j ≤ 1 (its max stays ≤ S_h ≤ τ). With one query head per key head this is
MuonClip's γ^α, γ^(1−α). A factor of 1 leaves rows bitwise unchanged; a non-finite S_h leaves its
head alone. Proofs, and the rules for biases: proofs/qk_clip.md.

Layout: a weight or bias is read on its rows (dim 0) as nn.Linear stores it, head h = rows
h·d:(h+1)·d. The functions are pure and data-independent in Python (torch.where, no host sync),
so they trace under torch.compile(fullgraph=True); τ and α may be floats or 0-d tensors. In data
parallel, all-reduce the max logits with MAX before clipping, so every replica clips alike.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

Scalar = float | Tensor


class QKClip(NamedTuple):
    """qk_clip's result: the new tensors, the biases None where none were passed."""

    w_q: Tensor
    w_k: Tensor
    b_q: Tensor | None = None
    b_k: Tensor | None = None


def _check_hyper(tau: Scalar, alpha: Scalar) -> None:
    """A float τ must be > 0 and a float α in [0, 1]; a tensor's value is the caller's to check
    (reading it would sync with the device), its shape is checked here."""
    for name, x in (("tau", tau), ("alpha", alpha)):
        if isinstance(x, Tensor) and x.dim() != 0:
            raise ValueError(f"{name} must be a float or a 0-d tensor, got shape {tuple(x.shape)}")
    if not isinstance(tau, Tensor) and not tau > 0:
        raise ValueError(f"tau must be > 0 (the largest logit a head may keep), got {tau!r}")
    if not isinstance(alpha, Tensor) and not 0 <= alpha <= 1:
        raise ValueError(
            f"alpha must be in [0, 1] (the query's share of the clip; 0.5 splits it evenly), "
            f"got {alpha!r}"
        )


def _kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(kv, int) or kv < 1 or num_heads % kv:
        raise ValueError(
            f"num_kv_heads={kv!r} must be a positive int dividing num_heads={num_heads} (each key "
            f"head serves num_heads/num_kv_heads query heads); None means num_heads"
        )
    return kv


def _head_dim(x: Tensor, heads: int, name: str, what: str) -> int:
    if x.dim() < 1 or x.shape[0] % heads or x.shape[0] == 0:
        rows = x.shape[0] if x.dim() else "no"
        raise ValueError(
            f"{name} has {rows} rows, not a positive multiple of {what} = {heads}: pass it as "
            f"nn.Linear stores it, rows = heads·head_dim on dim 0"
        )
    return x.shape[0] // heads


def qk_clip_scales(
    max_logits: Tensor,
    *,
    tau: Scalar,
    alpha: Scalar = 0.5,
    num_heads: int,
    num_kv_heads: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(query factors (num_heads,), key factors (num_kv_heads,)) from the per-query-head max
    logits (num_heads,), in max_logits' dtype promoted to at least float32. Exactly 1 for every
    head the clip leaves alone. For weights stored some other way (e.g. sharded by rows): row
    block h of the query weight scales by the first, row block j of the key weight by the second.
    """
    _check_hyper(tau, alpha)
    kv = _kv_heads(num_heads, num_kv_heads)
    if tuple(max_logits.shape) != (num_heads,):
        raise ValueError(
            f"max_logits must have shape (num_heads,) = ({num_heads},), one max per query head "
            f"(max_logits() or LogitTracker.max), got {tuple(max_logits.shape)}"
        )
    dtype = torch.promote_types(max_logits.dtype, torch.float32)
    s = max_logits.to(dtype)
    tau = torch.as_tensor(tau, dtype=dtype, device=s.device)
    alpha = torch.as_tensor(alpha, dtype=dtype, device=s.device)
    clipped = torch.isfinite(s) & (s > tau)
    # ≥ the smallest normal: k_j > 0 below, so γ_h / k_j is finite (binds only at τ/S < 1e-38)
    gamma = torch.where(clipped, tau / torch.where(clipped, s, tau), 1.0)
    gamma = gamma.clamp(min=torch.finfo(dtype).tiny)
    low = gamma.view(kv, num_heads // kv).amin(dim=1)
    k = low.pow(1 - alpha)
    low_h, k_h = (x.repeat_interleave(num_heads // kv) for x in (low, k))
    q = torch.where(clipped, torch.where(gamma == low_h, gamma.pow(alpha), gamma / k_h), 1.0)
    return q, k


def _scale_rows(x: Tensor, per_block: Tensor) -> Tensor:
    """x with its rows in len(per_block) equal blocks, block i times per_block[i]; a block whose
    factor is 1 keeps its bits. The product is taken in the wider dtype, then cast to x's."""
    f = per_block.to(x.device).repeat_interleave(x.shape[0] // per_block.numel())
    f = f.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(f != 1, (x * f).to(x.dtype), x)


def qk_clip(
    w_q: Tensor,
    w_k: Tensor,
    max_logits: Tensor,
    *,
    tau: Scalar,
    alpha: Scalar = 0.5,
    num_heads: int,
    num_kv_heads: int | None = None,
    b_q: Tensor | None = None,
    b_k: Tensor | None = None,
) -> QKClip:
    """The clipped query and key weights (and biases). w_q (num_heads·d, hidden), w_k
    (num_kv_heads·d, hidden), b_q (num_heads·d,), b_k (num_kv_heads·d,), any float dtype; each
    result has its input's shape and dtype. max_logits (num_heads,): S_h on the step's data."""
    kv = _kv_heads(num_heads, num_kv_heads)
    d = _head_dim(w_q, num_heads, "w_q", "num_heads")
    if _head_dim(w_k, kv, "w_k", "num_kv_heads") != d:
        raise ValueError(
            f"w_q's head_dim {d} (rows / num_heads) differs from w_k's "
            f"{w_k.shape[0] // kv} (rows / num_kv_heads): check num_heads and num_kv_heads"
        )
    for name, b, w in (("b_q", b_q, w_q), ("b_k", b_k, w_k)):
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(
                f"{name} must have shape ({w.shape[0]},), one entry per row of its weight, "
                f"got {tuple(b.shape)}"
            )
    q, k = qk_clip_scales(
        max_logits, tau=tau, alpha=alpha, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    return QKClip(
        _scale_rows(w_q, q),
        _scale_rows(w_k, k),
        None if b_q is None else _scale_rows(b_q, q),
        None if b_k is None else _scale_rows(b_k, k),
    )


def qk_clip_fused(
    w_qkv: Tensor, max_logits: Tensor, *, num_heads: int, num_kv_heads: int | None = None, **clip
) -> Tensor:
    """The clipped fused projection: w_qkv ((num_heads + 2·num_kv_heads)·d, ...) with rows
    [q, k, v]; a fused weight (rows, hidden) or bias (rows,). The v rows keep their bits. A fused
    bias clips by the same call with the same max_logits. clip: tau= and alpha= (default 0.5), as
    `qk_clip` takes them."""
    kv = _kv_heads(num_heads, num_kv_heads)
    _head_dim(w_qkv, num_heads + 2 * kv, "w_qkv", "num_heads + 2·num_kv_heads")
    q, k = qk_clip_scales(max_logits, **clip, num_heads=num_heads, num_kv_heads=kv)
    return _scale_rows(w_qkv, torch.cat([q, k, torch.ones_like(k)]))


@dataclass(frozen=True)
class ClipHeads:
    """One attention's weights for the optimizer's QK-clip: the parameter names of its query and
    key weights (a fused qkv weight, rows [q, k, v]: q == k) and its head counts."""

    q: str
    k: str
    num_heads: int
    num_kv_heads: int | None = None


def check_clip_heads(
    heads: tuple[tuple[Hashable, ClipHeads], ...],
    matrices: Mapping[str, Sequence[int]],
    teams: Sequence[str] = (),
) -> None:
    """ValueError unless every weight `heads` names is one of `matrices` ({name: full shape} of
    the Muon matrices), not on a team (`teams`: no member holds whole heads), whose rows its
    head counts divide, q and k with one head_dim: the setup check both optimizer faces run, so
    a step never meets a weight it cannot clip."""
    for key, h in heads:
        kv = _kv_heads(h.num_heads, h.num_kv_heads)
        shared = [n for n in (h.q, h.k) if n in teams]
        if shared:
            raise ValueError(
                f"qk_clip_heads[{key!r}] names {shared[0]!r}, which the plan puts on a team "
                "(its slices on several owners, none holding whole heads): plan it whole with "
                f"teams={{{shared[0]!r}: 1}} (dedicate_params or plan)"
            )
        unknown = [n for n in (h.q, h.k) if n not in matrices]
        if unknown:
            raise ValueError(
                f"qk_clip_heads[{key!r}] names {unknown[0]!r}, not Muon matrices of the plan: "
                "name the query and key weights (a fused qkv weight as q and k)"
            )
        rows = {n: int(matrices[n][0]) for n in (h.q, h.k)}
        if h.q == h.k:
            dims = [rows[h.q] / (h.num_heads + 2 * kv)]
        else:
            dims = [rows[h.q] / h.num_heads, rows[h.k] / kv]
        if any(d != int(d) or d < 1 for d in dims) or len(set(dims)) > 1:
            raise ValueError(
                f"qk_clip_heads[{key!r}]: rows {rows} do not split into heads of one head_dim "
                f"with num_heads={h.num_heads}, num_kv_heads={kv} (a fused weight: rows "
                "(num_heads + 2·num_kv_heads)·head_dim): check the head counts"
            )


def clip_params(
    heads: tuple[tuple[Hashable, ClipHeads], ...],
    maxes: Tensor,
    tau: Scalar,
    alpha: Scalar,
    params: dict[str, Tensor],
) -> dict[str, Tensor]:
    """The clipped values of `params` (name -> held value; the q/k weights this rank updates),
    from `maxes`, every attention's max logits concatenated in `heads`' order (every rank's:
    all-reduced with MAX)."""
    out, at = {}, 0
    for _, h in heads:
        m = maxes[at : at + h.num_heads]
        at += h.num_heads
        counts = {"num_heads": h.num_heads, "num_kv_heads": h.num_kv_heads}
        if h.q == h.k:
            if h.q in params:
                out[h.q] = qk_clip_fused(params[h.q], m, tau=tau, alpha=alpha, **counts)
        elif h.q in params or h.k in params:  # both from one computation of the factors
            q, k = qk_clip_scales(m, tau=tau, alpha=alpha, **counts)
            out.update(
                (n, _scale_rows(params[n], f)) for n, f in ((h.q, q), (h.k, k)) if n in params
            )
    return out


def stacked_maxes(
    heads: tuple[tuple[Hashable, ClipHeads], ...], given: Mapping[Hashable, Tensor], device
) -> Tensor:
    """Every attention's max logits in `heads`' order, concatenated (float32; -inf for an
    attention not in `given`: nothing observed here)."""
    parts = []
    for key, h in heads:
        m = given.get(key)
        if m is None:
            m = torch.full((h.num_heads,), -math.inf, device=device)
        elif tuple(m.shape) != (h.num_heads,):
            raise ValueError(
                f"max logits of {key!r} have shape {tuple(m.shape)}, its ClipHeads says "
                f"num_heads={h.num_heads}"
            )
        parts.append(m.to(device, torch.float32))
    return torch.cat(parts)


def max_logits(
    q: Tensor,
    k: Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: Tensor | None = None,
    max_block: int = 1 << 26,
) -> Tensor:
    """The largest logit scale·q·kᵀ per query head over batch and token pairs: shape (H,), dtype
    q's promoted to at least float32; -inf for a head with no pair. q (B, H, T, d), k (B, Hkv, S,
    d), H a multiple of Hkv (query head h reads key head h // (H/Hkv)); scale 1/sqrt(d) by default.
    causal (as scaled_dot_product_attention's is_causal: query t sees keys s ≤ t) and a bool mask
    broadcastable to (B, H, T, S) (True: the pair takes part) restrict the pairs. Query rows go in
    chunks of at most max_block logits (at least one row per chunk; 2^26: 256 MiB in float32), so
    no (B, H, T, S) block is materialized beyond one chunk. Under torch.compile the chunk loop
    unrolls and specializes on T and S (one graph per sequence length). No autograd: the inputs
    are detached."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q must be (B, H, T, d) and k (B, Hkv, S, d) with the same B and d, got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    (b, h, t, d), (hkv, s) = q.shape, k.shape[1:3]
    if h % hkv:
        raise ValueError(f"q's {h} heads must be a multiple of k's {hkv} (grouped-query heads)")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(
                f"mask must be a bool tensor (True: the pair takes part), got {mask.dtype}; "
                f"an additive bias does not scale with the q/k weights"
            )
        full = (b, h, t, s)
        tail = full[max(0, 4 - mask.dim()) :]
        if mask.dim() > 4 or any(m not in (1, f) for m, f in zip(mask.shape, tail, strict=True)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = {full}"
            )
        mask = mask.expand(full)
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = 1 / math.sqrt(d) if scale is None else scale
    g = h // hkv
    kf = k.detach().to(dtype).unsqueeze(2)  # (B, Hkv, 1, S, d)
    rows = max(1, max_block // max(1, b * h * s))
    out = torch.full((h,), -math.inf, dtype=dtype, device=q.device)
    for t0 in range(0, t, rows):
        qb = q.detach()[:, :, t0 : t0 + rows].to(dtype).unflatten(1, (hkv, g))
        logits = (qb @ kf.transpose(-1, -2)) * scale  # (B, Hkv, g, rows, S)
        keep = None if mask is None else mask[:, :, t0 : t0 + rows].unflatten(1, (hkv, g))
        if causal:
            pos = torch.arange(t0, t0 + qb.shape[3], device=q.device)
            tri = torch.arange(s, device=q.device) <= pos[:, None]
            keep = tri if keep is None else keep & tri
        if keep is not None:
            logits = logits.masked_fill(~keep, -math.inf)
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)).flatten())
    return out


class LogitTracker:
    """Running per-query-head max logits, one entry per key (e.g. a layer's name), kept on
    device with torch.maximum: call `observe` in the attention forward, read `max` after the
    step, `reset` before the next. Several forwards (gradient accumulation, activation
    checkpointing's recompute) fold into the same max. Works under torch.compile(fullgraph=True);
    `reset` keeps the keys (their entries back to -inf), so a compiled forward is not retraced."""

    def __init__(self) -> None:
        self._max: dict[Hashable, Tensor] = {}

    def observe(self, key: Hashable, q: Tensor, k: Tensor, **kw: Any) -> None:
        """Folds max_logits(q, k, **kw) (shape (H,)) into key's entry; adds nothing to autograd."""
        m = max_logits(q, k, **kw)
        self._max[key] = torch.maximum(self._max[key], m) if key in self._max else m

    def max(self, key: Hashable) -> Tensor:
        """key's per-query-head max (H,) since the last reset (-inf: nothing observed)."""
        return self._max[key]

    def keys(self) -> list[Hashable]:
        return list(self._max)

    def clear(self) -> None:
        """Forget every key. A functional loss_fn reads `maxima()`, clears, and returns the
        maxima as its aux: what the forward makes inside a torch.func transform may leave it
        only through its outputs."""
        self._max.clear()

    def maxima(self) -> dict[Hashable, Tensor]:
        """{key: its max} for every key observed since the tracker was made."""
        return dict(self._max)

    def reset(self) -> None:
        self._max = {key: torch.full_like(m, -math.inf) for key, m in self._max.items()}
