"""The pure updates compose with torch.func: vmap over a batch of same-shape matrices, and
grad through a loss of the updated parameters (e.g. with respect to the learning rate)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_fn import MuonState, NSConfig, muon_init, muon_update, orthogonalize
from tests._tolerance import rel_err


@settings(max_examples=10, deadline=None)
@given(
    shape=st.sampled_from([(8, 8), (16, 40), (40, 16), (32, 96)]),
    batch=st.integers(1, 4),
    method=st.sampled_from(["standard", "gram"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_vmap_update_equals_per_matrix_updates(shape, batch, method, seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(batch, *shape, generator=g)
    G = torch.randn(batch, *shape, generator=g)
    M = torch.randn(batch, *shape, generator=g)
    ns = NSConfig(method=method, dtype=torch.float32)

    def one(p, grad, m):
        new, state = muon_update(p, grad, MuonState(m), lr=0.02, weight_decay=0.1, ns=ns)
        return new, state.momentum

    vp, vm = torch.func.vmap(one)(P, G, M)
    for i in range(batch):
        p, m = one(P[i], G[i], M[i])
        assert rel_err(vp[i], p) < 1e-5 and torch.equal(vm[i], m)


def test_vmap_orthogonalize_matches_batched_call():
    """To fp32 rounding: vmap may run the products as other GEMM calls than the batched call
    (seen 2.3e-6 on one draw), as the per-matrix comparison above allows 1e-5."""
    G = torch.randn(3, 48, 128, generator=torch.Generator().manual_seed(0))
    a = torch.func.vmap(lambda x: orthogonalize(x, dtype=torch.float32))(G)
    assert rel_err(a, orthogonalize(G, dtype=torch.float32)) < 1e-5


def test_grad_of_a_loss_through_the_update_wrt_lr():
    """d/d lr of L(W(lr)), W(lr) = W·(1 − lr·wd) − lr·s·O: O does not depend on lr, so the
    derivative is ⟨∇L, −wd·W − s·O⟩; checked against that closed form and finite differences."""
    torch.manual_seed(0)
    W, grad, target = torch.randn(16, 48), torch.randn(16, 48), torch.randn(16, 48)
    state = muon_init(W)
    ns = NSConfig(dtype=torch.float64)
    W, grad, target = W.double(), grad.double(), target.double()
    state = MuonState(state.momentum.double())

    def loss(lr):
        new, _ = muon_update(W, grad, state, lr=lr, weight_decay=0.1, ns=ns)
        return ((new - target) ** 2).sum()

    lr = torch.tensor(0.02, dtype=torch.float64)
    d = torch.func.grad(loss)(lr)
    eps = 1e-6
    fd = (loss(lr + eps) - loss(lr - eps)) / (2 * eps)
    assert abs(d.item() - fd.item()) <= 1e-6 * abs(fd.item())
