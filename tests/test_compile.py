"""orthogonalize and the updates under torch.compile(fullgraph=True): no graph breaks, no
recompiles as lr / weight decay / step count change (they are 0-d tensors)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from dmuon_fn import adamw_init, adamw_update, muon_init, muon_update, orthogonalize
from tests._tolerance import NS_LOW_PRECISION, rel_err


@pytest.mark.slow
def test_orthogonalize_compiles_with_inductor():
    torch._dynamo.reset()
    counters.clear()
    G = torch.randn(2, 48, 160)
    compiled = torch.compile(orthogonalize, fullgraph=True)(G)
    assert not counters["graph_break"]
    assert compiled.shape == G.shape and compiled.dtype == G.dtype
    # inductor may fuse the fp32 normalization differently, then bf16 rounding diverges slightly
    assert rel_err(compiled, orthogonalize(G)) < NS_LOW_PRECISION
    exact = orthogonalize(G.double(), dtype=torch.float64)
    assert rel_err(compiled, exact) < NS_LOW_PRECISION


def test_muon_and_adamw_steps_compile_once_across_a_schedule():
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounter()

    @torch.compile(backend=cnt, fullgraph=True)
    def step(p, g, ms, q, h, as_, lr, wd):
        p, ms = muon_update(p, g, ms, lr=lr, weight_decay=wd)
        q, as_ = adamw_update(q, h, as_, lr=lr, weight_decay=wd)
        return p, ms, q, as_

    p, q = torch.randn(64, 128), torch.randn(128)
    ms, as_ = muon_init(p), adamw_init(q)
    eager_p, eager_ms, eager_q, eager_as = p, ms, q, as_
    for i in range(5):
        g, h = torch.randn(64, 128), torch.randn(128)
        lr, wd = torch.tensor(0.02 / (i + 1)), torch.tensor(0.01 * i)
        p, ms, q, as_ = step(p, g, ms, q, h, as_, lr, wd)
        eager_p, eager_ms = muon_update(eager_p, g, eager_ms, lr=lr, weight_decay=wd)
        eager_q, eager_as = adamw_update(eager_q, h, eager_as, lr=lr, weight_decay=wd)
    assert cnt.frame_count == 1, f"recompiled: {cnt.frame_count} frames"
    assert not counters["graph_break"]
    assert as_.step.item() == 5
    assert torch.equal(p, eager_p) and torch.equal(q, eager_q)  # same ops, eager backend
