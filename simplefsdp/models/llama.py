"""A small Llama-style decoder: RMSNorm, rotary attention, SwiGLU MLP, untied output head.

Used by `simplefsdp train`, the tests and the benchmarks. Shapes are commented as `# [B, S, D]`:
B batch, S sequence, D model dim, H heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Transformer", "TransformerArgs"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerArgs:
    vocab_size: int = 67  # odd on purpose: the embedding and output rows shard unevenly
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 88
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output head shares the embedding's weight (one parameter)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim ({self.dim // self.n_heads}) must be even for rotary embeddings")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(args: TransformerArgs) -> torch.Tensor:
    """cos/sin tables, `[S_max, Dh // 2, 2]`."""
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(args.max_seq_len).float(), freqs)  # [S_max, Dh/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of `x` `[B, S, H, Dh]` by the angles in `tables` `[S, Dh/2, 2]`."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, S, H, Dh/2, 2]
    cos, sin = tables[:, None, :, 0], tables[:, None, :, 1]  # [S, 1, Dh/2]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack([real, imag], dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        # heads counted from the projection's width: under tensor parallelism each rank holds H / tp of them
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))  # [B, S, H, Dh]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, S, Dh]
        return self.wo(out.transpose(1, 2).flatten(-2))  # [B, S, D]


class FeedForward(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """`forward(tokens [B, S]) -> logits [B, S, V]`."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_tables(args), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-style init: normal(0, 0.02) embeddings, depth-scaled output projections; the rope tables."""
        with torch.no_grad():
            self.rope.copy_(rope_tables(self.args))
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        for layer in self.layers:
            for linear in (
                layer.attention.wq,
                layer.attention.wk,
                layer.attention.wv,
                layer.feed_forward.w1,
                layer.feed_forward.w3,
            ):
                nn.init.normal_(linear.weight, std=0.02)
            for linear in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * self.args.n_layers))
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rope = self.rope[: tokens.shape[1]]
        h = self.tok_embeddings(tokens)  # [B, S, D]
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))  # [B, S, V]
