"""Pure Muon/AdamW updates against plain-PyTorch references and torch.optim, step for step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn import (
    AdamWState,
    MuonState,
    NSConfig,
    adamw_init,
    adamw_update,
    muon_init,
    muon_update,
)
from dmuon_fn.ns._iteration import schedule
from dmuon_fn.optim._update import on_device
from tests._tolerance import rel_err


def _ref_ns(u, rows):
    """Plain standard Newton-Schulz in float64 (the math in DESIGN.md, nothing shared)."""
    X = u.double().reshape(u.shape[0], -1)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / X.norm()
    for a, b, c in rows:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if tall else X).reshape(u.shape)


def _ref_muon_step(p, g, buf, *, lr, wd, mu, nesterov, scale, rows):
    buf = mu * buf + g
    u = g + mu * buf if nesterov else buf
    return p * (1 - lr * wd) - lr * scale * _ref_ns(u, rows), buf


@settings(max_examples=20, deadline=None)
@given(
    shape=st.sampled_from([(8, 8), (16, 40), (48, 12), (6, 3, 2, 2), (40, 96)]),
    nesterov=st.booleans(),
    adjust=st.sampled_from(["match_rms_adamw", "original"]),
    method=st.sampled_from(["standard", "gram"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_muon_update_equals_reference_step_for_step(shape, nesterov, adjust, method, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g, dtype=torch.float64)
    ns = NSConfig(method=method, eps=0.0, dtype=torch.float64)
    rows = schedule("polar_express", 5)
    m, n = shape[0], math.prod(shape[1:])
    scale = 0.2 * math.sqrt(max(m, n)) if adjust == "match_rms_adamw" else math.sqrt(max(1, m / n))
    state, ref_p, ref_buf = muon_init(p), p.clone(), torch.zeros_like(p)
    for step in range(4):
        grad = torch.randn(shape, generator=g, dtype=torch.float64)
        lr, wd = 0.02 / (step + 1), 0.1 * step
        p, state = muon_update(
            p,
            grad,
            state,
            lr=torch.tensor(lr, dtype=torch.float64),
            weight_decay=torch.tensor(wd, dtype=torch.float64),
            momentum=0.9,
            nesterov=nesterov,
            adjust_lr=adjust,
            ns=ns,
        )
        ref_p, ref_buf = _ref_muon_step(
            ref_p, grad, ref_buf, lr=lr, wd=wd, mu=0.9, nesterov=nesterov, scale=scale, rows=rows
        )
        assert rel_err(p, ref_p) < 1e-10 and rel_err(state.momentum, ref_buf) < 1e-12


@pytest.mark.parametrize(("method", "tol"), [("standard", 3e-2), ("auto", 0.1)])
def test_muon_matches_torch_optim_muon(method, tol):
    """Keller coefficients, torch's 'original' LR scale, one update at a time from the same point.

    torch's EMA momentum differs from ours by the factor (1-μ), which the normalization removes.
    Both iterate in bf16: the standard iteration lands ~1.5e-2 from the float64 polynomial, as
    torch does, so the two agree to 3e-2; bf16 Gram NS (auto, 64×160) lands ~5e-2 from it (its
    error against the polar factor stays at the standard level: test_orthogonalize), so 0.1.
    """
    torch.manual_seed(0)
    p0 = torch.randn(64, 160)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ns = NSConfig(coefficients="keller", method=method)
    p, state = p0.clone(), muon_init(p0)
    for _ in range(3):
        grad = torch.randn(64, 160)
        before = p.clone()
        ref.grad = grad.clone()
        opt.step()
        p, state = muon_update(
            p, grad, state, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr="original", ns=ns
        )
        assert rel_err(p - before, ref.detach() - before) < tol
        p = ref.detach().clone()  # continue both from the same point: compare single updates


def test_adamw_matches_torch_optim_adamw():
    torch.manual_seed(1)
    p0 = torch.randn(33, 7)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05)
    p, state = p0.clone(), adamw_init(p0)
    for step in range(6):
        grad = torch.randn(33, 7)
        ref.grad = grad.clone()
        opt.step()
        p, state = adamw_update(
            p,
            grad,
            state,
            lr=torch.tensor(1e-2),
            betas=(0.8, 0.99),
            eps=1e-8,
            weight_decay=torch.tensor(0.05),
        )
        assert state.step.item() == step + 1
        assert rel_err(p, ref.detach()) < 1e-6
        assert rel_err(state.exp_avg_sq, opt.state[ref]["exp_avg_sq"]) < 1e-6


def test_updates_are_pure_and_keep_dtypes():
    p = torch.randn(40, 64, dtype=torch.bfloat16)
    g = torch.randn(40, 64, dtype=torch.bfloat16)
    state = muon_init(p, dtype=torch.float32)
    p_copy, g_copy, m_copy = p.clone(), g.clone(), state.momentum.clone()
    new_p, new_state = muon_update(p, g, state, lr=0.02)
    assert torch.equal(p, p_copy) and torch.equal(g, g_copy)
    assert torch.equal(state.momentum, m_copy), "momentum buffer must not be mutated"
    assert new_p.dtype == torch.bfloat16 and new_state.momentum.dtype == torch.float32
    assert new_state.momentum.data_ptr() != g.data_ptr()
    a_state = adamw_init(p, dtype=torch.float32)
    new_p, new_a = adamw_update(p, g, a_state, lr=1e-3)
    assert new_p.dtype == torch.bfloat16 and new_a.exp_avg.dtype == torch.float32
    assert a_state.step.item() == 0 and new_a.step.item() == 1


def test_zero_gradient_gives_pure_weight_decay():
    p = torch.randn(32, 64)
    new_p, _state = muon_update(p, torch.zeros_like(p), muon_init(p), lr=0.1, weight_decay=0.5)
    assert torch.isfinite(new_p).all()
    assert torch.equal(new_p, p * (1 - 0.1 * 0.5))


def test_first_step_buffer_is_the_gradient():
    p, g = torch.randn(16, 32), torch.randn(16, 32)
    _, state = muon_update(p, g, muon_init(p), lr=0.1)
    assert torch.equal(state.momentum, g)


def test_bad_arguments():
    p = torch.randn(8)
    with pytest.raises(ValueError, match="use adamw_update"):
        muon_update(p, p, MuonState(p), lr=0.1)
    with pytest.raises(ValueError, match="grad shape"):
        muon_update(torch.randn(4, 4), torch.randn(4, 5), muon_init(torch.randn(4, 4)), lr=0.1)
    with pytest.raises(ValueError, match="adjust_lr must be"):
        muon_update(
            torch.randn(4, 4),
            torch.randn(4, 4),
            muon_init(torch.randn(4, 4)),
            lr=0.1,
            adjust_lr="bogus",
        )
    with pytest.raises(ValueError, match="grad shape"):
        adamw_update(p, torch.randn(9), AdamWState(torch.zeros(()), p, p), lr=0.1)


def test_tensor_hyperparameters_move_to_the_parameters_device():
    """A 0-d tensor lr / weight decay on another device than the parameter (a scheduler's CPU
    scalar next to CUDA parameters) is copied to the parameter's device before any arithmetic,
    so a compiled CUDA step computes lr·scale and 1 − lr·wd there; floats and same-device
    tensors pass through untouched."""
    meta = torch.device("meta")
    lr = torch.tensor(0.02)
    moved = on_device(lr, meta)
    assert moved.device == meta and moved.shape == ()
    assert on_device(lr, torch.device("cpu")) is lr
    assert on_device(0.02, meta) == 0.02
    p = torch.randn(8, 4, device=meta)
    new, st_ = adamw_update(p, torch.randn(8, 4, device=meta), adamw_init(p), lr=lr,
                            weight_decay=torch.tensor(0.1))  # fmt: skip
    assert new.device == meta and st_.step.device == meta
