"""The Quick Start's model, shared by the example scripts."""

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    def __init__(self, d: int = 512, ff: int = 2048, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {
                        "gate_proj": nn.Linear(d, ff, bias=False),
                        "up_proj": nn.Linear(d, ff, bias=False),
                        "down_proj": nn.Linear(ff, d, bias=False),
                        "ln": nn.LayerNorm(d),
                    }
                )
                for _ in range(n_layers)
            ]
        )
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer["ln"](x)
            x = x + layer["down_proj"](layer["gate_proj"](h) * layer["up_proj"](h))
        return self.head(x).sum()


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.up_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv_proj(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down_proj(nn.functional.gelu(self.up_proj(self.ln2(x))))


class TinyGPT(nn.Module):
    """A small GPT: token + position embeddings, blocks, a head; returns the next-token loss."""

    def __init__(
        self, vocab: int = 96, d: int = 128, n_layers: int = 2, heads: int = 4, seq: int = 64
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens[:, :-1]) + self.pos.weight[: tokens.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
