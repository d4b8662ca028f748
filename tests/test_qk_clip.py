"""QK-clip (dmuon_fn/optim/_qk_clip.py, proofs/qk_clip.md) against a float64 reference computed
from the definition: after the clip, every head's largest logit on the same input is ≤ τ, a
clipped head's lands on τ, and every row the rule does not name keeps its bits; for multi-head,
grouped-query and fused layouts, with biases, under torch.compile, and with bad inputs."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from dmuon_fn.optim._qk_clip import (
    LogitTracker,
    max_logits,
    qk_clip,
    qk_clip_fused,
    qk_clip_scales,
)

# float32 weights and logits, max logits of unit-scale sums: a few roundings of 2^-24 each
REL = 1e-5


def _heads(x, w, b, n):
    """(B, T, hidden) @ w (n·d, hidden)ᵀ + b -> (B, n, T, d), in float64."""
    y = x.double() @ w.double().T + (0 if b is None else b.double())
    return y.unflatten(-1, (n, -1)).transpose(1, 2)


def _ref_max(x, w_q, w_k, h, hkv, b_q=None, b_k=None, causal=False):
    """S_h from the definition: max over batch and pairs of q_h·k_j(h) / sqrt(d), float64."""
    q, k = _heads(x, w_q, b_q, h), _heads(x, w_k, b_k, hkv)
    t, d = q.shape[2], q.shape[3]
    out = []
    for i in range(h):
        logits = q[:, i] @ k[:, i // (h // hkv)].transpose(-1, -2) / math.sqrt(d)
        if causal:
            logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        out.append(logits.amax())
    return torch.stack(out)


def _rows(w, head, n):
    return w.unflatten(0, (n, -1))[head]


def _dominant(h, hkv, top, *, bias=False, seed=0, d=4, hidden=24):
    """Weights and an input where query head `top` has by far the largest logit: its query rows
    are a multiple of its key head's rows, so q·k = 8·|k|²/sqrt(d) on the diagonal."""
    g = torch.Generator().manual_seed(seed)
    w_q = torch.randn(h * d, hidden, generator=g) / math.sqrt(hidden)
    w_k = torch.randn(hkv * d, hidden, generator=g) / math.sqrt(hidden)
    _rows(w_q, top, h).copy_(8 * _rows(w_k, top // (h // hkv), hkv))
    x = torch.randn(2, 6, hidden, generator=g)
    b_q, b_k = (torch.randn(n * d, generator=g) * 0.1 if bias else None for n in (h, hkv))
    return x, w_q, w_k, b_q, b_k


def _tau_between(s, top):
    """A τ that only head `top` exceeds."""
    others = torch.cat([s[:top], s[top + 1 :]]).max()
    assert s[top] > 2 * others > 0
    return float((s[top] + others) / 2)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("layout", ["mha", "gqa", "fused", "bias"])
def test_one_dominant_head_lands_on_tau_and_the_rest_keep_their_bits(alpha, layout):
    h, hkv, top = (4, 4, 2) if layout == "mha" else (8, 2, 5)
    x, w_q, w_k, b_q, b_k = _dominant(h, hkv, top, bias=layout == "bias")
    j, g, d = top // (h // hkv), h // hkv, w_q.shape[0] // h
    s = _ref_max(x, w_q, w_k, h, hkv, b_q, b_k)
    tau = _tau_between(s, top)
    # the library's own float32 max logits on the same input, as a caller would pass them
    seen = max_logits(_heads(x, w_q, b_q, h).float(), _heads(x, w_k, b_k, hkv).float())
    assert (seen.double() - s).abs().max() < REL * s.abs().max()
    kw = dict(tau=tau, alpha=alpha, num_heads=h, num_kv_heads=hkv)
    if layout == "fused":
        w_v = torch.randn(hkv * d, w_q.shape[1])
        out = qk_clip_fused(torch.cat([w_q, w_k, w_v]), seen, **kw)
        new_q, new_k, new_v = out.split([h * d, hkv * d, hkv * d])
        assert torch.equal(new_v, w_v)
        new_bq = new_bk = None
    else:
        new_q, new_k, new_bq, new_bk = qk_clip(w_q, w_k, seen, b_q=b_q, b_k=b_k, **kw)
    after = _ref_max(x, new_q, new_k, h, hkv, new_bq, new_bk)
    assert abs(after[top] - tau) <= REL * tau
    assert (after <= tau * (1 + REL)).all()
    gamma = tau / float(seen[top])
    for i in range(h):
        if i != top:
            assert torch.equal(_rows(new_q, i, h), _rows(w_q, i, h))
            assert new_bq is None or torch.equal(_rows(new_bq, i, h), _rows(b_q, i, h))
            # an unclipped head beside the clipped one: its logits scale by γ^(1−α) ≤ 1
            if i // g == j:
                assert abs(after[i] - s[i] * gamma ** (1 - alpha)) <= REL * abs(s[i])
    for i in range(hkv):
        if i != j:
            assert torch.equal(_rows(new_k, i, hkv), _rows(w_k, i, hkv))
    # the clipped head is MuonClip's: query rows × γ^α, key rows × γ^(1−α), exact at 0 and 1
    for new, old, n, i, p in [(new_q, w_q, h, top, alpha), (new_k, w_k, hkv, j, 1 - alpha)]:
        if p == 0:
            assert torch.equal(_rows(new, i, n), _rows(old, i, n))
        torch.testing.assert_close(_rows(new, i, n), _rows(old, i, n) * gamma**p)
    if new_bq is not None:
        torch.testing.assert_close(_rows(new_bq, top, h), _rows(b_q, top, h) * gamma**alpha)
        torch.testing.assert_close(_rows(new_bk, j, hkv), _rows(b_k, j, hkv) * gamma ** (1 - alpha))


def test_two_clipped_heads_of_one_group_each_land_on_tau():
    """The key head follows the deeper clip; the other clipped query head makes up the rest."""
    h, hkv = 4, 1
    x, w_q, w_k, _, _ = _dominant(h, hkv, 1)
    _rows(w_q, 3, h).copy_(4 * _rows(w_k, 0, hkv))
    s = _ref_max(x, w_q, w_k, h, hkv)
    tau = float(s[3]) * 0.9
    assert s[1] > s[3] > tau > s[[0, 2]].max()
    q, k = qk_clip_scales(s, tau=tau, num_heads=h, num_kv_heads=hkv)
    gamma = tau / s
    torch.testing.assert_close(k, gamma[1:2] ** 0.5)
    torch.testing.assert_close(q[[1, 3]], torch.stack([gamma[1] ** 0.5, gamma[3] / k[0]]))
    assert q[3] > 1 and q[0] == q[2] == 1  # a query may grow when its key shrinks for another
    new_q, new_k = qk_clip(w_q, w_k, s, tau=tau, num_heads=h, num_kv_heads=hkv)[:2]
    after = _ref_max(x, new_q, new_k, h, hkv)
    assert all(abs(after[i] - tau) <= REL * tau for i in (1, 3))
    assert (after[[0, 2]] <= s[[0, 2]]).all() and (after <= tau * (1 + REL)).all()


@settings(max_examples=60, deadline=None)
@given(
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.integers(1, 4),
    t=st.integers(1, 5),
    causal=st.booleans(),
    frac=st.floats(0.05, 1.5),
    alpha=st.floats(0.0, 1.0),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_head_ends_at_most_tau_and_untouched_heads_keep_their_bits(
    hkv, group, d, t, causal, frac, alpha, bias, seed
):
    h, hidden = hkv * group, 6
    g = torch.Generator().manual_seed(seed)
    w_q, w_k, w_v = (
        torch.randn(n * d, hidden, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)
    )
    b_q, b_k = (
        torch.randn(n * d, generator=g, dtype=torch.float64) if bias else None for n in (h, hkv)
    )
    # a few heads made large, so τ cuts some and spares others
    for i in torch.randint(0, h, (2,), generator=g).tolist():
        _rows(w_q, i, h).mul_(1 + 9 * torch.rand((), generator=g, dtype=torch.float64))
    x = torch.randn(2, t, hidden, generator=g, dtype=torch.float64)
    s = _ref_max(x, w_q, w_k, h, hkv, b_q, b_k, causal)
    tau = frac * max(float(s.abs().max()), 1e-3)
    kw = dict(tau=tau, alpha=alpha, num_heads=h, num_kv_heads=hkv)
    new_q, new_k, new_bq, new_bk = qk_clip(w_q, w_k, s, b_q=b_q, b_k=b_k, **kw)
    after = _ref_max(x, new_q, new_k, h, hkv, new_bq, new_bk, causal)
    clipped = s > tau
    assert (after <= tau * (1 + REL)).all()
    assert ((after - tau).abs() <= REL * tau)[clipped].all()
    # factor 1 exactly for what the rule spares, and then the rows keep their bits
    q, k = qk_clip_scales(s, tau=tau, alpha=alpha, num_heads=h, num_kv_heads=hkv)
    assert (q[~clipped] == 1).all() and (k[~clipped.view(hkv, group).any(1)] == 1).all()
    pairs = [(new_q, w_q, q), (new_k, w_k, k), (new_bq, b_q, q), (new_bk, b_k, k)]
    for new, old, f in pairs[: 4 if bias else 2]:
        for i in range(len(f)):
            if f[i] == 1:
                assert torch.equal(_rows(new, i, len(f)), _rows(old, i, len(f)))
            else:
                torch.testing.assert_close(_rows(new, i, len(f)), _rows(old, i, len(f)) * f[i])
    # the fused layout scales the same rows by the same factors
    fused = qk_clip_fused(torch.cat([w_q, w_k, w_v]), s, **kw)
    assert torch.equal(fused, torch.cat([new_q, new_k, w_v]))


def test_nonfinite_or_nonpositive_max_logits_leave_their_heads_alone():
    """NaN / ±inf / 0 / negative S: factor 1 (rows keep their bits); the finite clipped head in
    the same group is still clipped, and nothing turns non-finite."""
    h, hkv, d = 6, 2, 2
    w_q, w_k = torch.randn(h * d, 5), torch.randn(hkv * d, 5)
    s = torch.tensor([math.nan, math.inf, 20.0, -math.inf, 0.0, -3.0])
    new_q, new_k = qk_clip(w_q, w_k, s, tau=5.0, num_heads=h, num_kv_heads=hkv)[:2]
    assert torch.isfinite(new_q).all() and torch.isfinite(new_k).all()
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(_rows(new_q, i, h), _rows(w_q, i, h))
    assert torch.equal(_rows(new_k, 1, hkv), _rows(w_k, 1, hkv))
    torch.testing.assert_close(_rows(new_q, 2, h), _rows(w_q, 2, h) * 0.5)
    torch.testing.assert_close(_rows(new_k, 0, hkv), _rows(w_k, 0, hkv) * 0.5)
    # γ = τ/S below the smallest normal float32 stays a finite, positive clip
    q, k = qk_clip_scales(torch.tensor([3e38]), tau=1e-8, num_heads=1)
    assert torch.isfinite(q).all() and (q > 0).all() and (k > 0).all()


def test_low_precision_weights_keep_their_dtype_and_untouched_bits():
    x, w_q, w_k, _, _ = _dominant(8, 2, 5)
    s = _ref_max(x, w_q, w_k, 8, 2)
    tau = _tau_between(s, 5)
    bq, bk = w_q.bfloat16(), w_k.bfloat16()
    new_q, new_k = qk_clip(bq, bk, s.float(), tau=tau, num_heads=8, num_kv_heads=2)[:2]
    assert new_q.dtype == new_k.dtype == torch.bfloat16
    assert torch.equal(_rows(new_q, 0, 8), _rows(bq, 0, 8))
    assert torch.equal(_rows(new_k, 0, 2), _rows(bk, 0, 2))
    after = _ref_max(x, new_q, new_k, 8, 2)
    assert after[5] <= tau * (1 + 2e-2)  # bf16 rounds each scaled weight at 2^-8


@pytest.mark.parametrize("max_block", [1 << 22, 7, 1])
def test_max_logits_equals_the_definition_with_causal_mask_and_chunks(max_block):
    g = torch.Generator().manual_seed(1)
    b, h, hkv, t, s, d = 2, 6, 3, 5, 7, 4
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    mask = torch.rand(b, 1, t, s, generator=g) < 0.7
    mask[:, :, :, 0] = True
    full = q @ k.repeat_interleave(h // hkv, dim=1).transpose(-1, -2) * 0.3
    tri = torch.ones(t, s, dtype=torch.bool).tril()
    for kw, keep in [({}, None), ({"causal": True}, tri), ({"mask": mask}, mask)]:
        want = (full if keep is None else full.masked_fill(~keep, -math.inf)).amax(dim=(0, 2, 3))
        got = max_logits(q, k, scale=0.3, max_block=max_block, **kw)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    both = max_logits(q, k, scale=0.3, causal=True, mask=mask, max_block=max_block)
    torch.testing.assert_close(both, full.masked_fill(~(mask & tri), -math.inf).amax(dim=(0, 2, 3)))
    # default scale 1/sqrt(d); low precision computes in float32; a head with no pair: -inf
    default = max_logits(q.bfloat16(), k.bfloat16())
    assert default.dtype == torch.float32
    want = (q.bfloat16().double() @ k.bfloat16().double().repeat_interleave(2, 1).mT / 2).amax(
        dim=(0, 2, 3)
    )
    torch.testing.assert_close(default.double(), want, rtol=1e-6, atol=0)
    none = torch.zeros(h, 1, 1, dtype=torch.bool)
    none[1:] = True
    assert max_logits(q, k, mask=none)[0] == -math.inf


def test_tracker_folds_forwards_resets_and_adds_nothing_to_autograd():
    g = torch.Generator().manual_seed(2)
    qs = [torch.randn(1, 4, 3, 2, generator=g, requires_grad=True) for _ in range(2)]
    ks = [torch.randn(1, 2, 3, 2, generator=g, requires_grad=True) for _ in range(2)]
    tr = LogitTracker()
    for q, k in zip(qs, ks, strict=True):
        tr.observe("layer0", q, k, causal=True)
    want = torch.maximum(*(max_logits(q, k, causal=True) for q, k in zip(qs, ks, strict=True)))
    assert torch.equal(tr.max("layer0"), want) and not tr.max("layer0").requires_grad
    assert tr.keys() == ["layer0"]
    before = tr.max("layer0")
    tr.reset()
    assert tr.keys() == ["layer0"] and (tr.max("layer0") == -math.inf).all()
    assert torch.equal(before, want)  # reset makes new entries, it does not write into old ones


def _attention(x, w_qkv, tracker):
    """A tiny grouped-query attention that reports its logits to the tracker."""
    h, hkv = 4, 2
    q, k, v = (x @ w_qkv.T).split([8, 4, 4], dim=-1)
    q, k, v = (y.unflatten(-1, (n, 2)).transpose(1, 2) for y, n in [(q, h), (k, hkv), (v, hkv)])
    tracker.observe("attn", q, k, causal=True, max_block=8)
    k, v = (y.repeat_interleave(h // hkv, dim=1) for y in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_clip_and_tracker_match_eager_without_graph_breaks_or_recompiles(backend):
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend(backend)
    x, w_q, w_k, _, _ = _dominant(8, 2, 5)
    w_qkv = torch.cat([w_q, w_k, torch.randn_like(w_k)])
    s = _ref_max(x, w_q, w_k, 8, 2).float()
    clip = torch.compile(qk_clip_fused, backend=cnt, fullgraph=True)
    for tau in (1.0, 3.0, 0.5):  # τ and α as tensors: one graph for every value
        kw = dict(tau=torch.tensor(tau), alpha=torch.tensor(0.25), num_heads=8, num_kv_heads=2)
        got, want = clip(w_qkv, s, **kw), qk_clip_fused(w_qkv, s, **kw)
        torch.testing.assert_close(got, want)
        assert torch.equal(got[want == w_qkv], w_qkv[want == w_qkv])
    assert cnt.frame_count == 1

    w = torch.randn(16, 6, requires_grad=True)
    eager, compiled = LogitTracker(), LogitTracker()
    attn = torch.compile(_attention, backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for step in range(3):  # observe (first, then folding), fold again, reset and fold
        xs = torch.randn(2, 5, 6, generator=g)
        want = torch.autograd.grad(_attention(xs, w, eager), w)
        got = torch.autograd.grad(attn(xs, w, compiled), w)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(compiled.max("attn"), eager.max("attn"))
        if step == 1:
            eager.reset()
            compiled.reset()
    assert not counters["graph_break"] and cnt.frame_count == 3  # clip, first observe, folding


GQA = dict(num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, num_heads=3, num_kv_heads=3), "w_q has 8"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, num_heads=4, num_kv_heads=4), "head_dim"),
        (lambda a: qk_clip(a.wq, a.wk, a.s[:3], tau=1.0, **GQA), "(4,)"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=0.0, **GQA), "tau"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=-1, **GQA), "tau"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=math.nan, **GQA), "tau"),
        (
            lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, alpha=1.5, **GQA),
            "alpha",
        ),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=torch.ones(2), **GQA), "0-d"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, num_heads=0), "num_heads"),
        (lambda a: qk_clip(a.wq, a.wk, a.s, tau=1.0, **GQA, b_q=a.s), "b_q"),
        (lambda a: qk_clip_fused(a.wq, a.s, tau=1.0, num_heads=4, num_kv_heads=1), "w_qkv"),
        (lambda a: max_logits(a.wq, a.wk), "(B, H, T, d)"),
        (lambda a: max_logits(a.q, a.q[:, :3]), "multiple"),
        (lambda a: max_logits(a.q, a.q, mask=a.q), "bool"),
        (lambda a: max_logits(a.q, a.q, mask=torch.ones(3, 3, dtype=torch.bool)), "broadcast"),
    ],
)
def test_bad_inputs_raise_value_errors_naming_the_argument(call, match):
    class A:
        wq, wk, s, q = torch.ones(8, 3), torch.ones(4, 3), torch.ones(4), torch.ones(1, 4, 2, 2)

    with pytest.raises(ValueError, match=re.escape(match)):
        call(A)
