"""Pure Muon and AdamW updates over tensors: (param, grad, state) -> (new param, new state).

Nothing is mutated. Per-step values (lr, weight decay, the step count in AdamW's state) may be
0-d tensors, so a compiled step never recompiles as a schedule changes them.

Muon, per matrix W (m×n after flattening trailing dims), gradient g (DESIGN.md, "The math"):
    buf ← μ·buf + g                       (first step: buf = g, since buf starts at zero)
    u   ← g + μ·buf  if nesterov else buf
    O   ← orthogonalize(u)
    W   ← W·(1 − lr·wd) − lr·scale(m, n)·O
with scale "match_rms_adamw" = 0.2·sqrt(max(m, n)) (default) or "original" = sqrt(max(1, m/n)).

AdamW (decoupled weight decay, as torch.optim.AdamW):
    t ← t + 1;  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
    W ← W·(1 − lr·wd) − lr/(1−β₁ᵗ) · m / (sqrt(v)/sqrt(1−β₂ᵗ) + eps)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns._orthogonalize import NSConfig, orthogonalize_with

Scalar = float | Tensor

_SCALES = ("match_rms_adamw", "original")


def on_device(x: Scalar, device: torch.device) -> Scalar:
    """A tensor hyperparameter moved to the parameter's device (floats stay floats), so that a
    compiled step's scalar arithmetic runs there (pytorch/pytorch#121374, proofs/step_notes.md)."""
    if isinstance(x, Tensor) and x.device != device:
        return x.to(device)
    return x


class MuonState(NamedTuple):
    momentum: Tensor  # same shape as the parameter


class AdamWState(NamedTuple):
    step: Tensor  # 0-d float32: steps taken so far
    exp_avg: Tensor
    exp_avg_sq: Tensor


# The optimizer state's names in a state dict (the object API's `optimizer.state[p]`, and both
# faces' checkpoints), per field of the pure states, in field order.
STATE_KEYS: dict[type, tuple[str, ...]] = {
    MuonState: ("momentum_buffer",),
    AdamWState: AdamWState._fields,
}


# A param group's kind -> its pure state.
KINDS: dict[str, type] = {"muon": MuonState, "adamw": AdamWState}


def state_items(state: MuonState | AdamWState) -> dict[str, Tensor]:
    """A pure state as a state dict's entries ({"momentum_buffer": ...} for Muon)."""
    return dict(zip(STATE_KEYS[type(state)], state, strict=True))


def state_from(kind: type, items: dict[str, Tensor]) -> MuonState | AdamWState:
    """The pure state of `kind` (MuonState or AdamWState) from a state dict's entries."""
    return kind(*(items[k] for k in STATE_KEYS[kind]))


def lr_scale(shape: torch.Size | tuple[int, ...], adjust_lr: str = "match_rms_adamw") -> float:
    """The per-matrix LR multiplier for a parameter of `shape` (trailing dims flattened)."""
    if adjust_lr not in _SCALES:
        raise ValueError(f"adjust_lr must be one of {_SCALES}, got {adjust_lr!r}")
    m, n = shape[0], math.prod(shape[1:])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1.0, m / n))


def muon_init(param: Tensor, *, dtype: torch.dtype | None = None) -> MuonState:
    """Zero momentum in `dtype` (default: the parameter's)."""
    return MuonState(torch.zeros_like(param, dtype=dtype or param.dtype))


def _check_matrix(param: Tensor, grad: Tensor) -> None:
    if param.dim() < 2:
        raise ValueError(
            f"Muon updates matrices (2-D or more, trailing dims flattened); got a "
            f"{param.dim()}-D parameter of shape {tuple(param.shape)}: use adamw_update for it"
        )
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")


def muon_update(
    param: Tensor,
    grad: Tensor,
    state: MuonState,
    *,
    lr: Scalar,
    weight_decay: Scalar = 0.0,
    momentum: float = 0.95,
    nesterov: bool = True,
    adjust_lr: str = "match_rms_adamw",
    ns: NSConfig = NSConfig(),  # noqa: B008  (frozen, immutable)
) -> tuple[Tensor, MuonState]:
    """One Muon step for one matrix parameter. Returns (new param, new state)."""
    _check_matrix(param, grad)
    u, new_state = muon_momentum(grad, state, momentum=momentum, nesterov=nesterov)
    # With Nesterov, u is a temporary: orthogonalize may normalize in its buffer and return it.
    O = orthogonalize_with(u.reshape(u.shape[0], -1), ns, overwrite=nesterov)
    new = muon_apply(
        param, O.reshape(param.shape), lr=lr, weight_decay=weight_decay, adjust_lr=adjust_lr
    )
    return new, new_state


