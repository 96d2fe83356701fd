"""`simplefsdp train --shape`: refuse a shape this machine's ranks cannot hold, before any rank starts.

    check_fits(config, world_size=2, device_type="cpu", ranks_here=2)   # ConfigError, or nothing

[Note: a lower bound, not a prediction]
A named shape can be far larger than the machine (Llama-3-8B in fp32 with AdamW is 128 GB of
parameters, gradients and optimizer state before sharding). Tracing the step to predict its peak
(what `simplefsdp inspect` does) costs tens of seconds; this check costs a meta-device build. It
counts what no run of the configuration can go below, per rank: the parameter shards in their
master dtype, their gradients (same dtype) and the optimizer state (AdamW: two per element) --
`simplefsdp.offload_units`' bytes, the ones `--offload auto` plans with -- plus, while a block
computes, that block's parameters gathered in the gather dtype (under SHARD_GRAD_OP and
HYBRID_SHARD_ZERO2 every block's, kept from forward to backward, as the advisor's pruning bound
counts them). Activations are not counted: the bound refuses only what surely does not fit, and a
run that passes it can still run out of memory. Offloaded state ("optimizer", "all") is counted in
host memory for CPU ranks (their device is the host) and left out for GPU ranks. The memory to
compare with: `MemAvailable` of /proc/meminfo shared by the CPU ranks of this machine, or each
GPU's total memory.
"""

from __future__ import annotations

import torch

from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.offload_plan import offload_units
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.train.config import ConfigError, TrainConfig, shape_of
from simplefsdp.train.loop import layer_blocks, mp_policy

__all__ = ["available_bytes", "check_fits", "needed_bytes"]

GIB = 2**30


def _shard_ranks(config: TrainConfig, world_size: int) -> int:
    """The ranks one parameter is split over: its shard group times the tensor-parallel degree."""
    dp = world_size // config.tp
    strategy = config.sharding
    if strategy is ShardingStrategy.NO_SHARD:
        return config.tp
    if strategy.is_hybrid:
        return (config.shard_size or max(1, dp // 2)) * config.tp
    return dp * config.tp


def needed_bytes(config: TrainConfig, *, world_size: int, device_type: str) -> int:
    """The bytes per rank of [Note: a lower bound, not a prediction] for `config.shape`."""
    model = shape_of(config).build(device="meta")
    blocks = list(layer_blocks(config, model)) or find_repeated_blocks(model)
    split = _shard_ranks(config, world_size)
    units = offload_units(model, blocks=blocks, world_size=split, mp_policy=mp_policy(config))
    tier = "all" if config.offload == "auto" else config.offload  # auto: whatever the plan offloads
    if device_type == "cpu" or tier == "none":
        held = sum(2 * unit.master_bytes + unit.optimizer_bytes for unit in units)  # + gradients
    else:
        held = sum(unit.kept(tier) for unit in units)  # gradients and the rest live in host memory
    gathered = [unit.copy_bytes * split // config.tp for unit in units if unit.name in blocks]
    keeps = config.sharding in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
    if config.activation_checkpoint == "none" and keeps:
        return held + sum(gathered)
    return held + max(gathered, default=0)


def available_bytes(*, device_type: str, ranks_here: int) -> float:
    """Memory one rank of this machine can use: its share of the host's available memory (CPU
    ranks), or the smallest GPU's total memory."""
    if device_type == "cuda":
        return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))
    try:
        with open("/proc/meminfo") as file:
            fields = dict(line.split(":", 1) for line in file)
        return int(fields["MemAvailable"].split()[0]) * 1024 / ranks_here
    except (OSError, KeyError, ValueError):
        return float("inf")  # not Linux: nothing to check against


def check_fits(config: TrainConfig, *, world_size: int, device_type: str, ranks_here: int) -> None:
    """ConfigError with both numbers when `config.shape` surely does not fit this machine's ranks."""
    if not config.shape:
        return
    needed = needed_bytes(config, world_size=world_size, device_type=device_type)
    available = available_bytes(device_type=device_type, ranks_here=ranks_here)
    if needed <= available:
        return
    if device_type == "cuda":
        where = f"this machine's GPUs have {available / GIB:,.1f} GiB each"
    else:
        where = (
            f"this machine has {available * ranks_here / GIB:,.1f} GiB available for {ranks_here} CPU ranks "
            f"({available / GIB:,.1f} GiB each)"
        )
    raise ConfigError(
        f"shape {config.shape} needs at least {needed / GIB:,.1f} GiB per rank at world {world_size} "
        f"({config.strategy}: fp32 parameter shards, gradients and AdamW state, {config.param_dtype} gathered "
        f"blocks, activations not counted); "
        f"{where}: more ranks or machines, --n-layers or --dim, a smaller shape, or --offload"
    )
