"""MoE expert tensors: one owner per expert tensor vs slices along the expert dim (issue 26).

`dmuon_fn.partition` cuts a batch of matrices (a 3-D expert tensor (E, rows, cols)) that costs
more than a slot's fair share into pieces `name[a:b]` on distinct shard columns; with
`slices=False` every expert tensor has one owner. Printed side by side in one run:

1. One MoE layer planned for 4 ranks (1-D): q/k/v/o attention projections (hidden × hidden), the
   router (E × hidden) and E experts of inter × hidden (768 × 2048 by default) as fused tensors,
   gate_up (E, 2·inter, hidden) with spec "batch1,rows=inter+inter" and down (E, hidden, inter)
   "batch1", at 16 and 64 experts. For slices off and on: the busiest rank's share of the
   Newton-Schulz FLOPs (from the plan), and each rank's Newton-Schulz seconds per step measured
   by running `orthogonalize_blocks` on the parameters and pieces it owns, in the NS iteration
   dtype this CPU's dispatch picks and in fp32. The 4 ranks run one after another in this one
   process (each on all of the machine's cores): 4 ranks side by side would share 2 cores.
   Plans use this CPU's Gram ratio, as the faces do on a CPU rank, so that the plan costs what
   runs here. A rank's seconds: the median of --reps steps, and each call's best of them summed
   (a floor that bursts of load cannot lift). The ratio printed is busiest(one owner) /
   busiest(slices). The full run takes about 7 minutes on 2 idle cores, most of it fp32.
2. The plan summary of qwen3-30b-a3b, gpt-oss-20b and deepseek-v3 (../shared/data/model_shapes)
   at 64 and 1,024 ranks, slices off and on: block matrices as Muon (embeddings, head, biases and
   every 1-D parameter elementwise, as Muon is usually run), the expert tensors with their
   blocks specs (SPECS), every other matrix the default; the default (a GPU's) Gram ratio.

    PYTHONPATH=. python examples/benchmarks/bench_moe.py [--reps 5] [--out FILE] [--quick]

--quick: a layer of 4 and 8 experts of 96 × 256 with 256-wide attention and one repeat, for a
test of the script; the real numbers come from the full run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from _timing import machine

import dmuon_fn
from dmuon_fn.ns._blocks import orthogonalize_blocks
from dmuon_fn.ns._dispatch import dtype_reason, gram_min_aspect, gram_rule, iteration_dtype
from dmuon_fn.planning._slices import join, parse_piece, take

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SHAPES = ROOT.parent / "shared" / "data" / "model_shapes"
# the fused expert tensors as transformers 5 stores them: gate_up's (gate, up) halves per expert
SPECS = {
    "qwen3-30b-a3b": "batch1,rows=768+768",  # (128, 1536, 2048): gate rows, then up rows
    "gpt-oss-20b": "batch1,cols%2",  # (32, 2880, 5760): gate [..., 0::2], up [..., 1::2]
    "deepseek-v3": "batch1,rows=2048+2048",  # (256, 4096, 7168): gate rows, then up rows
}
WORLDS = (64, 1024)
LAYER_RANKS = 4
H100_FLOPS = 4e14  # an assumption, as in bench_summary.py: ~40% of an H100's dense bf16 peak


# ---------------------------------------------------------------------------------------------
# 1. One MoE layer on 4 ranks, measured


def layer_shapes(experts: int, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    attn = {f"layers.0.self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"}
    return {
        **attn,
        "layers.0.mlp.gate.weight": (experts, hidden),
        "layers.0.mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
        "layers.0.mlp.experts.down_proj": (experts, hidden, inter),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
    }


def rank_work(plan: dmuon_fn.Plan, grads: dict[str, torch.Tensor]) -> list[list]:
    """Per slot: (gradient or its piece, blocks spec) of every matrix the slot orthogonalizes."""
    pieces = {p for _, ps in plan.sliced for p in ps}
    work: list[list] = [[] for _ in range(plan.world_size)]
    for i, name in enumerate(plan.names):
        group = plan.gathered_group(name) or (name,)
        if not plan.matrix[i] or group[0] != name:  # a gathered group's NS is its first piece's
            continue
        if name in pieces:  # what the piece (or its gathered group) is of the parameter
            base = parse_piece(name).param
            G = join(group, [take(grads[base], p) for p in group]).contiguous()
        else:
            G = grads[name]
        work[plan.slots[i]].append((G, plan.blocks[i]))
    return work


def run_rank(work: list, cfg: dmuon_fn.NSConfig) -> list[float]:
    """Seconds of each `orthogonalize_blocks` call of one rank's step."""
    out = []
    for G, spec in work:
        t0 = time.perf_counter()
        orthogonalize_blocks(G, spec, cfg)
        out.append(time.perf_counter() - t0)
    return out


