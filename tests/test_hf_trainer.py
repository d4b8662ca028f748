"""HF Trainer as a client (docs/integrations/hf_trainer.md): a small Llama, dedicated and
sharded, trained 5 steps by `Trainer` with Muon, clipping by `max_grad_norm`, against the plain
loop; then resumed from its own step-3 checkpoint, bit for bit.

- 2 ranks, FSDP2 (`fsdp=True`, `fsdp_config={"version": 2, ...}`): Trainer refuses
  `optimizers=` under FSDP, so Muon comes from `create_optimizer`, the way transformers names
  for it; the checkpoint is Trainer's default, full state dicts, optimizer included.
- 1 rank: `Trainer(optimizers=(Muon, scheduler))` with a warmup schedule.

Trainer's accelerator is accelerate's: on CPU ranks its FSDP2 path needs `fsdp2_on_cpu`
(tests/_trainers.py says why)."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests._models import muon_fp32
from tests._trainers import (
    BATCH,
    MAX_NORM,
    STEPS,
    fsdp2_on_cpu,
    ids,
    llama,
    plain_losses,
    trainer_env,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SAVE_AT = 3


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


class _Rows(torch.utils.data.Dataset):
    """Every step's global batch, row by row: Trainer's sequential sampler and accelerate's
    batch split give rank r of `w` the rows `ids(step, r, w)`."""

    def __init__(self):
        self.rows = torch.cat([ids(s, 0, 1) for s in range(STEPS)])
        assert len(self.rows) == STEPS * BATCH

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class _Trainer(transformers.Trainer):
    """Records each step's loss; under FSDP, Muon from `create_optimizer` (and, on CPU ranks,
    accelerate's FSDP2 path switched on)."""

    losses: list

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.args.fsdp:  # CPU ranks
            from accelerate.utils import FullyShardedDataParallelPlugin

            fsdp2_on_cpu(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = muon_fp32(self.model)
        return self.optimizer

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.item())
        return loss


def _args(path: str, world: int, **extra) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=path,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=BATCH // world,
        train_sampling_strategy="sequential",
        max_grad_norm=MAX_NORM,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        report_to="none",
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def _trainer(rank: int, world: int, path: str) -> _Trainer:
    model = llama(world)
    if world > 1:
        fsdp = {"version": 2, "auto_wrap_policy": "NO_WRAP"}  # sharded already, by layer
        args = _args(path, world, fsdp=True, fsdp_config=fsdp)
        t = _Trainer(model=model, args=args, train_dataset=_Rows())
    else:
        opt = muon_fp32(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
        t = _Trainer(
            model=model,
            args=_args(path, world),
            train_dataset=_Rows(),
            optimizers=(opt, sched),
        )
    t.losses = []
    return t


def _run(rank: int, world: int, path: str):
    if world > 1:  # (a process of its own has no torchrun variables: accelerate's type NO)
        trainer_env(rank, world)
    plain = plain_losses(rank, world, schedule=warmup if world == 1 else None)
    t = _trainer(rank, world, path)
    t.train()
    t.save_model(f"{path}/final")  # every rank: a collective gather under FSDP
    with torch.no_grad():
        logits = t.model(input_ids=ids(STEPS, 0, 1)).logits
    resumed = _trainer(rank, world, path)
    resumed.train(resume_from_checkpoint=f"{path}/checkpoint-{SAVE_AT}")
    return plain, t.losses, resumed.losses, logits


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_hf_trainer_trains_and_resumes_as_the_plain_loop(tmp_path, world):
    got = run_ranks(_run, world, str(tmp_path))
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        want = exported(input_ids=ids(STEPS, 0, 1)).logits
    for rank, (plain, losses, resumed, logits) in enumerate(got):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)
        assert len(losses) == STEPS
        for a, b in zip(losses, plain, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, losses, plain)
        assert resumed == losses[SAVE_AT:], (rank, resumed, losses)  # bit for bit
