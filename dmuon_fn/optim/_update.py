"""Pure Muon and AdamW updates: (param, grad, state) -> (new param, new state), nothing mutated.
lr and weight decay may be 0-d tensors, so a compiled step never recompiles for a schedule.
Muon, per matrix W (m×n, trailing dims flattened), gradient g:
    buf ← μ·buf + g;  u ← g + μ·buf if nesterov else buf;  O ← orthogonalize(u)
    W ← W·(1 − lr·wd) − lr·s·O,  s: "match_rms_adamw" 0.2·√max(m, n), "original" √max(1, m/n)
AdamW (as torch.optim.AdamW): t ← t + 1;  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
    W ← W·(1 − lr·wd) − lr/(1−β₁ᵗ) · m / (sqrt(v)/sqrt(1−β₂ᵗ) + eps)"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ns._blocks import Blocks, block_shapes, check, orthogonalize_blocks
from ..ns._orthogonalize import NSConfig, orthogonalize_with
from ..ns._team import Team, orthogonalize_gathered, orthogonalize_team

Scalar = float | Tensor

_SCALES = ("match_rms_adamw", "original")


def on_device(x: Scalar, device: torch.device) -> Scalar:
    """A tensor hyperparameter on `device` (floats stay floats; proofs/step_notes.md)."""
    return x.to(device) if isinstance(x, Tensor) and x.device != device else x


class MuonState(NamedTuple):
    momentum: Tensor  # same shape as the parameter


class AdamWState(NamedTuple):
    step: Tensor  # 0-d float32: steps taken so far
    exp_avg: Tensor
    exp_avg_sq: Tensor


# Each pure state's fields as a state dict names them (`optimizer.state[p]`, checkpoints).
STATE_KEYS = {MuonState: ("momentum_buffer",), AdamWState: AdamWState._fields}
KINDS: dict[str, type] = {"muon": MuonState, "adamw": AdamWState}


def state_items(state: MuonState | AdamWState) -> dict[str, Tensor]:
    """A pure state as state dict entries ({"momentum_buffer": ...} for Muon)."""
    return dict(zip(STATE_KEYS[type(state)], state, strict=True))


def state_from(kind: type, items: dict[str, Tensor]) -> MuonState | AdamWState:
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
    blocks: Blocks | str | None = None,
    team: Team | None = None,
) -> tuple[Tensor, MuonState]:
    """One Muon step for one matrix parameter: (new param, new state). blocks: how the
    parameter is made of matrices (`Blocks` or its string, ns/_blocks.py): each block is
    orthogonalized on its own and scaled by its own shape; None: trailing dims flattened.
    team: `param` is this member's slice of a matrix a team orthogonalizes together
    (`orthogonalize_team`; every member calls this in the same order), scaled by the whole's;
    of a gathered team (`Team.pieces`), this member's piece of the whole unit, which the
    first piece's holder orthogonalizes as one owner would (`orthogonalize_gathered`), or as
    a member of the unit's team (`Team.inner`), scaled by the team's matrix."""
    if param.dim() < 2:
        raise ValueError(
            f"Muon updates matrices (2-D or more, trailing dims flattened); got a "
            f"{param.dim()}-D parameter of shape {tuple(param.shape)}: use adamw_update for it"
        )
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    u, new_state = muon_momentum(grad, state, momentum=momentum, nesterov=nesterov)
    hyper = {"lr": lr, "weight_decay": weight_decay, "adjust_lr": adjust_lr}
    if team is not None and not team.pieces:
        O = orthogonalize_team(u, team.group, team.shape, dim=team.dim, cfg=ns)
        return muon_apply(param, O, **hyper, shape=team.shape), new_state
    inner = None if team is None else team.inner
    whole = param.shape if team is None else torch.Size(team.shape)
    spec = None if blocks is None else check(blocks, whole, "the parameter")
    parts = [(1, (whole[0], whole.numel() // whole[0]))]  # None: one flat matrix
    parts = parts if spec is None else block_shapes(spec, whole)

    def orth(W: Tensor) -> Tensor:  # the whole's O, as its one owner (or team member) computes it
        if inner is not None:
            return orthogonalize_team(W, inner.group, inner.shape, dim=inner.dim, cfg=ns)
        if len(parts) > 1:  # blocks of several shapes: each scaled by its own
            return orthogonalize_blocks(
                W, spec, ns, scale=lambda m, n: lr_scale((m, n), adjust_lr)
            )  # fmt: skip
        if parts[0][0] > 1:
            return orthogonalize_blocks(W, spec, ns)
        # one matrix; with Nesterov (or gathered) W is a temporary that may hold the result
        O = orthogonalize_with(W.reshape(parts[0][1]), ns, overwrite=nesterov or team is not None)
        return O.reshape(W.shape)

    O = orth(u) if team is None else orthogonalize_gathered(u, team, orth)
    scaled = {"scale": 1.0} if len(parts) > 1 else {"shape": parts[0][1]}
    scaled = scaled if inner is None else {"shape": inner.shape}
    return muon_apply(param, O, **hyper, **scaled), new_state


def muon_momentum(
    grad: Tensor, state: MuonState, *, momentum: float = 0.95, nesterov: bool = True
) -> tuple[Tensor, MuonState]:
    """Muon's elementwise half, on any shard alike: (u to orthogonalize, new state)."""
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
    scale: float | None = None,
) -> Tensor:
    """W·(1 − lr·wd) − lr·scale(shape)·O; O has param's shape and may be overwritten. shape:
    the whole matrix's when param and O are shards of it (default: param's); scale: the
    per-matrix multiplier (default: `lr_scale(shape, adjust_lr)`; 1.0 when O is scaled)."""
    lr, weight_decay = on_device(lr, param.device), on_device(weight_decay, param.device)
    O = O.to(param.dtype)
    if scale is None:
        scale = lr_scale(param.shape if shape is None else shape, adjust_lr)
    step = lr * scale
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
    """One AdamW step for any parameter: (new param, new state)."""
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    lr, weight_decay = on_device(lr, param.device), on_device(weight_decay, param.device)
    beta1, beta2 = betas
    t = state.step + 1
    g = grad.to(state.exp_avg.dtype)
    m = torch.lerp(state.exp_avg, g, 1 - beta1)
    v = state.exp_avg_sq * beta2 + (1 - beta2) * g * g
    bc1 = 1 - beta1**t
    denom = torch.sqrt(v) / torch.sqrt(1 - beta2**t) + eps
    new = param * (1 - lr * weight_decay) - (lr / bc1) * (m / denom)
    return new.to(param.dtype), AdamWState(t, m, v)


def init_state(kind: str, like: Tensor, dtype: torch.dtype | None) -> MuonState | AdamWState:
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
    blocks: Blocks | str | None = None,
    team: Team | None = None,
) -> tuple[Tensor, MuonState | AdamWState]:
    """One parameter's step (both faces'): `group` holds its kind's hyperparameters as
    `Config.groups()` names them (lr and weight_decay may be 0-d tensors); blocks, team:
    Muon's."""
    if kind == "muon":
        hyper = {k: group[k] for k in ("lr", "weight_decay", "momentum", "nesterov")}
        kw = {"adjust_lr": adjust_lr, "ns": ns, "blocks": blocks, "team": team}
        return muon_update(param, grad, state, **hyper, **kw)
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return adamw_update(param, grad, state, **hyper)
