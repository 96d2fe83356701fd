"""A dry run's prediction with an offload tier: bytes on the device, bytes in host memory, step time.

    offloaded = with_offload(result, tier="all", copy_fraction=0.5, reshards=True)

[Note: pricing the host tier]
Offloading changes what a rank holds between steps, not the graphs' transient peak (gathered
buckets, activations, the gradients reduced so far all stay on the device during the step; the
copies' device buffers are one bucket's shards, left out like the shards themselves). So a tier is
priced from a result traced without it (`simplefsdp/offload.py`, [Note: two tiers], says what moves):

- device, per rank: "optimizer" keeps each parameter's shard in the compute dtype (the master's
  bytes times `copy_fraction`, the compute dtype's size over the master's), "all" keeps none; no
  optimizer state in either. The peak is the device's persistent bytes plus the transient peak.
- host, per rank: the masters, their gradients and the optimizer state.
- time, per step, on the profile's host tier (`host_link_bytes_per_s`, `host_memory_bytes_per_s`):
  the copies in the graph (each gradient out; under "all" each shard in, twice when the backward
  re-gathers) run on the host link beside the compute and cost only what exceeds the step's compute
  time; the optimizer step on the host reads masters, gradients and state and writes masters and
  state at the host memory bandwidth; under "optimizer" the refresh of the device copies (the
  compute dtype's bytes, before the next forward) adds its whole time.
A per-block plan (`offload_plan.py`) is priced the same way, each tier on its blocks' share of the
parameters. A profile without a host tier (the CPU one: there the host is the device) cannot price one.
Under a quantized gather (`MixedPrecisionPolicy.gather_dtype`) nothing here changes: the codes are
made on the device, by the gather's copy-in, from the shard the host link brought (master dtype) or
the device kept (compute dtype), so these are the bytes of those copies; the gather's own bytes on
the wire, codes and scales, come from the trace like every collective's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from simplefsdp.inspect.memory import Persistent
from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.offload import TIERS
from simplefsdp.offload_plan import OffloadPlan, Unit
from simplefsdp.passes.cost import DeviceProfile
from simplefsdp.strategy import ShardingStrategy

if TYPE_CHECKING:  # dryrun.py applies the tiers: it imports this module
    from simplefsdp.inspect.dryrun import DryRunResult

__all__ = ["HostCost", "check_tier", "copy_fraction", "host_cost", "reshards", "with_offload", "with_plan"]


def check_tier(profile: DeviceProfile, tier: str) -> None:
    """`ValueError` unless `tier` is one of `TIERS` that `profile` can price."""
    if tier not in TIERS:
        raise ValueError(f"unknown offload tier {tier!r}; known: {', '.join(TIERS)}")
    if tier != "none" and (profile.host_link_bytes_per_s is None or profile.host_memory_bytes_per_s is None):
        raise ValueError(
            f"offload {tier}: the profile {profile.name!r} has no host tier (host_link_bytes_per_s, "
            "host_memory_bytes_per_s); on a CPU the host is the device"
        )


def copy_fraction(mp_policy: MixedPrecisionPolicy, master: torch.dtype = torch.float32) -> float:
    """The bytes of a shard in the compute dtype per byte of its `master` (the device copy the
    "optimizer" tier keeps; not a quantized gather's bytes on the wire, which the trace holds)."""
    return mp_policy.compute_dtype(master).itemsize / master.itemsize


def reshards(strategy: ShardingStrategy, ac: str) -> bool:
    """Whether the backward gathers the parameters again: resharding after forward, or activation
    checkpointing that recomputes the gathers with the blocks."""
    return strategy.reshard_after_forward or ac != "none"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostCost:
    """What a tier costs one rank per step ([Note: pricing the host tier])."""

    device: Persistent  # what stays on the device between steps
    host_bytes: int
    copy_s: float  # the copies in the graph, all of them
    exposed_copy_s: float  # the part the compute does not cover
    host_step_s: float  # the optimizer step on the host
    refresh_s: float  # "optimizer": the device copies refreshed after the step

    @property
    def added_s(self) -> float:
        return self.exposed_copy_s + self.host_step_s + self.refresh_s


def host_cost(result: DryRunResult, *, shares: Mapping[str, float], copy_fraction: float, reshards: bool) -> HostCost:
    """The host tiers priced for `result` (traced without offload): `shares` gives, per tier
    ("optimizer", "all"), the share of the parameters it holds (their masters' bytes; gradients and
    optimizer state taken in proportion); the rest stays on the device."""
    for tier in shares:
        check_tier(result.device, tier)
    opt, every = shares.get("optimizer", 0.0), shares.get("all", 0.0)
    if not (opt >= 0.0 and every >= 0.0 and opt + every <= 1.0 + 1e-9):
        raise ValueError(f"tier shares must be >= 0 and add up to at most 1, got {dict(shares)}")
    link, memory = result.device.host_link_bytes_per_s or 1.0, result.device.host_memory_bytes_per_s or 1.0
    held = result.persistent
    master, grads, state = held.params_bytes, held.grads_bytes, held.optimizer_bytes
    moved, stay = opt + every, max(1.0 - opt - every, 0.0)
    kept_copy = int(opt * master * copy_fraction)
    copied_in = every * master * (2 if reshards else 1)
    copy_s = (copied_in + moved * grads) / link
    compute_s = max(result.step_s - result.exposed_s, 0.0)
    return HostCost(
        device=Persistent(
            params_bytes=int(stay * master) + kept_copy, grads_bytes=grads, optimizer_bytes=int(stay * state)
        ),
        host_bytes=int(moved * (master + grads + state)),
        copy_s=copy_s,
        exposed_copy_s=max(copy_s - compute_s, 0.0),
        host_step_s=moved * (2 * master + grads + 2 * state) / memory,
        refresh_s=kept_copy / link,
    )


def with_offload(result: DryRunResult, *, tier: str, copy_fraction: float, reshards: bool) -> DryRunResult:
    """`result` (traced without offload) as it runs with `tier` offloaded; "none" returns it as is."""
    check_tier(result.device, tier)
    if tier == "none":
        return result
    return _priced(result, host_cost(result, shares={tier: 1.0}, copy_fraction=copy_fraction, reshards=reshards), tier)


def with_plan(
    result: DryRunResult, plan: OffloadPlan, *, units: Sequence[Unit], copy_fraction: float, reshards: bool
) -> DryRunResult:
    """`result` (traced without offload) as it runs with the per-block `plan` over `units`."""
    tiers = dict(plan.tiers)
    total = sum(u.master_bytes for u in units) or 1
    shares = {
        tier: sum(u.master_bytes for u in units if tiers.get(u.name) == tier) / total for tier in ("optimizer", "all")
    }
    label = ", ".join(f"{plan.count(t)} of {len(units)} units {t}" for t in ("optimizer", "all") if plan.count(t))
    if not label:
        return result
    priced = host_cost(result, shares=shares, copy_fraction=copy_fraction, reshards=reshards)
    return _priced(result, priced, f"auto ({label})")


def _priced(result: DryRunResult, cost: HostCost, label: str) -> DryRunResult:
    transient = result.peak_bytes - result.persistent.params_bytes - result.persistent.optimizer_bytes
    return dataclasses.replace(
        result,
        persistent=cost.device,
        peak_bytes=cost.device.params_bytes + cost.device.optimizer_bytes + transient,
        step_s=result.step_s + cost.added_s,
        exposed_s=result.exposed_s + cost.exposed_copy_s,
        offload=label,
        host_bytes=cost.host_bytes,
    )
