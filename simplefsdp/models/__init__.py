"""Reference models shipped with simplefsdp (demo, tests, benchmarks)."""

from simplefsdp.models.llama import Transformer, TransformerArgs

__all__ = ["Transformer", "TransformerArgs"]
