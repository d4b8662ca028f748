"""Small models for the distributed tests, and the plain-PyTorch reference training run."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dmuon_fn.ns._iteration import schedule

D, FF = 32, 64
# Hyperparameters shared by the parity tests and their reference. Every one differs from the
# library's default, so an optimizer that ignored any of them (and used its default) fails the
# parity tests; tests/test_tolerances.py measures each such effect against the tolerances.
HP = dict(
    lr=0.03,  # default 0.02
    momentum=0.9,  # 0.95
    nesterov=False,  # True
    wd=0.2,  # 0.0
    ns_steps=6,  # 5
    adamw_lr=3e-3,  # 1e-3
    adamw_betas=(0.8, 0.99),  # (0.9, 0.999)
    adamw_eps=1e-4,  # 1e-8
    adamw_wd=0.2,  # 0.01
)


def _hyper() -> dict:
    """HP under the names `Muon` and `Config` share."""
    return dict(
        lr=HP["lr"],
        momentum=HP["momentum"],
        nesterov=HP["nesterov"],
        weight_decay=HP["wd"],
        adamw_lr=HP["adamw_lr"],
        adamw_betas=HP["adamw_betas"],
        adamw_eps=HP["adamw_eps"],
        adamw_weight_decay=HP["adamw_wd"],
    )


def muon_fp32(model: nn.Module, **extra):
    """dmuon_fn.Muon with HP and fp32 standard Newton-Schulz (the reference's arithmetic)."""
    import dmuon_fn

    ns = dict(ns_steps=HP["ns_steps"], ns_method="standard", ns_dtype=torch.float32)
    return dmuon_fn.Muon(model, **{**_hyper(), **ns, **extra})


def config_fp32(**extra):
    """dmuon_fn.Config with HP and fp32 standard Newton-Schulz: the functional face of
    `muon_fp32`."""
    import dmuon_fn

    ns = dmuon_fn.NSConfig(steps=HP["ns_steps"], method="standard", dtype=torch.float32)
    return dmuon_fn.Config(**{**_hyper(), "ns": ns, **extra})


def meshes(world: int, hsdp: bool):
    """(shard mesh, replicate mesh): None for one rank, 1-D, or a (2, world/2) HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if world == 1:
        return None, None
    if not hsdp:
        return init_device_mesh("cpu", (world,)), None
    m = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return m["shard"], m["replicate"]


class TinyMLP(nn.Module):
    """The Quick Start's model (ModuleDict layers), scaled down."""

    def __init__(self, d: int = D, ff: int = FF, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(d, ff, bias=False),
                    "up_proj": nn.Linear(d, ff, bias=False),
                    "down_proj": nn.Linear(ff, d, bias=False),
                    "ln": nn.LayerNorm(d),
                }
            )
            for _ in range(n_layers)
        )
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer["ln"](x)
            x = x + layer["down_proj"](layer["gate_proj"](h) * layer["up_proj"](h))
        return self.head(x).square().mean()


