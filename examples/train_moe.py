"""A small MoE transformer trained twice from one seed on identical batches: dmuon_fn.Muon with
QK-clip (dedicate_params + FSDP2) against FSDP2 + torch.optim.AdamW.

torchrun --nproc_per_node=4 examples/train_moe.py [--steps 150] [--tau 10] [--no-qk-norm]

The model is transformers' Qwen3-MoE built from a small config: experts fused in 3-D tensors,
`mlp.experts.gate_up_proj` (E, 2·I, hidden) with the gate rows first and `down_proj` (E, hidden,
I), a softmax top-k router, grouped-query attention with RMSNorm on each query and key head
(q_norm / k_norm). Where transformers is not installed (or with --model own) it is the same
layout from examples/_moe_model.py. Nothing is downloaded: the text is the grammar corpus of
examples/data/grammar.py, character level.

Muon orthogonalizes the attention projections and every expert's matrices: each expert's gate
and up blocks on their own (`batch1,rows=I+I`), each expert's down matrix (`batch1`, the 3-D
default). Router, embedding, head and norms take AdamW inside Muon. QK-clip (MuonClip) runs
after every Muon step: the attentions report the per-head max logits of the step's forward to a
LogitTracker, and a query head whose max exceeded --tau gets its q_proj rows and its key head's
k_proj rows scaled down. The AdamW run observes the same logits and clips nothing.

Qwen3's q_norm / k_norm normalize each query and key head after the projection, so scaling
q_proj or k_proj rows does not change the logits: the clip cannot pull them down (see
docs/matrices.md), and each step that finds a head above τ shrinks its rows again. --no-qk-norm
drops those norms in both runs; then the clip bounds the logits.

Rank 0 prints the plan, every step's loss (the mean cross-entropy over all ranks' rows, in nats
per character), the largest logit and the heads above τ, then one comparison line. The exit
status is 1 when a loss is not finite or the Muon run's loss did not go down.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _corpus import VOCAB, schedule, split, train_batch
from _launch import finish, init
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon

TRACKED = "dmuon_fn_tracked_sdpa"  # the attention function registered with transformers

try:
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:
    transformers = None


def tracked_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, after the LogitTracker set on the attention module has seen
    the q and k it multiplies. Qwen3-MoE's attention calls this with q (B, H, T, d) and k (B,
    Hkv, T, d) after q_norm / k_norm and after the rotary embedding: q·kᵀ·scaling are exactly
    the pre-softmax logits, before the key heads are repeated for their query heads (the
    tracker maps query head h to key head h // (H / Hkv), as transformers' repeat_kv does).

    What it sees with qk-norm: each query and key head leaves its RMSNorm with RMS 1 times the
    norm's gain g, and the rotation keeps its length, so a logit is at most
    scaling·|g_q ⊙ q̂|·|g_k ⊙ k̂| ≤ sqrt(d)·max|g_q|·max|g_k|, 4 at initialization here (d = 16;
    the first step sees 3.4). The logits grow only through the gains (AdamW's, in both runs),
    not through q_proj / k_proj: the default run's largest is about 7 with Muon, 5 with AdamW."""
    tracker = getattr(module, "logit_tracker", None)
    if tracker is not None:
        if attention_mask is None:  # no padding here: SDPA runs causal
            pairs = {"causal": True}
        elif attention_mask.dtype == torch.bool:
            pairs = {"mask": attention_mask}
        else:
            raise ValueError("an additive attention mask: pass a bool mask or none")
        tracker.observe(module.logit_key, query, key, scale=kwargs["scaling"], **pairs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


if transformers is not None:
    transformers.AttentionInterface.register(TRACKED, tracked_sdpa)


def make_model(args) -> nn.Module:
    """The model, from the seed: both runs start from the same weights."""
    torch.manual_seed(args.seed)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.inter,
    )
    if args.model == "qwen3":
        cfg = transformers.Qwen3MoeConfig(
            **shape,
            intermediate_size=4 * args.hidden,  # dense MLP width: unused, every layer is MoE
            max_position_embeddings=args.seq,
            tie_word_embeddings=False,
            attn_implementation=TRACKED,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg).float()
        if not args.qk_norm:
            for layer in model.model.layers:
                layer.self_attn.q_norm = nn.Identity()
                layer.self_attn.k_norm = nn.Identity()
        return model
    from _moe_model import MoeConfig, MoeForCausalLM

    return MoeForCausalLM(MoeConfig(**shape, qk_norm=args.qk_norm))


