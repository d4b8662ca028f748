"""Hidden communication on a slow link: dmuon_fn with prefetch off and on vs FSDP2 + AdamW.

W = 2 CPU ranks (gloo, one thread each, on the 2 cores: compute and communication can run side
by side) train a stack of transformer blocks whose q/k/v/o/up/down projections are dedicated
(the norms go to FSDP2, one `fully_shard` per block). With a rate, the ranks run inside a
private network namespace whose loopback is rate-limited by a token bucket (`ip netns add`,
`tc qdisc add dev lo root tbf rate R burst 256kb latency 200ms`, created and removed here;
nothing outside the namespace is touched; needs root), so communication costs what it costs
between nodes. Without a rate (`none`), plain loopback. "gather in step":
`Muon(gather_in_step=True)`, the next forward's gathers travel during the optimizer step (so
they leave forward+backward and its link bytes, and the step carries them).

Every configuration is built at once and they step round-robin (drift hits all alike). Per
configuration, medians over the timed steps of: forward+backward seconds (until the gradients
have landed, `dmuon_fn.wait_gradients`), step seconds, exposed communication (seconds the
training thread spent blocked in dmuon_fn's gathers, reduces and publishes,
`dmuon_fn.CommTimer`; for FSDP2 + AdamW not measurable this way: "-"), bytes per rank per step
(`CommCounter`) and the bytes that crossed the link in forward+backward (the namespace's
loopback counter: both ranks' sends, protocol overhead included). Next to them two floors:
compute alone (the same per-rank forward+backward with no communication, both ranks at once)
and the link time (those link bytes / the rate). Last, the CPU seconds each rank's process spent
in forward+backward (every thread, user and system: compute, gloo's transport threads, the
loopback's TCP work): with two ranks on two cores, one core per rank, a forward+backward takes
at least that long however well the communication overlaps. Targets (issue 13): dmuon_fn's
forward+backward <= 1.25 x max(compute alone, link time), and at least 2x less exposed
communication than with prefetch off.

Run (as root): python examples/benchmarks/bench_overlap.py [--rates 1gbit,4gbit,none]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _timing import machine
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon_fn as dmuon

WORLD = 2
CONFIGS = ["compute alone", "FSDP2 + AdamW", "dmuon Z2 prefetch off", "dmuon Z2 prefetch on",
           "dmuon Z2 prefetch on, gather in step", "dmuon Z3 prefetch off", "dmuon Z3 prefetch on",
           "dmuon Z3 prefetch on, gather in step"]  # fmt: skip


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)

        def split(t):  # heads by their width: tensor parallel as it is (bench_tp.py)
            return t.view(b, s, -1, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down_proj(F.gelu(self.up_proj(self.ln2(x))))


class Stack(nn.Module):
    def __init__(self, d: int, heads: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _build(config: str, args, mesh):
    model = Stack(args.d, args.heads, args.layers)
    if config == "compute alone":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    if config.startswith("dmuon"):
        dmuon.dedicate_params(
            model,
            mesh,
            predicate=lambda n, p: "proj" in n and p.ndim == 2,
            reshard_after_forward="Z3" in config,
            prefetch=0 if "off" in config else args.prefetch,
            pure=args.pure,
        )
        in_step = "gather in step" in config
        if args.pure:
            return model, dmuon.Muon(model, lr=0.01, adamw_lr=1e-4, gather_in_step=in_step)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward="Z3" in config)
    fully_shard(model, mesh=mesh)
    if config.startswith("dmuon"):
        return model, dmuon.Muon(model, lr=0.01, adamw_lr=1e-4, gather_in_step=in_step)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt, x) -> tuple[float, float, float]:
    """Forward+backward seconds (until the gradients have landed: dmuon_fn's reduces are still in
    flight when backward returns, FSDP2's are not), step seconds, and the CPU seconds the rank's
    process spent in forward+backward (every thread, user and kernel: compute, gloo's transport
    threads, the loopback's TCP work done in their system calls)."""
    dist.barrier()  # every rank starts the step together
    c0, t0 = time.process_time(), time.perf_counter()
    model(x).backward()
    if isinstance(opt, dmuon.Muon):
        dmuon.wait_gradients(model)
    c1, t1 = time.process_time(), time.perf_counter()
    opt.step()
    opt.zero_grad()
    if isinstance(opt, dmuon.Muon):
        opt.wait_publish()
    return t1 - t0, time.perf_counter() - t1, c1 - c0


def _lo_tx() -> int:
    """Bytes sent on this network namespace's loopback so far: what crossed the rate-limited
    link, both ranks' sends together (one token bucket on lo)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no loopback in /proc/net/dev")


def _counted(model, opt, x) -> dict:
    """One more step: the bytes per rank `CommCounter` books (a dispatch mode: it slows every
    op, so it times nothing) and the bytes that crossed the link (both ranks, forward+backward
    until the gradients landed; with no rate, plain lo also carries the rest of the machine's
    local traffic)."""
    comm = dmuon.CommCounter()
    dist.barrier()
    tx0 = _lo_tx()
    with comm:
        with comm.phase("fb"):
            model(x).backward()
            if isinstance(opt, dmuon.Muon):
                dmuon.wait_gradients(model)
        dist.barrier()
        tx1 = _lo_tx()
        with comm.phase("step"):
            opt.step()
            opt.zero_grad()
            if isinstance(opt, dmuon.Muon):
                opt.wait_publish()
    return dict(
        fb_bytes=comm.total_bytes("fb"), step_bytes=comm.total_bytes("step"), wire=tx1 - tx0
    )


def worker(args) -> None:
    """Every configuration built at once and stepped round-robin, so drift in the machine's
    speed falls on all of them alike."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(1, args.tokens, args.d, generator=torch.Generator().manual_seed(rank))
    # compute alone: a plain model on each rank, no process group traffic
    runs = {c: _build(c, args, None if c == "compute alone" else mesh) for c in CONFIGS}
    times = {c: ([], [], [], []) for c in CONFIGS}
    timer = dmuon.CommTimer()
    for i in range(args.warmup + args.steps):
        for config, (model, opt) in runs.items():
            with timer:
                t_fb, t_st, cpu = _step(model, opt, x)
            if i >= args.warmup:
                for column, value in zip(
                    times[config], (t_fb, t_st, timer.total(), cpu), strict=True
                ):
                    column.append(value)
            timer.seconds.clear()
    out = {}
    for config, (model, opt) in runs.items():
        fb, st, exposed, cpu = times[config]
        out[config] = dict(
            fb=statistics.median(fb),
            cpu=statistics.median(cpu),
            step=statistics.median(st),
            exposed=statistics.median(exposed) if config.startswith("dmuon") else None,
            **_counted(model, opt, x),
        )
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _launch(args, rate: str, out: str) -> None:
    """The two ranks, inside a rate-limited namespace (removed afterwards) or on plain lo."""
    ns = None if rate == "none" else f"dmuon_bench_{os.getpid()}"
    missing = [tool for tool in ("ip", "tc") if ns is not None and shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"--rates {rate} needs iproute2's {' and '.join(missing)} (and root) for the "
            "rate-limited namespace; --rates none runs on plain loopback without them"
        )
    prefix = [] if ns is None else ["ip", "netns", "exec", ns]
    try:
        if ns is not None:
            subprocess.run(["ip", "netns", "add", ns], check=True)
            subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], check=True)
            tc = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate]
            subprocess.run(prefix + tc + ["burst", "256kb", "latency", "200ms"], check=True)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
        env["WORLD_SIZE"] = str(WORLD)
        argv = [sys.executable, __file__, "--worker", "--out", out]
        for k in ("d", "heads", "layers", "tokens", "steps", "warmup", "prefetch"):
            argv += [f"--{k}", str(getattr(args, k))]
        argv += ["--pure"] if args.pure else []
        procs = [subprocess.Popen(prefix + argv, env={**env, "RANK": str(r)}) for r in range(WORLD)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"ranks exited with {codes}")
    finally:
        if ns is not None:
            subprocess.run(["ip", "netns", "delete", ns], check=False)


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for u, scale in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit")


