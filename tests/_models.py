"""Small models for the distributed tests, and the plain-PyTorch reference training run."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dmuon_fn._coefficients import schedule

D, FF = 32, 64
# hyperparameters shared by the distributed and functional parity tests and their reference
HP = dict(lr=0.01, momentum=0.95, wd=0.1, adamw_lr=1e-3, adamw_wd=0.01)


def muon_fp32(model: nn.Module, **extra):
    """dmuon_fn.Muon with HP and fp32 standard Newton-Schulz (the reference's arithmetic)."""
    import dmuon_fn

    return dmuon_fn.Muon(
        model,
        lr=HP["lr"],
        momentum=HP["momentum"],
        weight_decay=HP["wd"],
        adamw_lr=HP["adamw_lr"],
        adamw_weight_decay=HP["adamw_wd"],
        ns_method="standard",
        ns_dtype=torch.float32,
        **extra,
    )


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
    X = u.float()
    tall = X.shape[0] > X.shape[1]
    X = (X.T if tall else X) / (X.norm() + 1e-7)
    for a, b, c in schedule("polar_express", steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


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
) -> dict:
    """Single-process plain PyTorch: mean loss over every rank's batch, Muon on `muon` names
    (momentum, Nesterov, fp32 standard NS, 0.2·sqrt(max(m, n)) scale), AdamW on the rest; both
    learning rates multiplied by schedule(step). `model` (default: make(name)) and
    `loss(model, step, rank)` (default: the model on batch(name, step, rank)) for other
    models."""
    model = make(name) if model is None else model
    loss = loss or (lambda m, step, rank: m(batch(name, step, rank)))
    named = dict(model.named_parameters())
    others = [p for n, p in named.items() if n not in muon]
    adamw = torch.optim.AdamW(
        others, lr=hp["adamw_lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=hp["adamw_wd"]
    )
    bufs = {n: torch.zeros_like(named[n]) for n in muon}
    for step in range(steps):
        lr = hp["lr"] * schedule(step)
        for g in adamw.param_groups:
            g["lr"] = hp["adamw_lr"] * schedule(step)
        model.zero_grad()
        (sum(loss(model, step, r) for r in range(world)) / world).backward()
        with torch.no_grad():
            for n in muon:
                p, g = named[n], named[n].grad
                if g is None:  # not used this step: no update (AdamW skips it too)
                    continue
                bufs[n] = hp["momentum"] * bufs[n] + g
                u = g + hp["momentum"] * bufs[n]
                scale = 0.2 * math.sqrt(max(p.shape))
                p.mul_(1 - lr * hp["wd"]).sub_(lr * scale * ns_fp32(u))
            adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_params(model: nn.Module, st=None) -> dict[str, torch.Tensor]:
    """Every parameter's whole value on every rank, by module path (test-only: broadcasts over
    the world). The global rank of mesh coordinate (replica, shard[, tensor]) is row-major;
    `st`: the model's dedicated state (default: its own)."""
    st = model._dmuon_state if st is None else st
    out = {}
    T = 1 if st.tensor is None else st.tensor.size
    for n, p in model.named_parameters():
        n = n.replace("_orig_mod.", "")  # (a block compiled alone)
        e = st.entry(p)
        if e is None:
            out[n] = p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach()
            continue
        slot = e.owner_replica * st.shard_size + e.owner_shard
        here = st.is_global_owner(e)
        if e.tp is None or not e.tp.sharded:
            buf = e.param.detach().clone() if here else torch.empty(e.full_shape)
            dist.broadcast(buf, src=slot * T)
            out[n] = buf.to(e.dtype)
            continue
        parts = []
        for t in range(T):
            shape = e.tp.part_shape(t)
            mine = here and st.tensor.rank == t
            buf = e.param.detach().clone() if mine else torch.empty(shape)
            dist.broadcast(buf, src=slot * T + t)
            parts.append(buf)
        out[n] = torch.cat(parts, dim=e.tp.dim).to(e.dtype)
    return out
