"""`simplefsdp train --offload auto`: the per-block offload plan of the run, made before its ranks start.

    plan = plan_for(config, world_size=2, device_type="cpu")   # an OffloadPlan (empty: nothing offloaded)

The model is built on the meta device and dry-run as the ranks will run it (`simplefsdp.inspect`'s
trace at the run's micro-batch and sequence, on a fake process group of the run's world size); the
step's transient peak and each block's bytes go to `simplefsdp.plan_offload`, which keeps the step
under `--device-memory-limit` with as little offload as it can ([Note: planning offload under a
limit] in `offload_plan.py`). The spawning process plans once and hands the plan to every rank, so
they wrap alike; under torchrun no process sees the job before its ranks, and `auto` is refused.
"""

from __future__ import annotations

import torch

from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.dryrun import dry_run
from simplefsdp.offload_plan import OffloadPlan, Unit, offload_units, plan_offload
from simplefsdp.passes import cost
from simplefsdp.settings import parse_memory_budget
from simplefsdp.train.config import ConfigError, TrainConfig
from simplefsdp.train.loop import layer_blocks, mp_policy, profile_name, unwrapped_model

__all__ = ["device_memory_limit", "plan_for", "predicted"]

_MARGIN = 0.1  # what the limit leaves of a profile's capacity by default: the fits verdict's margin


def device_memory_limit(config: TrainConfig, profile: cost.DeviceProfile) -> float:
    """Bytes per rank a step may use: `--device-memory-limit`, or the profile's capacity less 10%."""
    if config.device_memory_limit:
        limit = parse_memory_budget(config.device_memory_limit)
        if isinstance(limit, float):
            raise ConfigError(f"device_memory_limit must be a size such as 70GiB; got {config.device_memory_limit!r}")
        return float(limit)
    if profile.capacity_bytes is None:
        raise ConfigError(
            f"offload auto: the profile {profile.name!r} has no memory capacity; give --device-memory-limit"
        )
    return (1.0 - _MARGIN) * profile.capacity_bytes


def plan_for(config: TrainConfig, *, world_size: int, device_type: str) -> OffloadPlan:
    """The run's plan (see the module docstring); ConfigError when even everything offloaded does not fit."""
    profile = cost.profile(profile_name(config, torch.device(device_type)))
    limit = device_memory_limit(config, profile)
    units, transient = predicted(config, world_size=world_size, device_type=device_type)
    plan = plan_offload(units, transient_bytes=transient, limit_bytes=limit)
    if plan is None:
        raise ConfigError(
            f"offload auto: even with everything offloaded a step needs {transient / 2**30:,.2f} GiB per rank "
            f"(activations, gathered buckets, gradients), over the limit of {limit / 2**30:,.2f} GiB"
        )
    return plan


def predicted(config: TrainConfig, *, world_size: int, device_type: str) -> tuple[list[Unit], int]:
    """The run's units (its blocks and the rest, bytes per rank) and its step's transient peak per
    rank, from a dry run of the model as the ranks will build it."""
    if config.tp > 1:
        raise ConfigError("offload auto plans data-parallel runs; with tp > 1 choose a tier (--offload all)")
    profile = cost.profile(profile_name(config, torch.device(device_type)))
    with torch.device("meta"):
        model, _ = unwrapped_model(config)
    blocks = list(layer_blocks(config, model)) or find_repeated_blocks(model)

    def factory() -> tuple[torch.nn.Module, torch.Tensor]:
        with torch.device("meta"):
            built, _ = unwrapped_model(config)
        return built, torch.zeros(config.batch_per_rank, config.seq_len, dtype=torch.long, device="meta")

    factory.__name__ = "the run's model"
    policy = mp_policy(config)
    result = dry_run(
        factory,
        world_size=world_size,
        device=profile,
        strategy=config.sharding,
        shard_size=config.shard_size or None,
        mp_policy=policy,
        ac=config.activation_checkpoint,
    )
    held = result.persistent
    transient = result.peak_bytes - held.params_bytes - held.optimizer_bytes
    return offload_units(model, blocks=blocks, world_size=world_size, mp_policy=policy), transient
