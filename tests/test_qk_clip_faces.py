"""QK-clip inside the optimizer step, both faces: the attention's LogitTracker sees q and k in the
forward, the step clips the owners' q/k weights after the update. Checked against the pure
`qk_clip` applied by hand to the unclipped step's weights (bitwise), the guarantee on the same
input (lr 0: the update leaves the weights, so the max logit lands on τ), grouped-query heads,
identical weights on every rank, and the compiled functional step in one graph."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon_fn as dmuon
from dmuon_fn import NSConfig
from dmuon_fn.planning._partition import partition
from dmuon_fn.planning._view import RankView
from tests._dist import run_ranks
from tests._models import full_params

H, HKV, D, HIDDEN, T = 4, 2, 4, 16, 6
HEADS = {"attn": dmuon.ClipHeads("attn.q_proj.weight", "attn.k_proj.weight", H, HKV)}


class Attn(nn.Module):
    def __init__(self, tracker: dmuon.LogitTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.q_proj = nn.Linear(HIDDEN, H * D, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HKV * D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, HKV, D).transpose(1, 2)
        self.tracker.observe("attn", q, k)
        k = k.repeat_interleave(H // HKV, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return (att @ k).transpose(1, 2).reshape(B, T, H * D)


class Net(nn.Module):
    def __init__(self, tracker: dmuon.LogitTracker) -> None:
        super().__init__()
        self.attn = Attn(tracker)
        self.out = nn.Linear(H * D, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x))


def _model(tracker: dmuon.LogitTracker) -> Net:
    torch.manual_seed(0)
    net = Net(tracker)
    with torch.no_grad():
        net.attn.q_proj.weight[:D] *= 8.0  # head 0's logits far above the others'
    return net


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, T, HIDDEN, generator=g), torch.randn(4, T, HIDDEN, generator=g)


def _tau() -> float:
    """Between head 0's max logit and every other head's, on the test batch."""
    tr = dmuon.LogitTracker()
    with torch.no_grad():
        _model(tr)(_batch()[0])
    m = tr.max("attn")
    assert m[0] > 2 * m[1:].max()
    return float(m[1:].max() + m[0]) / 2


def _logits(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    tr = dmuon.LogitTracker()
    net.attn.tracker = tr
    with torch.no_grad():
        net(x)
    return tr.max("attn")


def _functional(lr: float, clip: bool, compiled: bool = False):
    tracker = dmuon.LogitTracker()
    model = _model(tracker)
    fp = dmuon.plan(model)
    qk = {"qk_clip_tau": _tau(), "qk_clip_heads": HEADS} if clip else {}
    cfg = dmuon.Config(lr=lr, weight_decay=0.0, ns=NSConfig(dtype=torch.float32), **qk)
    state = dmuon.init(model, fp, cfg)

    def loss_fn(params, batch):
        x, y = batch
        out = torch.func.functional_call(model, params, (x,))
        maxes = tracker.maxima()
        tracker.clear()  # nothing made inside the transform stays outside it but its outputs
        return ((out - y) ** 2).mean(), maxes

    vg = dmuon.value_and_grad(loss_fn, fp, has_aux=True)

    def step(state, batch):
        (_, maxes), grads = vg(state.params, batch)
        return dmuon.update(grads, state, max_logits=maxes if clip else None)

    if compiled:
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    maxes = _logits(_model(dmuon.LogitTracker()), _batch()[0])
    return step(state, _batch()), model, maxes


@pytest.mark.parametrize("compiled", [False, True])
def test_functional_clip_is_the_pure_clip_of_the_updated_weights(compiled):
    plain, _, _ = _functional(0.05, clip=False)
    clipped, _, maxes = _functional(0.05, clip=True, compiled=compiled)
    want = dmuon.qk_clip(
        plain.params["attn.q_proj.weight"],
        plain.params["attn.k_proj.weight"],
        maxes,
        tau=_tau(),
        num_heads=H,
        num_kv_heads=HKV,
    )
    assert torch.equal(clipped.params["attn.q_proj.weight"], want.w_q)
    assert torch.equal(clipped.params["attn.k_proj.weight"], want.w_k)
    assert torch.equal(clipped.params["out.weight"], plain.params["out.weight"])
    q0, q1 = clipped.params["attn.q_proj.weight"], plain.params["attn.q_proj.weight"]
    assert torch.equal(q0[D:], q1[D:])  # the heads left alone keep their bits
    assert not torch.equal(q0[:D], q1[:D])


def test_functional_clip_brings_the_head_to_tau_on_the_same_input():
    state, model, before = _functional(0.0, clip=True)
    tau = _tau()
    assert before[0] > tau
    model.load_state_dict(state.params, strict=False)
    after = _logits(model, _batch()[0])
    assert after[0] <= tau * (1 + 1e-5)
    assert after[0] >= tau * (1 - 1e-5)  # clipped to τ, not below
    assert torch.all(after <= tau * (1 + 1e-5))


def _object(rank: int, world: int, lr: float) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    tracker = dmuon.LogitTracker()
    model = _model(tracker)
    dmuon.dedicate_params(model, mesh, pure=True)
    opt = dmuon.Muon(
        model,
        lr=lr,
        weight_decay=0.0,
        ns_dtype=torch.float32,
        qk_clip_tau=_tau(),
        qk_clip_heads=HEADS,
        logit_tracker=tracker,
    )
    x, y = _batch()
    per = x.shape[0] // world
    (
        (model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2
    ).mean().backward()
    opt.step()
    opt.wait_publish()
    return {
        "params": full_params(model, cast=False),
        "reset": bool(tracker.max("attn").isinf().all()),
    }


@pytest.mark.slow
def test_object_api_clips_like_the_functional_step_on_every_rank():
    want, _, _ = _functional(0.05, clip=True)
    results = run_ranks(_object, 2, 0.05)
    for r in results:
        assert r["reset"]
        for n in ("attn.q_proj.weight", "attn.k_proj.weight", "out.weight"):
            got, w = r["params"][n], want.params[n]
            assert (got - w).norm() / w.norm() < 1e-5, n
    for n, v in results[0]["params"].items():
        assert torch.equal(v, results[1]["params"][n]), n


def test_qk_clip_needs_its_tracker_and_matrices():
    tracker = dmuon.LogitTracker()
    with pytest.raises(ValueError, match="qk_clip_tau > 0"):
        dmuon.Config(qk_clip_heads=HEADS)
    cfg = dmuon.Config(qk_clip_tau=1.0, qk_clip_heads={"x": dmuon.ClipHeads("nope", "nope", 2)})
    with pytest.raises(ValueError, match="not Muon matrices"):
        dmuon.init(_model(tracker), dmuon.plan(_model(tracker)), cfg)


def test_qk_clip_heads_that_do_not_split_into_heads_raise_at_setup():
    tracker = dmuon.LogitTracker()
    # q_proj has H·D = 16 rows: 3 heads do not divide them
    bad = {"attn": dmuon.ClipHeads("attn.q_proj.weight", "attn.k_proj.weight", 3, 1)}
    cfg = dmuon.Config(qk_clip_tau=1.0, qk_clip_heads=bad)
    with pytest.raises(ValueError, match=r"qk_clip_heads\['attn'\].*check the head counts"):
        dmuon.init(_model(tracker), dmuon.plan(_model(tracker)), cfg)


def test_qk_clip_of_a_weight_on_a_team_raises_at_setup():
    tracker = dmuon.LogitTracker()
    model = _model(tracker)
    fp = dmuon.plan(model)
    shapes = dict(zip(fp.names, fp.shapes, strict=True))
    ew = [n for n in fp.names if n not in fp.muon]
    teamed = partition(shapes, 2, elementwise=ew, teams={"attn.q_proj.weight": 2})
    fp = dataclasses.replace(fp, view=RankView(teamed))  # rank 0 of 2, the q weight on a team
    heads = {"attn": dmuon.ClipHeads("attn.q_proj.weight", "attn.k_proj.weight", 2, 1)}
    cfg = dmuon.Config(qk_clip_tau=1.0, qk_clip_heads=heads)
    with pytest.raises(ValueError, match=r"on a team .*teams=\{'attn.q_proj.weight': 1\}"):
        dmuon.init(model, fp, cfg)
