"""The step oracle: one optimizer step checked in float64 against the gradient it consumed.

Mixed-precision runs cannot be compared with an fp32 reference run closely: the bf16 forward
and backward round the gradients by ~0.5%, and Newton-Schulz maps that noise in a gradient's
small singular directions to order one, so updates land ~10% apart after a few steps on the test
models, as far as many wrong optimizers would. The oracle takes what the step itself saw (each
parameter's fp32 master, the reduced gradient, the optimizer state, before the step) and the
master after it, and recomputes the step in float64 with tests._models.HP: the library's fp32
arithmetic lands within ~1e-4 of it (relative to the update), while every wrong optimizer in
`tests._models.WRONG` moves the update by 5e-3 or more. `check` measures both on the test's own
data.

`before[name]`: dict(W=master, g=gradient, buf=momentum) for Muon, dict(W, g, m=exp_avg,
v=exp_avg_sq, t=step count) for AdamW, full tensors; `after[name]`: the master after the step.
"""

from __future__ import annotations

import math

import torch

import dmuon_fn as dmuon
from tests._models import HP, RIGHT, WRONG, full_params, muon_step, split_wrong
from tests._tolerance import rel_err


def step64(kind: str, s: dict, hp: dict, knobs: dict = RIGHT, lr_factor: float = 1.0):
    """The master after one step of `kind` ("muon"/"adamw") from state `s`, in float64: Muon
    by the reference's own step (tests._models.muon_step), AdamW as torch.optim.AdamW."""
    W, g = s["W"].double(), s["g"].double()
    if kind == "muon":
        return muon_step(W, g, s["buf"].double(), hp["lr"] * lr_factor, hp, knobs)[0]
    lr, wd = hp["adamw_lr"] * lr_factor, hp["adamw_wd"]
    (b1, b2), eps = hp["adamw_betas"], hp["adamw_eps"]
    t = float(s["t"]) + 1
    m = b1 * s["m"].double() + (1 - b1) * g
    v = b2 * s["v"].double() + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
    return W * (1 - lr * wd) - lr / (1 - b1**t) * m / denom


def check(
    before: dict[str, dict],
    after: dict[str, torch.Tensor],
    kinds: dict[str, str],
    lr_factor: float = 1.0,
) -> tuple[float, dict[str, float]]:
    """(the largest error of the step's updates against the oracle's, each variant's effect):
    both relative to the oracle's update W_after − W_before, max over parameters."""
    err, effect = 0.0, dict.fromkeys(WRONG, 0.0)
    for n, s in before.items():
        W0 = s["W"].double()
        want = step64(kinds[n], s, HP, lr_factor=lr_factor) - W0
        err = max(err, rel_err(after[n] - W0, want))
        for k, change in WRONG.items():
            wrong = step64(kinds[n], s, *split_wrong(change), lr_factor=lr_factor) - W0
            effect[k] = max(effect[k], rel_err(wrong, want))
    return err, effect


# The library's fp32 step against the float64 oracle on the same inputs, relative to the update:
# measured ≤ 1.4e-4 (fp32 Newton-Schulz rounding on the test models' gradients). The smallest
# variant's effect seen is 6e-3 (weight decay after the update); the rest are 1e-2 and more.
TOL = 5e-4


def assert_steps(per_rank: list[list[tuple[float, dict[str, float]]]], what: object) -> None:
    """Every step of every rank (`check`'s results) within TOL of the oracle, and every variant
    at least 10·TOL away from it on some step of some rank (the test can see it)."""
    errs = [e for steps in per_rank for e, _ in steps]
    assert max(errs) < TOL, (what, "step errors", errs)
    effect = {k: max(eff[k] for steps in per_rank for _, eff in steps) for k in WRONG}
    unseen = {k: v for k, v in effect.items() if v < 10 * TOL}
    assert not unseen, (what, "wrong optimizers the oracle would not see", unseen)


def kinds(model) -> dict[str, str]:
    """Each parameter's optimizer ("muon" or "adamw") in a model prepared by dedicate_params."""
    st = model._dmuon_state
    return {
        n: "muon" if (e := st.entry(p)) is not None and e.is_matrix else "adamw"
        for n, p in model.named_parameters()
    }


def seen(model, opt) -> dict[str, dict]:
    """`check`'s `before` for the object API: every parameter's master, gradient and optimizer
    state, whole on every rank (collective; after backward, before the step: it waits for the
    gradients). Dedicated AdamW parameters need their state on every rank: not supported."""
    dmuon.wait_gradients(model)
    st, kind = model._dmuon_state, kinds(model)
    state = {id(p): opt.state[p] for p in model.parameters()}
    # (a field the parameter's optimizer lacks gathers the value instead: unused)
    get = {
        "W": lambda p: p,
        "g": lambda p: p.grad,
        "buf": lambda p: state[id(p)].get("momentum_buffer", p),
        "m": lambda p: state[id(p)].get("exp_avg", p),
        "v": lambda p: state[id(p)].get("exp_avg_sq", p),
    }
    fields = {"muon": ("W", "g", "buf"), "adamw": ("W", "g", "m", "v")}
    need = {f for k in set(kind.values()) for f in fields[k]}
    full = {f: full_params(model, st, get[f], cast=False) if f in need else {} for f in get}
    out = {}
    for n, p in model.named_parameters():
        out[n] = {f: full[f][n] for f in fields[kind[n]]}
        if kind[n] == "adamw":
            out[n]["t"] = float(state[id(p)]["step"])
    return out


def checked_step(model, opt) -> tuple[tuple[float, dict[str, float]], dict[str, dict]]:
    """`opt.step()` of the object API with the oracle's `check` of it (collective): (the check's
    result, the `before` it used)."""
    before = seen(model, opt)
    opt.step()
    after = full_params(model, model._dmuon_state, cast=False)
    return check(before, {n: after[n] for n in before}, kinds(model)), before
