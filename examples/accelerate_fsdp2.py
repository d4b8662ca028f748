"""HF accelerate's FSDP2 plugin with dmuon_fn (docs/integrations/accelerate.md), on GPUs:

    torchrun --nproc_per_node=N examples/accelerate_fsdp2.py [--out DIR]

A small Llama from a config, its decoder matrices dedicated and the rest sharded per layer;
`prepare`, `backward`, `clip_grad_norm_`, `Muon.step` for 5 steps, `save_state` after step 3,
a fresh model resumed from it by `load_state` (its losses must equal the first run's), then
`get_state_dict` + `save_pretrained`, reloaded by `from_pretrained` on rank 0 (its logits must
equal the trained model's). Exits 1 on a mismatch. accelerate turns its FSDP plugin on only for
accelerator devices (on CPU ranks it reports MULTI_CPU and would wrap the model in DDP): there
the script says so and exits 2; tests/test_accelerate.py runs the same path on CPU ranks."""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import transformers
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon

STEPS, SAVE_AT, BATCH, SEQ, VOCAB = 5, 3, 8, 32, 256


def build(acc: Accelerator) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(acc.device)
    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2 and ".layers." in n)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(acc: Accelerator, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH * acc.num_processes, SEQ), generator=g)
    return ids.chunk(acc.num_processes)[acc.process_index].to(acc.device)


def train(acc, model, opt, steps, save=None) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        ids = batch(acc, step)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        acc.print(f"step {step} loss={losses[-1]:.6f}")
        if save is not None and step + 1 == SAVE_AT:
            acc.save_state(save)
    return losses


def prepared(acc: Accelerator):
    model = build(acc)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)
    return acc.prepare(model, opt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="where the checkpoint and the export go")
    out = ap.parse_args().out or tempfile.mkdtemp(prefix="dmuon-accelerate-")
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    if not acc.is_fsdp2:
        print(
            f"accelerate runs {acc.distributed_type} here, not FSDP: its FSDP plugin is on only "
            "for accelerator devices (tests/test_accelerate.py runs this path on CPU ranks)",
            file=sys.stderr,
        )
        return 2
    model, opt = prepared(acc)
    losses = train(acc, model, opt, range(STEPS), save=f"{out}/state")
    full = acc.get_state_dict(model)  # rank 0: every parameter whole, on the CPU
    probe = batch(acc, STEPS)[:1]
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float().cpu()
    if acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(f"{out}/hf", state_dict=full)
    acc.wait_for_everyone()

    model, opt = prepared(acc)
    acc.load_state(f"{out}/state")
    resumed = train(acc, model, opt, range(SAVE_AT, STEPS))
    ok = resumed == losses[SAVE_AT:]
    acc.print(f"resume from step {SAVE_AT}: {'bit-exact' if ok else f'{resumed} != {losses}'}")
    if acc.is_main_process:
        plain = transformers.LlamaForCausalLM.from_pretrained(f"{out}/hf").to(acc.device)
        with torch.no_grad():
            want = plain(input_ids=probe).logits.float().cpu()
        err = ((logits - want).norm() / want.norm()).item()
        acc.print(f"from_pretrained logits: relative error {err:.2e}")
        ok = ok and err <= 1e-5
    acc.wait_for_everyone()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