def measure_layer(experts: int, inter: int, hidden: int, dtypes, reps: int) -> list[dict]:
    shapes = layer_shapes(experts, inter, hidden)
    gen = torch.Generator().manual_seed(experts)
    grads = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    blocks = {"layers.0.mlp.experts.gate_up_proj": f"batch1,rows={inter}+{inter}"}
    rule = gram_rule(torch.device("cpu"))
    plans = {
        sl: dmuon_fn.partition(shapes, LAYER_RANKS, blocks=blocks, slices=sl, **rule)
        for sl in (False, True)
    }
    works = {sl: rank_work(p, grads) for sl, p in plans.items()}
    cfgs = {dt: dmuon_fn.NSConfig(dtype=dt) for dt in dtypes}
    # warm-up: every block shape in every dtype once, on two of its matrices
    for cfg in cfgs.values():
        for work in works[False]:
            for G, spec in work:
                orthogonalize_blocks(G[:2] if G.dim() == 3 else G, spec, cfg)
    keys = [(dt, sl, r) for dt in dtypes for sl in (False, True) for r in range(LAYER_RANKS)]
    times: dict[tuple, list[list[float]]] = {k: [] for k in keys}  # per repeat, per call
    for _ in range(reps):  # round-robin: drift and other jobs' load hit every candidate alike
        for dt, sl, r in keys:
            times[dt, sl, r].append(run_rank(works[sl][r], cfgs[dt]))
    out = []
    for dt in dtypes:
        for sl in (False, True):
            s = dmuon_fn.plan_summary(plans[sl])
            t = [times[dt, sl, r] for r in range(LAYER_RANKS)]
            med = [statistics.median(map(sum, reps_)) for reps_ in t]  # of the step's seconds
            best = [sum(map(min, zip(*reps_, strict=True))) for reps_ in t]  # calls' best, summed
            out.append(
                {
                    "experts": experts,
                    "dtype": str(dt).removeprefix("torch."),
                    "slices": sl,
                    "units": sum(len(r.matrices) for r in s.slots),
                    "sliced": s.sliced,
                    "plan_busiest": s.busiest,
                    "share": s.busiest_ns_flops / s.total_ns_flops,
                    "imbalance": s.imbalance,
                    "busiest_tflop": s.busiest_ns_flops / 1e12,
                    "median": med,
                    "best": best,
                }
            )
    return out


def layer_tables(rows: list[dict], reps: int) -> list[str]:
    per_plan = [
        "| experts | dtype | slices | units (pieces) | plan: busiest rank, its NS share "
        "| plan: busiest/mean | measured s per rank 0..3 (median) | busiest s, median "
        "| busiest s, best |",
        "|--:|---|---|---|--:|--:|---|--:|--:|",
    ]
    ratios = [
        "| experts | dtype | plan: busiest NS FLOPs off / on | measured: busiest s off / on, "
        "median | best |",
        "|--:|---|--:|--:|--:|",
    ]
    for r in rows:
        pieces = ", ".join(f"{n.rsplit('.', 1)[-1]} in {k}" for n, k in r["sliced"]) or "-"
        per_plan.append(
            f"| {r['experts']} | {r['dtype']} | {'on' if r['slices'] else 'off'} "
            f"| {r['units']} ({pieces}) | rank {r['plan_busiest']}, {100 * r['share']:.1f}% "
            f"| {r['imbalance']:.2f} | {' / '.join(f'{t:.3g}' for t in r['median'])} "
            f"| {max(r['median']):.3g} (rank {r['median'].index(max(r['median']))}) "
            f"| {max(r['best']):.3g} |"
        )
    for off, on in zip(rows[::2], rows[1::2], strict=True):
        ratios.append(
            f"| {off['experts']} | {off['dtype']} "
            f"| {off['busiest_tflop'] / on['busiest_tflop']:.2f}x "
            f"| {max(off['median']) / max(on['median']):.2f}x "
            f"| {max(off['best']) / max(on['best']):.2f}x |"
        )
    note = (
        f"Seconds per step of each rank: the median of its {reps} timed steps; best: each of "
        "its calls' best of those, summed (a floor that a burst of load on the machine cannot "
        "lift)."
    )
    return [*per_plan, "", note, "", *ratios]


# ---------------------------------------------------------------------------------------------
# 2. Real MoE models at 64 and 1,024 ranks, from the plan


def in_block(name: str) -> bool:
    """Inside a repeated block (`layers.3`): not an embedding or the head."""
    return any(part.isdigit() for part in name.split("."))


