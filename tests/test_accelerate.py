"""HF accelerate with its FSDP2 plugin as a client (docs/integrations/accelerate.md): a small
Llama, dedicated and sharded, through `prepare`, `backward`, `clip_grad_norm_`, `save_state` /
`load_state` and `get_state_dict` + `save_pretrained`, on 2 gloo ranks, against the plain loop
(tests/_trainers.py says why accelerate's FSDP2 path needs `fsdp2_on_cpu` on CPU ranks)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests._models import muon_fp32
from tests._trainers import (
    MAX_NORM,
    STEPS,
    fsdp2_on_cpu,
    ids,
    llama,
    plain_losses,
    trainer_env,
)

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

SAVE_AT = 3  # save_state after this many steps, resume from it


def _prepared(world):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    fsdp2_on_cpu(plugin)
    assert acc.is_fsdp2
    model = llama(world)
    opt = muon_fp32(model)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _steps(acc, model, opt, rank, world, steps, save=None):
    losses = []
    for step in steps:
        opt.zero_grad()
        x = ids(step, rank, world)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
        if save is not None and step + 1 == SAVE_AT:
            acc.save_state(save)
    return losses


def _run(rank, world, path):
    trainer_env(rank, world)
    plain = plain_losses(rank, world)
    acc, model, opt = _prepared(world)
    losses = _steps(acc, model, opt, rank, world, range(STEPS), save=f"{path}/state")
    full = acc.get_state_dict(model)  # rank 0: every parameter whole, on the CPU
    values = {k: v.clone() for k, v in full.items()}  # (save_pretrained empties the dict)
    probe = ids(STEPS, 0, 1)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(f"{path}/hf", state_dict=full)
    acc.wait_for_everyone()

    acc, model, opt = _prepared(world)  # a fresh model and optimizer
    acc.load_state(f"{path}/state")
    resumed = _steps(acc, model, opt, rank, world, range(SAVE_AT, STEPS))
    return plain, losses, resumed, logits, values


@pytest.mark.slow
def test_accelerate_fsdp2_trains_resumes_and_exports_as_the_plain_loop(tmp_path):
    import transformers

    got = run_ranks(_run, 2, str(tmp_path))
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    for rank, (plain, losses, resumed, logits, values) in enumerate(got):
        for a, b in zip(losses, plain, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, losses, plain)
        assert resumed == losses[SAVE_AT:], (rank, resumed, losses)  # bit for bit
        if rank == 0:
            assert values.keys() == exported.state_dict().keys()
            for n, v in exported.state_dict().items():
                assert torch.equal(v, values[n]), n
            with torch.no_grad():
                want = exported(input_ids=ids(STEPS, 0, 1)).logits
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
