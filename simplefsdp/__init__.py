"""simplefsdp: compiler-based fully sharded data parallel for PyTorch.

model = simplefsdp.wrap(model, mesh)   # parameters become sharded DTensors
model = torch.compile(model)           # all-gathers / reduce-scatters are traced into the graph
"""

from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.parametrize import sharded_parameters
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.wrap import wrap

__all__ = ["MixedPrecisionPolicy", "ShardingStrategy", "sharded_parameters", "wrap"]
