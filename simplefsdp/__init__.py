"""simplefsdp: compiler-based fully sharded data parallel for PyTorch.

model = simplefsdp.wrap(model, mesh)   # parameters become sharded DTensors
model = torch.compile(model)           # all-gathers / reduce-scatters are traced into the graph

Each public name is imported on first use ([Note: lazy package exports] in `_lazy.py`), so that
`import simplefsdp` and the `simplefsdp` command start without importing torch. Anything that
imports `simplefsdp.passes` (`wrap` does) registers the `simplefsdp_aot_eager` compile backend.
"""

from simplefsdp._lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "simplefsdp.accelerate_config": ("AccelerateSettings", "from_accelerate"),
        "simplefsdp.accumulate": ("no_sync", "reduce_pending"),
        "simplefsdp.activation_checkpoint": ("checkpoint_blocks",),
        "simplefsdp.loss_scaling": ("grad_scaler", "needs_loss_scaling"),
        "simplefsdp.materialize": ("materialize",),
        "simplefsdp.mixed_precision": ("MixedPrecisionPolicy",),
        "simplefsdp.offload": ("OffloadPolicy",),
        "simplefsdp.offload_plan": ("OffloadPlan", "plan_offload"),
        "simplefsdp.parametrize": ("sharded_parameters",),
        "simplefsdp.passes.fsdp_pass": ("BucketConfig", "PassConfig"),
        "simplefsdp.passes.install": ("compile_scope",),
        "simplefsdp.passes.reorder": ("ReorderConfig",),
        "simplefsdp.strategy": ("ShardingStrategy",),
        "simplefsdp.wrap": ("wrap",),
    },
    submodules=("gloo",),
)