def model_rows(path: Path, world: int) -> list[dict]:
    spec = json.loads(path.read_text())
    model = spec["model"]
    named = {n: tuple(s) for n, s in spec["params"]}
    ew = [
        n
        for n, s in named.items()
        if len(s) < 2 or not in_block(n) or n.rsplit(".", 1)[-1].endswith("bias")
    ]
    experts = [n for n, s in named.items() if len(s) == 3 and ".experts." in n]
    blocks = {n: SPECS[model] for n in experts if n.endswith("gate_up_proj")}
    out = []
    for sl in (False, True):
        t0 = time.perf_counter()
        plan = dmuon_fn.partition(named, world, elementwise=ew, blocks=blocks, slices=sl)
        s = dmuon_fn.plan_summary(plan, gemm_flops=H100_FLOPS)
        out.append(
            {
                "model": model,
                "world": world,
                "slices": sl,
                "experts": len(experts),
                "summary": s,
                "max_bytes": max(r.nbytes for r in s.slots),
                "plan_ms": 1e3 * (time.perf_counter() - t0),
            }
        )
    return out


def model_table(rows: list[dict]) -> list[str]:
    out = [
        "| model | ranks | slices | expert tensors sliced → pieces | busiest TFLOP "
        "| busiest/mean | busiest/bound | busiest ms @ H100 | largest unit | max fp32 master "
        "GiB/rank | busiest off / on |",
        "|---|--:|---|---|--:|--:|--:|--:|---|--:|--:|",
    ]
    for r in rows:
        s = r["summary"]
        k = [n for _, n in s.sliced]
        cut = f"{len(k)} of {r['experts']} → {sum(k):,} ({min(k)}-{max(k)} each)" if k else "-"
        cut = cut.replace(f"({min(k)}-{min(k)} each)", f"({min(k)} each)") if k else cut
        shape = "×".join(map(str, s.largest_shape))
        off = next(
            x["summary"]
            for x in rows
            if (x["model"], x["world"], x["slices"]) == (r["model"], r["world"], False)
        )
        ratio = f"{off.busiest_ns_flops / s.busiest_ns_flops:.2f}x" if r["slices"] else ""
        out.append(
            f"| {r['model']} | {r['world']:,} | {'on' if r['slices'] else 'off'} | {cut} "
            f"| {s.busiest_ns_flops / 1e12:.3f} | {s.imbalance:.2f} | {s.vs_bound:.3f} "
            f"| {1e3 * s.busiest_seconds:.3g} | `{s.largest.removeprefix('model.')}` {shape} "
            f"| {r['max_bytes'] / 2**30:.2f} | {ratio} |"
        )
    return out


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed steps per rank")
    ap.add_argument("--quick", action="store_true", help="tiny layer, one repeat (a test)")
    ap.add_argument("--shapes", type=Path, default=DEFAULT_SHAPES)
    ap.add_argument("--out", type=Path, help="also write the markdown here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    experts, inter, hidden = ((4, 8), 96, 256) if args.quick else ((16, 64), 768, 2048)
    reps = 1 if args.quick else args.reps
    cpu = torch.device("cpu")
    default = iteration_dtype(cpu)
    dtypes = [default] if default == torch.float32 else [default, torch.float32]
    argv_s = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# MoE expert tensors: one owner vs slices",
        "",
        f"`PYTHONPATH=. python examples/benchmarks/bench_moe.py {argv_s}`".replace(" `", "`"),
        "",
        f"Machine: {machine()}.",
        "",
        f"## One MoE layer on {LAYER_RANKS} ranks: {', '.join(map(str, experts))} experts of "
        f"{inter}×{hidden}, measured",
        "",
        f"Per layer: q/k/v/o {hidden}×{hidden}, router E×{hidden}, gate_up (E, {2 * inter}, "
        f'{hidden}) "batch1,rows={inter}+{inter}", down (E, {hidden}, {inter}) "batch1", two '
        f"norms (elementwise). NS iteration dtype the dispatch picks on this CPU: "
        f"{str(default).removeprefix('torch.')} ({dtype_reason(cpu)}); Gram NS from long/short "
        f">= {gram_min_aspect(cpu)} here (plans use the same ratio). Each rank's seconds are "
        "its `orthogonalize_blocks` calls on what it owns, the ranks timed one after another "
        "in one process on all of this machine's cores.",
        "",
    ]
    layer = [row for E in experts for row in measure_layer(E, inter, hidden, dtypes, reps)]
    lines += layer_tables(layer, reps)
    files = [args.shapes / f"{m}.json" for m in SPECS]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise SystemExit(f"shape files not found: {missing}")
    models = [r for f in files for w in WORLDS for r in model_rows(f, w)]
    lines += [
        "",
        "## MoE models at 64 and 1,024 ranks, from the plan",
        "",
        "Expert gate_up specs: "
        + ", ".join(f'{m} "{s}"' for m, s in SPECS.items())
        + '; down "batch1" (the default). busiest/bound: bound = max(mean, largest unit). '
        f"ms @ H100: the busiest rank's NS FLOPs at an assumed {H100_FLOPS:.0e} FLOP/s.",
        "",
        *model_table(models),
        "",
        f"Planning and summarizing took at most {max(r['plan_ms'] for r in models):.0f} ms "
        f"per row. Whole run: {time.perf_counter() - t_start:.0f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
