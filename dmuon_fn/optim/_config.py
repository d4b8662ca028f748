"""`Config`: the hyperparameters of both faces, validated once (`Muon` builds one, the functional
API takes one); `groups()` names them as param groups do (proofs/step_notes.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ns._dispatch import setup_field
from ..ns._orthogonalize import NSConfig
from ..planning._check import check_setup_consistent, kernel_field
from ._guard import NONFINITE, check_max_norm
from ._qk_clip import ClipHeads

# Each param-group kind's keys -> the Config fields they come from.
GROUP_FIELDS: dict[str, dict[str, str]] = {
    "muon": {k: k for k in ("lr", "momentum", "weight_decay", "nesterov")},
    "adamw": {k: f"adamw_{k}" for k in ("lr", "betas", "eps", "weight_decay")},
}
_NON_NEGATIVE = ("lr", "adamw_lr", "momentum", "weight_decay", "adamw_eps", "adamw_weight_decay")


@dataclass(frozen=True)
class Config:
    """Hyperparameters. `lr`, `adamw_lr` (None: lr) and the weight decays are the defaults of
    the functional `update`'s per-step arguments. max_grad_norm: clip by the global norm (None:
    no clipping). nonfinite: "skip" (a non-finite gradient anywhere leaves every parameter and
    state unchanged on every rank, masked on device), "ignore", or "raise" (a host sync: only
    with `host_sync=True`, as `Muon` builds it). state_dtype None: the parameter's.
    qk_clip_tau, qk_clip_alpha, qk_clip_heads: QK-clip after each step (optim/_qk_clip.py) of
    the attentions {key: ClipHeads}, from the max logits a LogitTracker saw (None: off)."""

    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    adamw_betas: tuple[float, float] = (0.9, 0.999)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.01
    adjust_lr: str = "match_rms_adamw"
    ns: NSConfig = field(default_factory=NSConfig)
    state_dtype: torch.dtype | None = torch.float32
    max_grad_norm: float | None = None
    nonfinite: str = "skip"
    lr: float = 0.02
    adamw_lr: float | None = None
    qk_clip_tau: float | None = None
    qk_clip_alpha: float = 0.5
    qk_clip_heads: Any = ()  # {key: ClipHeads}, kept as ((key, ClipHeads), ...) in key order
    host_sync: InitVar[bool] = False

    def __post_init__(self, host_sync: bool) -> None:
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise ValueError(f"Config.{name} must be >= 0, got {value!r}")
        if not all(0.0 <= b < 1.0 for b in self.adamw_betas):
            raise ValueError(f"Config.adamw_betas must lie in [0, 1), got {self.adamw_betas!r}")
        object.__setattr__(self, "adamw_betas", tuple(self.adamw_betas))
        check_max_norm(self.max_grad_norm)
        check_nonfinite(self.nonfinite, host_sync)
        heads = self.qk_clip_heads
        heads = tuple(heads.items()) if isinstance(heads, Mapping) else tuple(heads)
        object.__setattr__(self, "qk_clip_heads", heads)
        if any(not isinstance(h, ClipHeads) for _, h in heads):
            raise ValueError("Config.qk_clip_heads maps a key (e.g. a layer's name) to ClipHeads")
        tau, alpha = self.qk_clip_tau, self.qk_clip_alpha
        if (tau is not None and not tau > 0) or not 0 <= alpha <= 1 or (heads and tau is None):
            raise ValueError(
                f"QK-clip needs qk_clip_tau > 0 (None: off) with qk_clip_heads, and "
                f"qk_clip_alpha in [0, 1]; got tau {tau!r}, alpha {alpha!r}, {len(heads)} heads"
            )

    @property
    def guarded(self) -> bool:
        """Whether a step takes the global gradient norm (to clip, skip or raise)."""
        return self.max_grad_norm is not None or self.nonfinite != "ignore"

    def groups(
        self,
        *,
        lr: float | Tensor | None = None,
        adamw_lr: float | Tensor | None = None,
        weight_decay: float | Tensor | None = None,
        adamw_weight_decay: float | Tensor | None = None,
    ) -> dict[str, dict[str, Any]]:
        """{kind: {key: value}} as param groups name them (GROUP_FIELDS); a value given (float
        or 0-d tensor) replaces the Config's; adamw_lr None: the Config's, else lr."""
        values = {f: getattr(self, f) for fields in GROUP_FIELDS.values() for f in fields.values()}
        given = {"lr": lr, "adamw_lr": adamw_lr, "weight_decay": weight_decay}
        given["adamw_weight_decay"] = adamw_weight_decay
        values.update((k, v) for k, v in given.items() if v is not None)
        if values["adamw_lr"] is None:
            values["adamw_lr"] = values["lr"]
        return {kind: {k: values[f] for k, f in fs.items()} for kind, fs in GROUP_FIELDS.items()}

    def with_groups(self, groups: dict[str, dict[str, Any]]) -> Config:
        """The inverse of `groups()`: this Config with `groups`' values (unknown keys ignored)."""
        fields = [(GROUP_FIELDS[kind], g) for kind, g in groups.items()]
        values = {f[k]: v for f, g in fields for k, v in g.items() if k in f}
        return dataclasses.replace(self, **values)

    def check_setup(
        self, device: torch.device, *, across_ranks: bool = True, **fields: str
    ) -> None:
        """Raise if this rank cannot run the NS kernel; with across_ranks (collective), first
        `PlanMismatchError` on every rank unless all agree on kernel, dispatch, Config, `fields`."""
        kernel, error = kernel_field(self.ns.kernel, device)
        if across_ranks:
            setup = {"NS kernel": kernel, "NS dispatch": setup_field(device)}
            setup |= {"NS config": repr(self.ns), "optimizer": repr(self)}
            check_setup_consistent({**setup, **fields})
        if error is not None:
            raise error


def check_nonfinite(mode: str, host_sync: bool) -> None:
    if mode not in NONFINITE:
        raise ValueError(f"Config.nonfinite must be one of {NONFINITE}, got {mode!r}")
    if mode == "raise" and not host_sync:
        raise ValueError(
            "Config.nonfinite must be 'skip' or 'ignore' (a compiled step cannot raise without a "
            "host sync), got 'raise'; Muon(nonfinite='raise') raises from its eager step"
        )
