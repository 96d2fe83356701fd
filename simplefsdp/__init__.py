"""simplefsdp: compiler-based fully sharded data parallel for PyTorch.

model = simplefsdp.wrap(model, mesh)   # parameters become sharded DTensors
model = torch.compile(model)           # all-gathers / reduce-scatters are traced into the graph
"""

from simplefsdp import gloo
from simplefsdp.accelerate_config import AccelerateSettings, from_accelerate
from simplefsdp.accumulate import no_sync, reduce_pending
from simplefsdp.activation_checkpoint import checkpoint_blocks
from simplefsdp.loss_scaling import grad_scaler, needs_loss_scaling
from simplefsdp.materialize import materialize
from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.offload import OffloadPolicy
from simplefsdp.offload_plan import OffloadPlan, plan_offload
from simplefsdp.parametrize import sharded_parameters
from simplefsdp.passes import aot_eager as _register_aot_eager_backend  # noqa: F401  (registers the backend)
from simplefsdp.passes.fsdp_pass import BucketConfig, PassConfig
from simplefsdp.passes.install import compile_scope
from simplefsdp.passes.reorder import ReorderConfig
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.wrap import wrap

__all__ = [
    "AccelerateSettings",
    "BucketConfig",
    "MixedPrecisionPolicy",
    "OffloadPlan",
    "OffloadPolicy",
    "PassConfig",
    "ReorderConfig",
    "ShardingStrategy",
    "checkpoint_blocks",
    "compile_scope",
    "from_accelerate",
    "gloo",
    "grad_scaler",
    "materialize",
    "needs_loss_scaling",
    "no_sync",
    "plan_offload",
    "reduce_pending",
    "sharded_parameters",
    "wrap",
]
