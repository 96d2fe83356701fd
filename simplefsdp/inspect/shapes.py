"""Named model shapes for the dry run: small test models and Llama-3-shaped configurations.

A shape builds `simplefsdp.models.Transformer` with the named sizes (grouped-query attention
where the original has it), on the meta device by default: a 405B-parameter shape costs no
memory and is never materialized. Shapes can be built with fewer blocks than they name, which is
how the dry run traces a few blocks and extrapolates (see `dryrun.py`).

Sources for the Llama 3 shapes: "The Llama 3 Herd of Models", Meta, 2024 (arXiv:2407.21783),
Table 3 (layers, model dimension, FFN dimension, attention heads, key/value heads, vocabulary
128,256); Llama 3.2 1B from its published `config.json` (meta-llama/Llama-3.2-1B).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.models.llama import apply_rope

__all__ = ["SHAPES", "GroupedQueryAttention", "ModelShape", "check_batch_and_seq", "model_shape"]


class GroupedQueryAttention(nn.Module):
    """Llama attention with `n_kv_heads` key / value heads, each shared by `n_heads / n_kv_heads`
    query heads; the same parameter names as `simplefsdp.models.llama.Attention`."""

    def __init__(self, args: TransformerArgs, *, n_kv_heads: int) -> None:
        super().__init__()
        if args.n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({args.n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))  # [B, S, H(kv), Dh]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # [B, H, S, Dh]
        return self.wo(out.transpose(1, 2).flatten(-2))  # [B, S, D]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A named Transformer configuration and its default example batch."""

    name: str
    args: TransformerArgs
    n_kv_heads: int | None = None  # None: as many as query heads
    batch: int = 1
    seq: int = 8192
    source: str = ""

    @property
    def n_layers(self) -> int:
        return self.args.n_layers

    def resized(self, **sizes: int) -> ModelShape:
        """This shape with some of its `TransformerArgs` replaced (`dim`, `n_layers`, `n_heads`,
        `ffn_dim`, `max_seq_len`, ...): how `simplefsdp train --shape` applies its overrides.
        ValueError when the query heads no longer group over the key / value heads."""
        args = dataclasses.replace(self.args, **sizes)
        if self.n_kv_heads is not None and args.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: n_heads ({args.n_heads}) must be a multiple of its key / value heads ({self.n_kv_heads})"
            )
        return dataclasses.replace(self, args=args)

    def build(self, *, n_layers: int | None = None, device: str | torch.device = "meta") -> nn.Module:
        """The model, with `n_layers` blocks instead of the shape's own number if given."""
        args = dataclasses.replace(self.args, n_layers=n_layers or self.args.n_layers)
        with torch.device(device):
            model = Transformer(args)
            if self.n_kv_heads is not None and self.n_kv_heads != args.n_heads:
                for layer in model.layers:
                    layer.attention = GroupedQueryAttention(args, n_kv_heads=self.n_kv_heads)
                model.reset_parameters()
        return model

    def example_input(
        self, *, batch: int | None = None, seq: int | None = None, device: str | torch.device = "meta"
    ) -> torch.Tensor:
        """Token ids `[B, S]`; zeros, which every model accepts (values do not matter for the graphs).
        `batch` / `seq`: positive integers, or None for the shape's own."""
        check_batch_and_seq(batch=batch, seq=seq)
        seq = seq or self.seq
        if seq > self.args.max_seq_len:
            raise ValueError(f"{self.name}: sequence length {seq} exceeds its max_seq_len {self.args.max_seq_len}")
        return torch.zeros(batch or self.batch, seq, dtype=torch.long, device=device)


def check_batch_and_seq(*, batch: int | None, seq: int | None) -> None:
    """ValueError naming `batch` or `seq` unless each is None (a shape's own) or a positive integer."""
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _llama3(name: str, *, dim: int, layers: int, heads: int, ffn: int, tied: bool = False) -> ModelShape:
    args = TransformerArgs(
        vocab_size=128256,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        ffn_dim=ffn,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=tied,
    )
    return ModelShape(name=name, args=args, n_kv_heads=8, source="Llama 3 paper, Table 3 (arXiv:2407.21783)")


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="tiny", args=TransformerArgs(n_layers=2, max_seq_len=16), batch=2, seq=16),
        ModelShape(
            name="small-8",
            args=TransformerArgs(vocab_size=1024, dim=256, n_layers=8, n_heads=8, ffn_dim=688, max_seq_len=64),
            batch=2,
            seq=64,
        ),
        dataclasses.replace(
            _llama3("llama3.2-1b", dim=2048, layers=16, heads=32, ffn=8192, tied=True),
            source="meta-llama/Llama-3.2-1B config.json",
        ),
        _llama3("llama3-8b", dim=4096, layers=32, heads=32, ffn=14336),
        _llama3("llama3-70b", dim=8192, layers=80, heads=64, ffn=28672),
        _llama3("llama3-405b", dim=16384, layers=126, heads=128, ffn=53248),
    )
}


def model_shape(name: str) -> ModelShape:
    """The shape called `name`; a `ValueError` listing the known names otherwise."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(SHAPES)}") from None