def muon_momentum(
    grad: Tensor, state: MuonState, *, momentum: float = 0.95, nesterov: bool = True
) -> tuple[Tensor, MuonState]:
    """Muon's elementwise half before Newton-Schulz: (u, new state), u the matrix to
    orthogonalize. Elementwise, so it runs on any shard of the parameter alike."""
    buf = state.momentum
    g = grad.to(buf.dtype)
    buf = torch.add(g, buf, alpha=momentum)
    u = torch.add(g, buf, alpha=momentum) if nesterov else buf
    return u, MuonState(buf)


def muon_apply(
    param: Tensor,
    O: Tensor,
    *,
    lr: Scalar,
    weight_decay: Scalar = 0.0,
    adjust_lr: str = "match_rms_adamw",
    shape: torch.Size | tuple[int, ...] | None = None,
) -> Tensor:
    """W·(1 − lr·wd) − lr·scale(shape)·O for the orthogonalized update O (param's shape; may be
    overwritten). shape: the whole matrix's, when param and O are shards of it (default:
    param's)."""
    lr, weight_decay = on_device(lr, param.device), on_device(weight_decay, param.device)
    O = O.to(param.dtype)
    step = lr * lr_scale(param.shape if shape is None else shape, adjust_lr)
    decay = 1 - lr * weight_decay
    if O.stride() != param.stride():  # (a tall matrix's O is transposed) keep param's layout
        return (param * decay).sub_(O.mul_(step))
    # O is a fresh temporary in param's layout: the new parameter is written into it.
    new = O.mul_(-step)
    if isinstance(decay, Tensor):
        return new.addcmul_(param, decay)
    return new.add_(param, alpha=decay)


def adamw_init(param: Tensor, *, dtype: torch.dtype | None = None) -> AdamWState:
    """Zero moments in `dtype` (default: the parameter's) and a zero step count."""
    dt = dtype or param.dtype
    zero = torch.zeros((), dtype=torch.float32, device=param.device)
    return AdamWState(zero, torch.zeros_like(param, dtype=dt), torch.zeros_like(param, dtype=dt))


def adamw_update(
    param: Tensor,
    grad: Tensor,
    state: AdamWState,
    *,
    lr: Scalar,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Scalar = 0.01,
) -> tuple[Tensor, AdamWState]:
    """One AdamW step for any parameter. Returns (new param, new state)."""
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    lr, weight_decay = on_device(lr, param.device), on_device(weight_decay, param.device)
    beta1, beta2 = betas
    t = state.step + 1
    g = grad.to(state.exp_avg.dtype)
    m = torch.lerp(state.exp_avg, g, 1 - beta1)
    v = state.exp_avg_sq * beta2 + (1 - beta2) * g * g
    bc1 = 1 - beta1**t
    bc2_sqrt = torch.sqrt(1 - beta2**t)
    denom = torch.sqrt(v) / bc2_sqrt + eps
    new = param * (1 - lr * weight_decay) - (lr / bc1) * (m / denom)
    return new.to(param.dtype), AdamWState(t, m, v)


def init_state(kind: str, like: Tensor, dtype: torch.dtype | None) -> MuonState | AdamWState:
    """`kind`'s zero state ("muon" or "adamw") for a parameter shaped like `like`."""
    return (muon_init if kind == "muon" else adamw_init)(like, dtype=dtype)


def param_update(
    kind: str,
    param: Tensor,
    grad: Tensor,
    state: MuonState | AdamWState,
    group: Mapping[str, Any],
    *,
    adjust_lr: str,
    ns: NSConfig,
) -> tuple[Tensor, MuonState | AdamWState]:
    """One parameter's step, by its param group's `kind` and hyperparameters (`group`, keyed as
    `Config.groups()` names them; lr and weight_decay may be 0-d tensors). Both faces' step."""
    if kind == "muon":
        hyper = {k: group[k] for k in ("lr", "weight_decay", "momentum", "nesterov")}
        return muon_update(param, grad, state, **hyper, adjust_lr=adjust_lr, ns=ns)
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return adamw_update(param, grad, state, **hyper)