def attentions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(key, attention module) per layer; the key names the layer, as the ClipHeads do."""
    return [(f"model.layers.{i}", layer.self_attn) for i, layer in enumerate(model.model.layers)]


def is_muon_matrix(name: str, p: nn.Parameter) -> bool:
    """The attention projections and the experts; router, embedding, head and norms: AdamW."""
    return p.ndim >= 2 and (".self_attn." in name or ".mlp.experts." in name)


def build(args, device: str, mesh, muon: bool):
    model = make_model(args).to(device)
    tracker = dmuon.LogitTracker()
    for key, attn in attentions(model):
        attn.logit_tracker, attn.logit_key = tracker, key
    heads = {
        key: dmuon.ClipHeads(
            f"{key}.self_attn.q_proj.weight",
            f"{key}.self_attn.k_proj.weight",
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
        )
        for key, _ in attentions(model)
    }
    if muon:
        # each expert's gate_up_proj (2·I, hidden) is two matrices, gate rows then up rows: each
        # gets its own orthogonal update; down_proj is a batch of E matrices by default
        blocks = {"*.mlp.experts.gate_up_proj": f"batch1,rows={args.inter}+{args.inter}"}
        dmuon.dedicate_params(model, mesh, predicate=is_muon_matrix, blocks=blocks)
        if dist.get_rank() == 0:
            print(dmuon.plan_summary(model), flush=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    betas = (0.9, 0.95)
    if muon:
        opt = dmuon.Muon(
            model,
            lr=args.muon_lr,
            weight_decay=args.wd,
            adamw_lr=args.rest_lr,
            adamw_betas=betas,
            adamw_weight_decay=args.wd,
            qk_clip_tau=args.tau,
            qk_clip_heads=heads,
            logit_tracker=tracker,
        )
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=args.adamw_lr, betas=betas, weight_decay=args.wd
        )
    return model, opt, tracker


def losses(model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-character cross-entropy, load-balancing loss) on rows (B, seq + 1)."""
    out = model(input_ids=rows[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), rows[:, 1:].flatten())
    return ce, out.aux_loss


