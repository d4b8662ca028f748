"""A compact MoE transformer for examples/train_moe.py where `transformers` is not installed.

It follows transformers' Qwen3-MoE (the layout, the parameter names and the math), so the
example's predicate, blocks and QK-clip heads name the same parameters in either model:
- attention: q/k/v/o projections, grouped-query heads, RMSNorm on each query and key head
  (q_norm / k_norm, optional here), rotary position embeddings, causal;
- MoE layer: a softmax top-k router (`mlp.gate.weight` (E, hidden)) and experts stored as fused
  3-D tensors, `mlp.experts.gate_up_proj` (E, 2·I, hidden), gate rows first, and
  `mlp.experts.down_proj` (E, hidden, I);
- the Switch load-balancing loss over every layer's router, as `aux_loss`.
Every attention reports the q and k it multiplies (after the norms and the rotation) to
`attn.logit_tracker` under `attn.logit_key`, when one is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoeConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = False
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    qk_norm: bool = True


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.d = layer_idx, cfg.head_dim
        self.h, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        norm = (lambda: nn.RMSNorm(self.d, eps=cfg.rms_norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()
        self.logit_tracker, self.logit_key = None, None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.h, self.d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.hkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.logit_tracker is not None:
            self.logit_tracker.observe(self.logit_key, q, k, causal=True)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.d))


class Experts(nn.Module):
    """E SwiGLU experts in two fused 3-D tensors; each token goes through its top-k."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weight[token, slot, None]
            out.index_add_(0, token, y)
        return out


class Router(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, index = torch.softmax(logits, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(x.dtype), index


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.experts, self.gate = Experts(cfg), Router(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        logits, weight, index = self.gate(flat)
        return self.experts(flat, index, weight).view_as(x), logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + y, router_logits


class MoeModel(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=x.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        router_logits = []
        for layer in self.layers:
            x, r = layer(x, cos, sin)
            router_logits.append(r)
        return self.norm(x), router_logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int):
    """Switch Transformer's auxiliary loss over every layer's tokens, as transformers computes
    it: E · Σ_e (top-k assignments to e per token) · (mean router probability of e); top_k when
    the load is balanced."""
    probs = torch.softmax(torch.cat(router_logits), dim=-1, dtype=torch.float)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()
    return num_experts * (chosen.mean(0) * probs.mean(0)).sum()


class MoeForCausalLM(nn.Module):
    """Called as transformers' model is in the example: `model(input_ids=...)` gives `.logits`
    and, with `output_router_logits=True`, `.aux_loss`."""

    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        std = cfg.initializer_range
        for p in self.parameters():
            if p.ndim >= 2:  # projections, experts, router, embedding, head; norms stay 1
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, output_router_logits: bool = False):
        h, router_logits = self.model(input_ids)
        aux = None
        if output_router_logits:
            cfg = self.config
            aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        return SimpleNamespace(logits=self.lm_head(h), aux_loss=aux)
