"""Lightning 2.6 as a client (docs/integrations/lightning.md): `ModelParallelStrategy` with
`dedicate_params` + `fully_shard` in `configure_model` and `Muon` from `configure_optimizers`;
Lightning's gradient clipping and accumulation against the same model in a plain loop, clipped
by Muon's own `max_grad_norm`; `trainer.save_checkpoint` and `fit(ckpt_path=...)` in both forms
(a DCP folder, one consolidated file), bit-exact against the uninterrupted run; a precision
that casts the model after setup refused.

The ranks come from the suite's harness (tests/_dist.py), their default group already joined:
with `LOCAL_RANK` set, Lightning's `LightningEnvironment` takes the processes as created outside
and the strategy keeps the group it finds (no launcher, no second `init_process_group`)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import TinyMLP, batch, full_params, is_proj, make, muon_fp32

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402

STEPS, SPLIT, CLIP, ACCUMULATE = 5, 2, 0.05, 2


class Batches:
    """The rank's batches of steps [start, n), resumable: Lightning saves `state_dict()` in its
    checkpoint and hands it back on resume, so a run resumed mid-epoch goes on with the next
    step's batch."""

    def __init__(self, rank: int, n: int = STEPS):
        self.rank, self.n, self.start = rank, n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for step in range(self.start, self.n):
            self.start = step + 1
            yield batch("mlp", step, self.rank)
        self.start = 0

    def state_dict(self) -> dict:
        return {"start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["start"]


class Module(L.LightningModule):
    """What a Lightning user writes: dedicate, then shard, in `configure_model` (which every
    `fit` / `validate` calls again: sharded once), Muon in `configure_optimizers`."""

    def __init__(self, rank: int, n: int = STEPS):
        super().__init__()
        self.model, self.rank, self.n, self.losses = make("mlp"), rank, n, []

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        dmuon.dedicate_params(self.model, mesh, is_proj)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return muon_fp32(self.model)

    def training_step(self, x, index):
        loss = self.model(x)
        self.losses.append(loss.detach().clone())
        return loss

    def train_dataloader(self):
        return Batches(self.rank, self.n)


def _trainer(tmp: str, steps: int, distributed: bool = True, **kw) -> L.Trainer:
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        **kw,
    )


def _plain(rank: int, mesh, steps: int, micro: int = 1) -> tuple[list, list]:
    """The same dedicated model in a plain loop, clipped by Muon's own `max_grad_norm`: the
    micro-batches' losses and each step's norm before clipping."""
    model = make("mlp")
    dmuon.dedicate_params(model, mesh, is_proj)
    fully_shard(model, mesh=mesh)
    opt = muon_fp32(model, max_grad_norm=CLIP)
    losses, norms = [], []
    for step in range(steps):
        for i in range(step * micro, (step + 1) * micro):
            loss = model(batch("mlp", i, rank))
            losses.append(loss.detach().clone())
            (loss / micro).backward()
        opt.step()
        norms.append(opt.grad_norm.clone())
        opt.zero_grad()
    return losses, norms


def _plain_keys(sd: dict) -> dict:
    """A LightningModule's full model dict under the plain model's keys."""
    return {k.removeprefix("model."): v for k, v in sd.items()}


def _run(rank, world, tmp, distributed):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    whole = Module(rank)
    _trainer(tmp, STEPS, distributed).fit(whole)
    first = Module(rank)
    trainer = _trainer(tmp, SPLIT, distributed)
    trainer.fit(first)
    saved = full_params(first.model, cast=False)  # every value whole, fp32 as held
    path = os.path.join(tmp, "ckpt" if distributed else "ckpt.pt")
    trainer.save_checkpoint(path)
    second = Module(rank)
    _trainer(tmp, STEPS, distributed).fit(second, ckpt_path=path)
    plain, norms = _plain(rank, whole.device_mesh["data_parallel"], STEPS)
    loads = None
    if rank == 0:  # the checkpoint as one plain dict: into the plain model, strictly
        if distributed:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(path, os.path.join(tmp, "converted.pt"))
            path = os.path.join(tmp, "converted.pt")
        sd = _plain_keys(torch.load(path, weights_only=False)["state_dict"])
        ref = TinyMLP()
        ref.load_state_dict(sd, strict=True)
        loads = all(torch.equal(sd[n], saved[n]) for n in saved)
    dist.barrier()
    return {
        "whole": whole.losses,
        "resumed": first.losses + second.losses,
        "plain": plain,
        "norms": norms,
        "loads": loads,
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs()).max().item()


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [True, False], ids=["dcp", "consolidated"])
def test_lightning_trains_clips_and_resumes(tmp_path, distributed):
    """5 steps at parity with the plain loop (≤ 1e-5 relative losses, every step clipped);
    2 + save + resume for 3: the losses of the uninterrupted run bit for bit; the checkpoint
    holds the trained weights whole and loads into the plain model strictly."""
    results = run_ranks(_run, 2, str(tmp_path), distributed)
    for r in results:
        whole, resumed, plain = (torch.stack(r[k]) for k in ("whole", "resumed", "plain"))
        assert len(r["resumed"]) == STEPS
        assert _rel(whole, plain) <= 1e-5
        assert torch.equal(resumed, whole)
        assert min(r["norms"]) > CLIP  # the clip acted on every step
    assert results[0]["loads"] is True


def _accumulate_and_cast(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    module = Module(rank, n=SPLIT * ACCUMULATE)
    _trainer(tmp, SPLIT, accumulate_grad_batches=ACCUMULATE).fit(module)
    plain, _ = _plain(rank, module.device_mesh["data_parallel"], SPLIT, micro=ACCUMULATE)
    refused = ""
    try:  # HalfPrecision's convert_module: model.to(bfloat16) after configure_model
        _trainer(tmp, 1, precision="bf16-true").fit(Module(rank))
    except ValueError as err:
        refused = str(err)
    return torch.stack(module.losses), torch.stack(plain), refused


def test_lightning_accumulates_and_refuses_a_cast_after_setup(tmp_path):
    """accumulate_grad_batches=2: at parity with the plain loop of two micro-batches per
    step (each reduced as it comes: ModelParallelStrategy blocks no sync); precision='bf16-true'
    casts the model after dedicate_params: refused on every rank, naming param_dtype."""
    for losses, plain, refused in run_ranks(_accumulate_and_cast, 2, str(tmp_path)):
        assert len(losses) == SPLIT * ACCUMULATE
        assert _rel(losses, plain) <= 1e-5
        assert "param_dtype" in refused and "bf16-true" in refused
