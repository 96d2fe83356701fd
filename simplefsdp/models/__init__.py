"""Reference models shipped with simplefsdp (`simplefsdp train`, tests, benchmarks)."""

from simplefsdp.models.llama import Transformer, TransformerArgs
from simplefsdp.models.tensor_parallel import tensor_parallel_plan

__all__ = ["Transformer", "TransformerArgs", "tensor_parallel_plan"]
