"""Z3 inside the compiled functional step: value_and_grad over stages.

World sizes 1, 2, 4 and a 2×2 HSDP mesh, the whole step under torch.compile(fullgraph=True):
zero graph breaks, one graph across 5 steps whose lr changes, results equal to the Z2 step
(value_and_grad of one loss_fn) to fp32 rounding, and the peak parameter memory of each rank —
its own parameters plus the live gathered copies, read from the CPU allocator's records
(examples/benchmarks/_memory.py) — is within 1.2x of total / W + the largest two adjacent
stages: the gathered copies peak at exactly the largest stage without prefetch and the largest
adjacent pair with it (one stage's collectives travel while its neighbour computes), while the
Z2 step holds the whole model.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import dmuon_fn as dmuon
from tests._dist import run_ranks
from tests._models import HP, batch, make, meshes
from tests.test_functional import CFG, STEPS, TOL, _rel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
from _memory import peak_bytes


def _sub(p: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in p.items()}


def stages(model, name):
    """The test models as stages: one per MLP layer / embedding, block, head."""
    if name == "mlp":

        def layer(i):
            pre = f"layers.{i}."

            def fn(p, x, x0):
                x = x0 if x is None else x
                q = _sub(p, pre)
                h = F.layer_norm(x, x.shape[-1:], q["ln.weight"], q["ln.bias"])
                up = F.linear(h, q["gate_proj.weight"]) * F.linear(h, q["up_proj.weight"])
                return x + F.linear(up, q["down_proj.weight"])

            return [pre + n for n, _ in model.layers[i].named_parameters()], fn

        head = (["head.weight"], lambda p, x, _: F.linear(x, p["head.weight"]).square().mean())
        return [*(layer(i) for i in range(len(model.layers))), head]

    def block(p, x, _):
        return torch.func.functional_call(model.block, _sub(p, "block."), (x,))

    def head(p, x, tokens):  # the head is tied to the embedding
        h = F.layer_norm(x, x.shape[-1:], p["norm.weight"], p["norm.bias"])
        logits = F.linear(h, p["embed.weight"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    return [
        (["embed.weight"], lambda p, _, tokens: F.embedding(tokens, p["embed.weight"])),
        (["block." + n for n, _ in model.block.named_parameters()], block),
        (["norm.weight", "norm.bias", "embed.weight"], head),
    ]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _run(rank, world, name, hsdp, z3, backend, prefetch=1):
    mesh, rep = meshes(world, hsdp)
    model = make(name)
    fp = dmuon.plan(model, mesh, replicate_mesh=rep)
    state = dmuon.init(model, fp, CFG)
    st = stages(model, name)

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,))

    def train_step(state, x, lr, alr):
        vg = dmuon.value_and_grad(st if z3 else loss_fn, fp, prefetch=prefetch)
        loss, grads = vg(state.params, x)
        return loss, dmuon.update(grads, state, lr=lr, adamw_lr=alr)

    cnt = CompileCounterWithBackend(backend or "eager")
    if backend:
        torch._dynamo.reset()
        counters.clear()
        train_step = torch.compile(train_step, backend=cnt, fullgraph=True)
    local = _nbytes(state.params.values())
    for step in range(STEPS):
        args = (
            state,
            batch(name, step, rank),
            torch.tensor(HP["lr"] / (step + 1)),
            torch.tensor(HP["adamw_lr"] / (step + 1)),
        )
        if step == STEPS - 1:  # compiled (and warm) by now
            (loss, state), mem = peak_bytes(lambda a=args: train_step(*a))
        else:
            loss, state = train_step(*args)
    full = dmuon.full_params(state)
    sizes = dict(zip(fp.names, (torch.Size(s).numel() * 4 for s in fp.shapes), strict=True))
    per_stage = [sum(sizes[n] for n in names) for names, _ in st]
    return dict(
        params=full,
        loss=loss.item(),
        frames=cnt.frame_count,
        breaks=sum(counters["graph_break"].values()) if backend else 0,
        local=local,
        gathered=mem["gathered"],
        total=sum(sizes.values()),
        stage=max(per_stage),
        pair=max(a + b for a, b in itertools.pairwise(per_stage)),
    )


def _all(rank, world, cases, backend):
    return [
        dict(
            z2=_run(rank, world, name, hsdp, False, None),
            z3=_run(rank, world, name, hsdp, True, backend),
            z3_eager=_run(rank, world, name, hsdp, True, None) if backend else None,
            z3_off=_run(rank, world, name, hsdp, True, None, prefetch=0),
        )
        for name, hsdp in cases
    ]


def _check(world, cases, results, backend):
    for i, (name, hsdp) in enumerate(cases):
        for rank, r in enumerate(results):
            z2, z3 = r[i]["z2"], r[i]["z3"]
            if backend:
                assert z3["frames"] == 1, "one graph, no recompiles"
                assert z3["breaks"] == 0
            off = r[i]["z3_off"]
            assert abs(z3["loss"] - z2["loss"]) <= TOL * abs(z2["loss"])
            for n, want in z2["params"].items():
                assert _rel(z3["params"][n], want) < TOL, (name, hsdp, rank, n)
                assert _rel(off["params"][n], want) < TOL, (name, hsdp, rank, n)
                if r[i]["z3_eager"] is not None:
                    assert _rel(r[i]["z3_eager"]["params"][n], want) < TOL, n
            # Z2 holds every parameter; Z3 exactly one stage's copy at a time without prefetch,
            # two adjacent stages' with it; under HSDP the update's publish (the rank's new local
            # parameters) follows the last copy's free
            assert z2["gathered"] >= z2["total"] > z3["stage"]
            for run, peak in (
                (off, off["stage"]),
                (z3, z3["pair"]),
                (r[i]["z3_eager"], z3["pair"]),
            ):
                if run is not None:
                    want = max(peak, run["local"]) if hsdp else peak
                    assert run["gathered"] == want, (name, hsdp, rank, run["gathered"], want)
            shard = world // 2 if hsdp else world
            bound = 1.2 * (z3["total"] / shard + z3["pair"])
            assert z3["local"] + z3["gathered"] <= bound, (name, rank, z3["local"], bound)


CASES = [("mlp", False), ("transformer", False)]


def test_world_1_aot_eager():
    _check(1, CASES, run_ranks(_all, 1, CASES, "aot_eager"), "aot_eager")


@pytest.mark.slow
def test_world_2_inductor():
    _check(2, CASES, run_ranks(_all, 2, CASES, "inductor", timeout=600), "inductor")


@pytest.mark.slow
def test_world_4_and_hsdp_2x2_aot_eager():
    cases = [*CASES, ("mlp", True), ("transformer", True)]
    _check(4, cases, run_ranks(_all, 4, cases, "aot_eager"), "aot_eager")


def test_stages_are_checked_up_front():
    model = make("mlp")
    fp = dmuon.plan(model)
    st = stages(model, "mlp")
    with pytest.raises(ValueError, match=r"head\.weight' is in no stage"):
        dmuon.value_and_grad(st[:-1], fp)
    with pytest.raises(ValueError, match="the plan does not hold"):
        dmuon.value_and_grad([*st, (["nope"], st[-1][1])], fp)
    with pytest.raises(ValueError, match="stages is empty"):
        dmuon.value_and_grad([], fp)
    with pytest.raises(ValueError, match="prefetch must be 0 or 1"):
        dmuon.value_and_grad(st, fp, prefetch=2)


def _graph_order(rank, world):
    """The compiled staged step's graph (AOTAutograd's, as handed to the compiler): for each
    collective start, its position and its wait's; and the positions of the matmuls."""
    model = make("mlp")
    fp = dmuon.plan(model, meshes(world, False)[0])
    state = dmuon.init(model, fp, CFG)
    st = stages(model, "mlp")
    graphs = []

    def record(gm, _):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        pos = {n: i for i, n in enumerate(nodes)}
        waits = {n.args[0]: pos[n] for n in nodes if "collective_wait" in str(n.target)}
        starts = [
            (str(n.target).split(".")[1], pos[n], waits[n])
            for n in nodes
            if str(n.target).endswith("_start.default")
        ]
        mms = [pos[n] for n in nodes if str(n.target) in ("aten.mm.default", "aten.bmm.default")]
        graphs.append((starts, mms))
        return make_boxed_func(gm)

    @torch.compile(fullgraph=True, backend=aot_autograd(fw_compiler=record))
    def train_step(state, x, lr):
        loss, grads = dmuon.value_and_grad(st, fp)(state.params, x)
        return loss, dmuon.update(grads, state, lr=lr)

    train_step(state, batch("mlp", 0, rank), torch.tensor(0.01))
    (graph,) = graphs
    return graph


@pytest.mark.slow
def test_compiled_step_issues_each_stage_gather_before_the_compute_it_overlaps():
    """In the one compiled graph, every collective but the first gather and the last reduce
    (nothing is left to compute around them) is issued before some matmul and waited for
    after it: stage i+1's gathers around stage i's forward, stage i-1's re-gathers around stage
    i's backward, stage i's reduce around stage i-1's. The same graph on every rank."""
    results = run_ranks(_graph_order, 2)
    for starts, mms in results:
        layers = len(make("mlp").layers) + 1  # + the head's stage
        kinds = [k for k, _, _ in starts]
        assert kinds.count("owner_broadcast_start") == 2 * layers - 1, kinds
        assert kinds.count("two_stage_reduce_start") == layers, kinds
        assert starts[-1][0] == "two_stage_reduce_start"
        for kind, start, wait in starts[1:-1]:
            assert any(start < m < wait for m in mms), (kind, start, wait, mms)
    assert results[0] == results[1]