def train(args, name: str, data, val_rows, device, mesh, rank, world) -> dict:
    model, opt, tracker = build(args, device, mesh, muon=name == "Muon")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(args))
    keys = [key for key, _ in attentions(model)]
    n_heads = len(keys) * args.heads
    curve, peak, clipped, ever = [], -math.inf, 0, torch.zeros(n_heads, dtype=torch.bool)
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = train_batch(data, step, args, rank, world).to(device)
        opt.zero_grad()
        ce, aux = losses(model, x)
        (ce + args.aux * aux).backward()
        # this step's per-head max logits over every rank's rows, read before Muon's step clips
        # with them (and resets the tracker); the AdamW run resets it here. The heads above τ
        # are the ones the step clips (all of them, unless a non-finite gradient skips it).
        maxes = torch.cat([tracker.max(k).float() for k in keys])
        opt.step()
        sched.step()
        if name == "AdamW":
            tracker.reset()
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        loss = ce.detach().float().reshape(1)
        dist.all_reduce(loss)
        curve.append(loss.item() / world)
        over = (maxes > args.tau).cpu()
        clipped += int(over.sum())
        ever |= over
        peak = max(peak, maxes.max().item())
        if rank == 0:
            what = "clipped" if name == "Muon" else "above tau"
            print(
                f"{name:5s} step {step:4d}  loss {curve[-1]:.4f}  max logit "
                f"{maxes.max().item():6.2f}  heads {what} {int(over.sum())}/{n_heads}",
                flush=True,
            )
    wall = time.perf_counter() - t0
    with torch.no_grad():
        val = losses(model, val_rows)[0].detach().float().reshape(1)
    dist.all_reduce(val)
    return {
        "train": curve,
        "val": val.item() / world,
        "peak": peak,
        "clipped": clipped,
        "ever": int(ever.sum()),
        "heads": n_heads,
        "wall": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--tau", type=float, default=10.0, help="QK-clip's largest logit per head")
    ap.add_argument("--no-qk-norm", dest="qk_norm", action="store_false", help="drop q/k_norm")
    ap.add_argument("--model", choices=["auto", "qwen3", "own"], default="auto")
    ap.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--inter", type=int, default=32, help="each expert's hidden width I")
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight")
    # learning rates swept at the other defaults (val loss after 150 steps, one seed): AdamW
    # 1e-3: 2.089, 2e-3: 1.707, 3e-3: 1.577, 5e-3: 1.636, 1e-2: 1.753, 2e-2: 1.658, 3e-2: 1.805;
    # Muon (matrices / rest) 2e-2 / 1e-2: 0.766, 4e-2 / 1e-2: 0.807, 2e-2 / 2e-2: 0.729,
    # 1e-2, 2e-2, 4e-2, 8e-2 / 3e-3: 0.957, 0.957, 0.931, 1.005
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3, help="the AdamW run's")
    ap.add_argument("--rest-lr", type=float, default=1e-2, help="Muon's AdamW on the rest")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=0.05, help="fraction of the steps")
    ap.add_argument("--val-rows", type=int, default=32, help="held-out sequences, all ranks")
    ap.add_argument("--chars", type=int, default=200_000, help="corpus size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["Muon", "AdamW"], help="one run, for lr sweeps")
    args = ap.parse_args()
    if args.model == "auto":
        args.model = "own" if transformers is None else "qwen3"
    elif args.model == "qwen3" and transformers is None:
        ap.error("--model qwen3 needs transformers (pip install 'transformers>=5,<6')")

    device, rank, world = init()
    train_data, _, val_rows = split(args, rank, world, device)
    mesh = init_device_mesh(device, (world,))
    if rank == 0:
        name = (
            f"transformers {transformers.__version__} Qwen3-MoE"
            if args.model == "qwen3"
            else "examples/_moe_model.py"
        )
        print(
            f"model: {name}, hidden {args.hidden}, {args.layers} layers, {args.heads} query / "
            f"{args.kv_heads} key heads, {args.experts} experts (top {args.top_k}, I "
            f"{args.inter}), qk-norm {'on' if args.qk_norm else 'off'}; {world} ranks, global "
            f"batch {args.batch} x {args.seq} characters; QK-clip tau {args.tau:g}",
            flush=True,
        )

    names = [n for n in ("Muon", "AdamW") if args.only in (None, n)]
    runs = {n: train(args, n, train_data, val_rows, device, mesh, rank, world) for n in names}
    w = min(10, args.steps)
    last = {k: sum(r["train"][-w:]) / w for k, r in runs.items()}
    finite = all(math.isfinite(v) for r in runs.values() for v in [*r["train"], r["val"]])
    decreased = "Muon" not in runs or last["Muon"] < runs["Muon"]["train"][0]
    if rank == 0 and args.only:
        r = runs[args.only]
        print(
            f"{args.only}: train loss (mean of the last {w}) {last[args.only]:.4f}, val loss "
            f"{r['val']:.4f}, largest logit {r['peak']:.2f}"
        )
    elif rank == 0:
        muon, adamw = runs["Muon"], runs["AdamW"]
        print(
            f"QK-clip: {muon['clipped']} head-steps clipped ({muon['ever']} of {muon['heads']} "
            f"heads at least once) in {args.steps} steps; largest logit {muon['peak']:.2f} with "
            f"Muon, {adamw['peak']:.2f} with AdamW (tau {args.tau:g})"
        )
        print(
            f"after {args.steps} steps: train loss (mean of the last {w}) Muon {last['Muon']:.4f}"
            f" vs AdamW {last['AdamW']:.4f}, val loss Muon {muon['val']:.4f} vs AdamW "
            f"{adamw['val']:.4f} ({adamw['val'] - muon['val']:+.4f} in Muon's favor); "
            f"training {muon['wall']:.1f} s vs {adamw['wall']:.1f} s",
            flush=True,
        )
    if rank == 0:
        if not finite:
            print("FAILED: a loss is not finite", file=sys.stderr)
        elif not decreased:
            print("FAILED: the Muon run's loss did not go down", file=sys.stderr)
    finish()
    return 0 if finite and decreased else 1


if __name__ == "__main__":
    sys.exit(main())