class Block(nn.Module):
    """One pre-norm transformer block (attention + MLP) over (batch, seq, d). Tensor parallel
    as it is (tests/_tp.py): it splits heads by their width, so a tensor rank computes with the
    heads its column-parallel projections give it."""

    def __init__(self, d: int = D, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)

        def split(t):
            return t.view(b, s, -1, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.down_proj(F.gelu(self.up_proj(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Embedding tied to the output head, one block: exercises tied parameters."""

    def __init__(self, vocab: int = 48, d: int = D):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = Block(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.block(self.embed(tokens))))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def make(name: str) -> nn.Module:
    torch.manual_seed(42)
    return {"mlp": TinyMLP, "transformer": TinyTransformer}[name]()


def batch(name: str, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "mlp":
        return torch.randn(4, D, generator=g)
    return torch.randint(0, 48, (2, 8), generator=g)


def is_proj(name: str, p: torch.Tensor) -> bool:
    return "proj" in name and p.ndim == 2


def ns_fp32(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Standard Newton-Schulz in fp32 (fp64 stays fp64), Polar Express rows."""
    X = u.to(torch.promote_types(u.dtype, torch.float32))
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.abs().max().clamp_min(torch.finfo(X.dtype).tiny)  # the library's normalization:
    X = X / (X.norm() + 1e-7)  # max-scaled, so NSConfig.eps = 1e-7 is relative to order one
    for a, b, c in schedule("polar_express", steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


# What `reference` computes, one knob each, so tests/test_tolerances.py can measure how far a
# wrong optimizer lands from the right one. The defaults are the library's math.
RIGHT = dict(
    lr_side=max,  # the Muon lr scale 0.2·sqrt(max(m, n)) uses the long side
    decay_first=True,  # W·(1 − lr·wd) − lr·scale·O: decay the old weights, not the update
    grad_scale=1.0,  # the gradient is the mean over data ranks (world: their sum)
)


# Wrong optimizers, each HP with one thing changed (a hyperparameter ignored: the library's default
# used) or one of RIGHT's knobs: tests/test_tolerances.py and tests/_oracle.py measure how far
# each lands from the right one.
WRONG: dict[str, dict] = {
    "Muon lr ignored": dict(lr=0.02),
    "Muon weight decay ignored": dict(wd=0.0),
    "weight decay after the update": dict(decay_first=False),
    "momentum ignored": dict(momentum=0.95),
    "Nesterov ignored": dict(nesterov=True),
    "ns_steps ignored / one step fewer": dict(ns_steps=5),
    "lr scale from the short side": dict(lr_side=min),
    "AdamW lr ignored": dict(adamw_lr=1e-3),
    "AdamW weight decay ignored": dict(adamw_wd=0.01),
    "AdamW weight decay dropped": dict(adamw_wd=0.0),
    "AdamW betas ignored": dict(adamw_betas=(0.9, 0.999)),
    "AdamW eps ignored": dict(adamw_eps=1e-8),
}


def split_wrong(change: dict) -> tuple[dict, dict]:
    """A WRONG entry as (HP with its hyperparameters changed, RIGHT with its knobs changed)."""
    knobs = {k: v for k, v in change.items() if k in RIGHT}
    return {**HP, **{k: v for k, v in change.items() if k not in RIGHT}}, {**RIGHT, **knobs}


def muon_step(W, g, buf, lr: float, hp: dict, knobs: dict = RIGHT):
    """One Muon step of the reference's math, the update's dtype W's (Newton-Schulz in fp32 at
    least): (new W, new momentum). `hp` as HP (with "adjust_lr" optional), `knobs` as RIGHT."""
    buf = hp["momentum"] * buf + g
    u = g + hp["momentum"] * buf if hp.get("nesterov", True) else buf
    m, k = W.shape[0], math.prod(W.shape[1:])
    if hp.get("adjust_lr", "match_rms_adamw") == "original":
        scale = math.sqrt(max(1.0, m / k))
    else:
        scale = 0.2 * math.sqrt(knobs["lr_side"](m, k))
    O = ns_fp32(u.reshape(m, k), hp.get("ns_steps", 5)).reshape(W.shape)
    decay = 1 - lr * hp["wd"]
    if knobs["decay_first"]:
        return W * decay - lr * scale * O, buf
    return (W - lr * scale * O) * decay, buf


def reference(
    name: str,
    world: int,
    steps: int,
    muon: set[str],
    hp: dict,
    schedule=lambda step: 1.0,
    *,
    model: nn.Module | None = None,
    loss=None,
    blocks=None,
    **wrong,
) -> dict:
    """Single-process plain PyTorch: mean loss over every rank's batch, Muon on `muon` names
    (momentum, Nesterov per hp, fp32 standard NS of hp["ns_steps"] steps, the lr scale of
    hp["adjust_lr"]: 0.2·sqrt(max(m, n)) by default), AdamW (hp's betas, eps) on the rest;
    both learning rates multiplied by schedule(step). `model` (default: make(name)) and
    `loss(model, step, rank)` (default: the model on batch(name, step, rank)) for other models.
    `blocks`: {name: a function giving a tensor's matrices as views}, each stepped on its own
    (default: the parameter one matrix). `wrong`: RIGHT's knobs changed, for measuring the
    effect of a fault."""
    knobs = {**RIGHT, **wrong}
    if set(knobs) != set(RIGHT):
        raise ValueError(f"unknown knobs {sorted(set(knobs) - set(RIGHT))}")
    model = make(name) if model is None else model
    loss = loss or (lambda m, step, rank: m(batch(name, step, rank)))
    named = dict(model.named_parameters())
    others = [p for n, p in named.items() if n not in muon]
    adamw = torch.optim.AdamW(
        others,
        lr=hp["adamw_lr"],
        betas=hp.get("adamw_betas", (0.9, 0.999)),
        eps=hp.get("adamw_eps", 1e-8),
        weight_decay=hp["adamw_wd"],
    )
    bufs = {n: torch.zeros_like(named[n]) for n in muon}
    for step in range(steps):
        lr = hp["lr"] * schedule(step)
        for g in adamw.param_groups:
            g["lr"] = hp["adamw_lr"] * schedule(step)
        model.zero_grad()
        (sum(loss(model, step, r) for r in range(world)) / world).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(knobs["grad_scale"])
            for n in muon:
                p, g = named[n], named[n].grad
                if g is None:  # not used this step: no update (AdamW skips it too)
                    continue
                views = (blocks or {}).get(n, lambda t: [t])
                for pv, gv, bv in zip(views(p), views(g), views(bufs[n]), strict=True):
                    new, buf = muon_step(pv, gv, bv, lr, hp, knobs)
                    pv.copy_(new)
                    bv.copy_(buf)
            adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def blocks_reference(model: nn.Module, loss_at, blocks_of, steps: int, lr: float) -> dict:
    """One process, the whole batch: `steps` of `muon_update` (fp32 Newton-Schulz, no weight
    decay) on every parameter of `model`, each read with its blocks spec `blocks_of(name)`, on
    the loss `loss_at(model, step)`; the parameters after, by name."""
    from dmuon_fn import MuonState, NSConfig, muon_update

    params = dict(model.named_parameters())
    state = {n: MuonState(torch.zeros_like(p)) for n, p in params.items()}
    ns = NSConfig(dtype=torch.float32)
    for step in range(steps):
        grads = torch.autograd.grad(loss_at(model, step), list(params.values()))
        with torch.no_grad():
            for (n, p), g in zip(params.items(), grads, strict=True):
                new, state[n] = muon_update(
                    p, g, state[n], lr=lr, weight_decay=0.0, ns=ns, blocks=blocks_of(n)
                )
                p.copy_(new)
    return {n: p.detach().clone() for n, p in params.items()}


def _parent(piece: str) -> str:
    from dmuon_fn.planning._slices import parse_piece

    return parse_piece(piece)[0]


def full_params(model: nn.Module, st=None, get=None, cast=True) -> dict[str, torch.Tensor]:
    """Every parameter's whole value on every rank, by module path (test-only: broadcasts over
    the world). The global rank of mesh coordinate (replica, shard[, tensor]) is row-major;
    `st`: the model's dedicated state (default: its own). `get(p)`: what to gather instead of
    the parameter's value (its gradient, a state tensor), held where the value is; `cast`: in
    the model's dtype (else as held: fp32 masters stay fp32)."""
    st = model._dmuon_state if st is None else st
    get = get or (lambda p: p)
    out = {}
    T = 1 if st.tensor is None else st.tensor.size
    by_name = {e.name: e for e in st.entries}
    for n, p in model.named_parameters():
        n = n.replace("_orig_mod.", "")  # (a block compiled alone)
        e = st.entry(p)
        if e is None:
            x = get(p)
            out[n] = x.full_tensor().detach().clone() if hasattr(x, "full_tensor") else x.detach()
            continue
        dtype = e.dtype if cast else torch.float32
        if e.tp is None or not e.tp.sharded:  # the whole parameter, or its pieces in order
            from dmuon_fn.planning._slices import join

            bufs = []
            pieces = st.plan.pieces(e.names[0] if e.whole is None else _parent(e.name))
            for x in [by_name[piece] for piece in pieces]:
                here = st.is_global_owner(x)
                buf = get(x.param).detach().float().clone() if here else torch.empty(x.shape)
                dist.broadcast(buf, src=(x.owner_replica * st.shard_size + x.owner_shard) * T)
                bufs.append(buf)
            out[n] = join(pieces, bufs).to(dtype)  # (pieces: joined as the library does)
            continue
        slot = e.owner_replica * st.shard_size + e.owner_shard
        here = st.is_global_owner(e)
        parts = []
        for t in range(T):
            shape = e.tp.part_shape(t)
            mine = here and st.tensor.rank == t
            buf = get(e.param).detach().float().clone() if mine else torch.empty(shape)
            dist.broadcast(buf, src=slot * T + t)
            parts.append(buf)
        out[n] = torch.cat(parts, dim=e.tp.dim).to(dtype)
    return out


def resumed(model: nn.Module, opt, path: str, save: bool, loss_at, rank: int, world: int,
            batch: int, steps: int, split: int = 2) -> dict:  # fmt: skip
    """A dedicated model's checkpoint round trip, each rank on its share of a `batch`-row global
    batch (`loss_at(model, step, rows)`): `save`, train steps [0, split) then save_checkpoint;
    else load_checkpoint. Then the loaded values and momentum, steps [split, steps), the values
    after (every parameter whole on every rank, fp32 as held)."""
    import dmuon_fn as dmuon

    per = batch // world

    def train(steps):
        for step in steps:
            loss_at(model, step, slice(rank * per, (rank + 1) * per)).backward()
            opt.step()
            opt.zero_grad()

    if save:
        train(range(split))
        dmuon.save_checkpoint(path, model, opt)
    else:
        dmuon.load_checkpoint(path, model, opt)
    loaded = full_params(model, cast=False)
    momentum = full_params(model, get=lambda p: opt.state[p]["momentum_buffer"], cast=False)
    train(range(split, steps))
    opt.wait_publish()
    return {"loaded": loaded, "momentum": momentum, "params": full_params(model, cast=False)}


def close_after_steps(got: dict, want: dict, init: dict) -> None:
    """Each trained parameter of `got` within 1e-5 of `want` relative to its norm, and within
    1e-4 relative to how far training moved it from `init`."""
    for n, w in want.items():
        assert (got[n].float() - w).norm() / w.norm() < 1e-5, (n, got[n], w)
        assert (got[n].float() - w).norm() / (w - init[n]).norm() < 1e-4, n
