"""Muon(gather_in_step=True): the next forward's gathers issued inside the step (dedicated/_muon.py,
proofs/prefetch.md claim 9). The parity with it off, bit for bit and with one collective order
per group, is in tests/test_prefetch.py (the "N+step" depths); here: a checkpoint loaded between
the step and the forward, a parameter changed there (an error on its owner, not a silent
divergence), and the setups it refuses."""

from __future__ import annotations

import tempfile

import pytest
import torch

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import full_params, meshes, muon_fp32
from tests.test_prefetch import Chain, _x

ORDER = (0, 1, 2)


def _prepared(world, z3, in_step):
    mesh, _ = meshes(world, False)
    model = Chain()
    dmuon.dedicate_params(model, mesh, pure=True, reshard_after_forward=z3, prefetch=1)
    return model, muon_fp32(model, gather_in_step=in_step)


def _train(model, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        model(_x(step, rank), ORDER).backward()
        opt.step()


def _load_between(rank, world, z3, path):
    """Three steps, then the checkpoint of step 1 loaded right after the third step (its gathers
    in flight), then two more steps: with and without gather_in_step."""
    out = {}
    for in_step in (False, True):
        model, opt = _prepared(world, z3, in_step)
        _train(model, opt, rank, range(1))
        dmuon.save_checkpoint(f"{path}/{in_step}", model, opt)
        _train(model, opt, rank, range(1, 3))
        dmuon.load_checkpoint(f"{path}/{in_step}", model, opt)
        _train(model, opt, rank, range(3, 5))
        opt.wait_publish()
        out[in_step] = full_params(model, model._dmuon_state)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("z3", [False, True], ids=["z2", "z3"])
def test_a_checkpoint_loaded_after_the_step_is_what_the_next_forward_sees(z3):
    with tempfile.TemporaryDirectory() as path:
        for res in run_ranks(_load_between, 2, z3, path):
            for n, p in res[True].items():
                assert torch.equal(p, res[False][n]), n


def _edit_between(rank, world):
    """Every rank scales the dedicated parameters it holds in full after the step: the values
    the step already sent are stale, and each owner says so at the next forward."""
    model, opt = _prepared(world, False, True)
    _train(model, opt, rank, range(2))
    owned = []
    with torch.no_grad():
        for e in model._dmuon_state.entries:
            if e.param.numel():
                e.param.mul_(0.5)
                owned.append(e.name)
    try:
        model(_x(2, rank), ORDER)
    except RuntimeError as err:
        return dict(owned=owned, error=str(err))
    return dict(owned=owned, error=None)


def test_a_parameter_changed_after_the_step_is_an_error_on_its_owner():
    for res in run_ranks(_edit_between, 2):
        assert res["owned"], "each rank owns some parameter in this plan"
        assert res["error"] is not None, "the stale values went unnoticed"
        assert "changed between optimizer.step() and the next forward" in res["error"]
        assert any(n in res["error"] for n in res["owned"]), res["error"]


def _refused(rank, world):
    out = {}
    mesh, rep = meshes(world, True)
    model = Chain()
    dmuon.dedicate_params(model, mesh, pure=True, replicate_mesh=rep)
    try:
        muon_fp32(model, gather_in_step=True)
    except ValueError as err:
        out["hsdp"] = str(err)
    mesh, _ = meshes(world, False)
    model = Chain()
    dmuon.dedicate_params(model, mesh, pure=True, prefetch=0)
    try:
        muon_fp32(model, gather_in_step=True)
    except ValueError as err:
        out["prefetch 0"] = str(err)
    return out


def test_hsdp_and_prefetch_0_are_refused_with_what_to_do():
    for res in run_ranks(_refused, 4):
        assert "1-D mesh" in res["hsdp"] and "replicate_async" in res["hsdp"]
        assert "prefetch >= 1" in res["prefetch 0"]
