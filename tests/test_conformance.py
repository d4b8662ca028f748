"""Both faces against the plain-PyTorch reference in one process, for every hyperparameter.

The object API (`dedicate_params(pure=True)` + `Muon`) and the functional step (`plan`/`init`/
`value_and_grad`/`update`, eager) train the test models five steps with hyperparameters that all
differ from the library's defaults (tests/_models.HP), once as given and once with the other
branch of each switch (Nesterov on, the "original" lr scale, another step count).

Everything runs in float64 (model, Newton-Schulz, optimizer state, reference) but the per-step
lr and weight decay, which both faces hold as fp32 0-d tensors (a compiled step takes them as
inputs): measured ≤ 2e-9 relative on the Muon matrices and ≤ 4e-7 on LayerNorm biases (Adam
divides their near-zero gradients by sqrt(v)). TOL = 1e-5 is 25x that, and a tenth or less of
every wrong optimizer's effect on these runs (smallest 2e-3: tests/test_tolerances.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, batch, config_fp32, make, muon_fp32, reference
from tests._tolerance import rel_err

STEPS = 5
TOL = 1e-5
VARIANTS = {
    "hp": dict(adjust_lr="match_rms_adamw"),
    "other_branches": dict(nesterov=True, adjust_lr="original", ns_steps=4),
}


def _hp(variant: str) -> dict:
    return {**HP, **VARIANTS[variant]}


def _x(name, step):
    x = batch(name, step, 0)
    return x.double() if x.is_floating_point() else x


def _object_api(rank, world, name, variant):
    hp = _hp(variant)
    model = make(name).double()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (1,)), pure=True)
    opt = muon_fp32(
        model,
        nesterov=hp["nesterov"],
        ns_steps=hp["ns_steps"],
        adjust_lr=hp["adjust_lr"],
        ns_dtype=torch.float64,
        state_dtype=torch.float64,
    )
    for step in range(STEPS):
        opt.zero_grad()
        model(_x(name, step)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _functional(name, variant):
    hp = _hp(variant)
    model = make(name).double()
    fp = dmuon.plan(model)
    cfg = config_fp32(
        nesterov=hp["nesterov"],
        adjust_lr=hp["adjust_lr"],
        ns=dmuon.NSConfig(steps=hp["ns_steps"], method="standard", dtype=torch.float64),
        state_dtype=torch.float64,
    )
    state = dmuon.init(model, fp, cfg)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    for step in range(STEPS):
        _, grads = dmuon.value_and_grad(loss_fn, fp)(state.params, _x(name, step))
        state = dmuon.update(grads, state)
    return dict(state.params)


def _check(got, name, variant):
    muon = {n for n, p in make(name).named_parameters() if p.ndim >= 2}
    want = reference(
        name,
        1,
        STEPS,
        muon,
        _hp(variant),
        model=make(name).double(),
        loss=lambda m, step, rank: m(_x(name, step)),
    )
    errs = {n: rel_err(got[n], w) for n, w in want.items()}
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_functional_step_equals_reference(name, variant):
    _check(_functional(name, variant), name, variant)


def test_object_api_equals_reference():
    cases = [(n, v) for n in ("mlp", "transformer") for v in sorted(VARIANTS)]
    out = run_ranks(_run_cases, 1, cases)[0]
    for (name, variant), got in zip(cases, out, strict=True):
        _check(got, name, variant)


def _run_cases(rank, world, cases):
    return [_object_api(rank, world, n, v) for n, v in cases]
