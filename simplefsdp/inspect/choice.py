"""`Choice`: one configuration the advisor (`advise.py`) costs, and how to run it.

    choice.passes(device="h100")        # the PassConfig it wraps with
    choice.train_settings()             # the `simplefsdp train` settings it chooses (advised_run.py)
    choice.wrap_call(...)               # the Python that wraps a model as it does

`PASS_VARIANTS` lists what the pass may do in the search: the axes re-costed on one trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from simplefsdp.inspect.dryrun import AC_POLICIES
from simplefsdp.offload import TIERS
from simplefsdp.passes.fsdp_pass import BucketConfig, PassConfig
from simplefsdp.passes.reorder import ReorderConfig
from simplefsdp.settings import DEFAULT_GATHER_BLOCK, QUANTIZED_GATHER_DTYPES
from simplefsdp.strategy import ShardingStrategy

__all__ = ["PASS_VARIANTS", "Choice"]

PASS_VARIANTS: tuple[tuple[str, int | None, float | None], ...] = (
    ("none", None, None),
    ("blocks", 0, None),
    ("blocks", 1, None),
    ("blocks", 2, None),
    ("auto", None, None),
    ("auto", None, 0.25),
)  # (plan, prefetch depth, auto plan's memory budget) re-costed per trace; see the module docstring


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """One configuration the advisor costs. `prefetch_depth` is None for the auto plan (it picks)
    and for no passes; `memory_budget` is the auto plan's (a fraction of each graph's peak);
    `gather_dtype` a quantized gather's code type (lossy), None for gathers in the param dtype."""

    strategy: ShardingStrategy
    ac: str
    tp: int
    plan: str  # "none" (passes off), "blocks", "auto"
    prefetch_depth: int | None
    memory_budget: float | None = None
    offload: str = "none"  # a tier of `simplefsdp.offload.TIERS`
    gather_dtype: str | None = None  # one of `QUANTIZED_GATHER_DTYPES`, or None
    gather_block: int = DEFAULT_GATHER_BLOCK  # elements per scale of a quantized gather

    def order(self) -> tuple[int, int, int, int, int, int]:
        """Position in the search's fixed order (TP, strategy, AC, pass variant, offload tier, gather:
        lossless first): the ranking's tie-break."""
        strategies = list(ShardingStrategy)
        return (
            self.tp,
            strategies.index(self.strategy),
            AC_POLICIES.index(self.ac),
            PASS_VARIANTS.index((self.plan, self.prefetch_depth, self.memory_budget)),
            TIERS.index(self.offload),
            0 if self.gather_dtype is None else 1 + QUANTIZED_GATHER_DTYPES.index(self.gather_dtype),
        )

    def gather_label(self) -> str:
        """E.g. "int8 gathers (lossy)"; "" for gathers in the param dtype."""
        if self.gather_dtype is None:
            return ""
        block = "" if self.gather_block == DEFAULT_GATHER_BLOCK else f", block {self.gather_block}"
        return f"{self.gather_dtype} gathers{block} (lossy)"

    def plan_label(self) -> str:
        if self.prefetch_depth is not None:
            return f"{self.plan}, prefetch {self.prefetch_depth}"
        if self.memory_budget is not None:
            return f"{self.plan}, budget {self.memory_budget:g}"
        return self.plan

    def label(self) -> str:
        offload = "" if self.offload == "none" else f", offload {self.offload}"
        gather = f", {self.gather_label()}" if self.gather_dtype is not None else ""
        return f"{self.strategy.value}, AC {self.ac}, TP {self.tp}, {self.plan_label()}{offload}{gather}"

    def passes(self, *, device: str) -> PassConfig | None:
        """The `PassConfig` this choice wraps with (`device`: the profile name or file the auto plan costs with)."""
        if self.plan == "none":
            return None
        if self.plan == "auto":
            return PassConfig(bucket=BucketConfig(plan="auto", device=device, memory_budget=self.memory_budget))
        return PassConfig(bucket=BucketConfig(plan="blocks"), reorder=ReorderConfig(prefetch_depth=self.prefetch_depth))

    def train_settings(self) -> dict[str, Any]:
        """The `simplefsdp train` settings (`TrainConfig` fields) this choice sets; the run's model,
        dtypes and sizes come from `advised_run.run_settings`."""
        settings: dict[str, Any] = {
            "strategy": self.strategy.value,
            "tp": self.tp,
            "activation_checkpoint": self.ac,
            "bucket_plan": self.plan,
        }
        if self.prefetch_depth is not None:
            settings["prefetch_depth"] = self.prefetch_depth
        if self.memory_budget is not None:
            settings["memory_budget"] = f"{self.memory_budget:g}"
        settings["offload"] = self.offload
        if self.gather_dtype is not None:
            settings["gather_dtype"] = self.gather_dtype
            if self.gather_block != DEFAULT_GATHER_BLOCK:
                settings["gather_block"] = self.gather_block
        return settings

    def wrap_call(self, *, param_dtype: str, reduce_dtype: str, profile: str, shard_size: int | None) -> str:
        """Python that wraps a model as this configuration does (a CUDA job under torchrun)."""
        lines = ["import torch, simplefsdp", "from torch.distributed.device_mesh import init_device_mesh"]
        world = "torch.distributed.get_world_size()"
        if self.tp > 1:
            lines += [
                "from torch.distributed.tensor.parallel import parallelize_module",
                "from simplefsdp.models import tensor_parallel_plan",
                f'mesh = init_device_mesh("cuda", ({world} // {self.tp}, {self.tp}), mesh_dim_names=("dp", "tp"))',
                'parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))',
                'dp_mesh = mesh["dp"]',
            ]
        elif self.strategy.is_hybrid:
            lines.append(
                f'dp_mesh = init_device_mesh("cuda", ({world} // {shard_size}, {shard_size}), '
                'mesh_dim_names=("replicate", "shard"))'
            )
        else:
            lines.append(f'dp_mesh = init_device_mesh("cuda", ({world},))')
        if self.ac != "none":
            lines.append(f'simplefsdp.checkpoint_blocks(model, policy="{self.ac}")')
        if self.plan == "none":
            passes = "None"
        elif self.plan == "auto":
            budget = "" if self.memory_budget is None else f", memory_budget={self.memory_budget!r}"
            passes = f'simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="auto", device="{profile}"{budget}))'
        else:
            passes = f"simplefsdp.PassConfig(reorder=simplefsdp.ReorderConfig(prefetch_depth={self.prefetch_depth}))"
        gather = ""
        if self.gather_dtype is not None:
            gather = f', gather_dtype="{self.gather_dtype}"'
            if self.gather_block != DEFAULT_GATHER_BLOCK:
                gather += f", gather_block={self.gather_block}"
        mp = (
            f"simplefsdp.MixedPrecisionPolicy(param_dtype=torch.{_DTYPE_NAMES[param_dtype]}, "
            f"reduce_dtype=torch.{_DTYPE_NAMES[reduce_dtype]}{gather})"
        )
        lines += [
            "model = simplefsdp.wrap(",
            f'    model, dp_mesh, strategy="{self.strategy.value}",',
            f"    mp_policy={mp},",
            f"    passes={passes},",
            *([f"    offload={_OFFLOAD_POLICIES[self.offload]},"] if self.offload != "none" else []),
            ")",
            "model = torch.compile(model)",
        ]
        return "\n".join(lines)


_OFFLOAD_POLICIES = {"optimizer": "simplefsdp.OffloadPolicy(parameters=False)", "all": "simplefsdp.OffloadPolicy()"}
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