def report(rate: str, res: dict) -> None:
    alone = res["compute alone"]["fb"]
    print(f"\n### rate {rate}\n")
    print(
        "| configuration | fwd+bwd s | step s | exposed comm s | MB/rank/step counted "
        "(fwd+bwd, step) | MB on the link (fwd+bwd) | link time s "
        "| fwd+bwd / max(compute, link) | CPU s/rank (fwd+bwd) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for config in CONFIGS:
        r = res[config]
        link = r["wire"] / _rate_bytes(rate) if rate != "none" else 0.0
        floor = max(alone, link)
        exposed = "-" if r["exposed"] is None else f"{r['exposed']:.3f}"
        print(
            f"| {config} | {r['fb']:.3f} | {r['step']:.3f} | {exposed} "
            f"| {r['fb_bytes'] / 2**20:.1f}, {r['step_bytes'] / 2**20:.2f} "
            f"| {r['wire'] / 2**20:.1f} | {link:.3f} | {r['fb'] / floor:.2f}x | {r['cpu']:.3f} |"
        )
    for z in ("Z2", "Z3"):
        off, on = res[f"dmuon {z} prefetch off"], res[f"dmuon {z} prefetch on"]
        print(
            f"\n{z}: exposed communication prefetch off / on = "
            f"{off['exposed'] / max(on['exposed'], 1e-9):.1f}x (target >= 2x); "
            f"fwd+bwd prefetch off / on = {off['fb'] / on['fb']:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1gbit,4gbit,none")
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--pure", action="store_true", help="dedicate the norms too (no FSDP2)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a before/after check: --rates 1gbit --steps 4 --warmup 1",
    )
    args = ap.parse_args()
    if args.quick:
        args.rates, args.steps, args.warmup = "1gbit", 4, 1
    if args.worker:
        worker(args)
        return
    # a terminated run still removes its namespace (the `finally` in _launch)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    print(f"# overlap on a rate-limited loopback, W={WORLD} CPU ranks, {machine()}")
    norms = "norms dedicated too (pure), no FSDP2" if args.pure else "norms FSDP2"
    print(
        f"# {args.layers} blocks d={args.d} (q/k/v/o/up/down dedicated, {norms}), "
        f"{args.tokens} tokens per rank, prefetch depth {args.prefetch}, median of "
        f"{args.steps} steps after {args.warmup}; {dmuon.get_ns_backend('cpu')}"
    )
    for rate in args.rates.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            _launch(args, rate, f.name)
            report(rate, json.loads(Path(f.name).read_text()))


if __name__ == "__main__":
    main()
