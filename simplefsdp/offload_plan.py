"""Partial offload under a device-memory limit: which blocks offload which tier.

    units = offload_units(model, blocks=["layers.0", ...], world_size=8, mp_policy=policy)
    plan = plan_offload(units, transient_bytes=..., limit_bytes=...)   # an OffloadPlan, or None
    simplefsdp.wrap(model, mesh, offload=plan)

[Note: planning offload under a limit]
A unit is what offloads together: a block of the model (its bucket), or the parameters outside
every block. Per rank it holds its sharded masters (M), their optimizer state (O), and under the
"optimizer" tier the compute-dtype copy the device keeps (C); gradients are the step's, reduced
during the backward, and count in the step's transient peak T. So the device holds
`T + sum of kept(unit)`, with kept = M + O without offload, C under "optimizer", 0 under "all"
(`simplefsdp/offload.py`, [Note: two tiers]). `plan_offload` meets the limit L with the cheapest
tiers first:

1. nothing, if `T + sum(M + O) <= L`;
2. else units go from none to "optimizer" -- the largest saving (M + O - C) first, among equal
   savings the unit gathered last in the forward first (more compute runs before its copies, so
   the schedule hides them better) -- until the plan fits;
3. only when every unit is at "optimizer" and it still does not fit, units go on to "all" the
   same way (saving C each);
4. None when everything at "all" does not fit: no plan does.

Taking the largest saving first makes each tier's set minimal: removing any unit a step added
leaves the plan over the limit (the units added before it saved at least as much).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.offload import TIERS, OffloadPolicy

__all__ = ["REST", "OffloadPlan", "Unit", "offload_units", "plan_offload"]

REST = ""  # the unit of the parameters outside every block


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """Per unit (a block's FQN, or `REST`), the tier it offloads; a unit not listed keeps everything
    on the device. `wrap(model, mesh, offload=plan)` applies it parameter by parameter: a parameter
    belongs to the innermost listed block that contains it, else to `REST`."""

    tiers: tuple[tuple[str, str], ...]
    pin_memory: bool = True

    def __post_init__(self) -> None:
        names = [name for name, _ in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"OffloadPlan names a unit twice: {names}")
        bad = [(name, tier) for name, tier in self.tiers if tier not in TIERS]
        if bad:
            raise ValueError(f"OffloadPlan: unknown tiers {bad}; known: {', '.join(TIERS)}")

    def policy_for(self, fqn: str) -> OffloadPolicy | None:
        """The policy of the parameter `fqn` (None: on the device)."""
        blocks = [name for name, _ in self.tiers if name != REST and fqn.startswith(f"{name}.")]
        unit = max(blocks, key=len) if blocks else REST
        tier = dict(self.tiers).get(unit, "none")
        policy = OffloadPolicy.of_tier(tier)
        return None if policy is None else dataclasses.replace(policy, pin_memory=self.pin_memory)

    def check_units(self, model: nn.Module) -> None:
        """`ValueError` naming every unit of the plan that is no module of `model`."""
        modules = dict(model.named_modules())
        unknown = [name for name, _ in self.tiers if name != REST and name not in modules]
        if unknown:
            raise ValueError(f"OffloadPlan names blocks {unknown} that are no modules of {type(model).__name__}")

    def count(self, tier: str) -> int:
        return sum(t == tier for _, t in self.tiers)

    def summary(self) -> str:
        """E.g. "optimizer: layers.2, layers.3; all: layers.1" ("nothing offloaded" for an empty plan)."""
        parts = []
        for tier in ("optimizer", "all"):
            names = [name or "(the rest)" for name, t in self.tiers if t == tier]
            if names:
                shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
                parts.append(f"{tier}: {shown}")
        return "; ".join(parts) or "nothing offloaded"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    """What one unit holds per rank ([Note: planning offload under a limit]), and where its first
    gather sits in the forward (`order`: larger is later)."""

    name: str
    order: int
    master_bytes: int
    optimizer_bytes: int
    copy_bytes: int

    def kept(self, tier: str) -> int:
        """Bytes it leaves on the device under `tier`."""
        return {"none": self.master_bytes + self.optimizer_bytes, "optimizer": self.copy_bytes, "all": 0}[tier]


def plan_offload(units: Sequence[Unit], *, transient_bytes: int, limit_bytes: float) -> OffloadPlan | None:
    """The plan of [Note: planning offload under a limit]: an empty plan when everything fits, None
    when nothing does."""
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError(f"units must have distinct names: {names}")
    tiers = {u.name: "none" for u in units}

    def device_bytes() -> int:
        return transient_bytes + sum(u.kept(tiers[u.name]) for u in units)

    for current, cheaper in (("none", "optimizer"), ("optimizer", "all")):
        # largest saving first; among equal savings, gathered later first
        for unit in sorted(units, key=lambda u: (u.kept(current) - u.kept(cheaper), u.order), reverse=True):
            if device_bytes() <= limit_bytes:
                break
            tiers[unit.name] = cheaper
    if device_bytes() > limit_bytes:
        return None
    return OffloadPlan(tiers=tuple((name, tier) for name, tier in tiers.items() if tier != "none"))


def offload_units(
    model: nn.Module,
    *,
    blocks: Sequence[str],
    world_size: int,
    mp_policy: MixedPrecisionPolicy,
    state_per_master: int = 2,
) -> list[Unit]:
    """The units of an unwrapped `model` (meta is enough: only shapes are read) sharded over
    `world_size` ranks: one per block of `blocks`, in the order given (their forward order), and
    `REST` first (the embedding gathers first). Bytes are rank 0's share (the largest when uneven);
    `state_per_master`: optimizer state per master byte (AdamW: 2)."""
    totals: dict[str, list[int]] = {REST: [0, 0, 0], **{b: [0, 0, 0] for b in blocks}}
    for fqn, param in dict(model.named_parameters()).items():
        if not param.is_floating_point():
            continue
        inside = [b for b in blocks if fqn.startswith(f"{b}.")]
        unit = max(inside, key=len) if inside else REST
        elements = -(-param.numel() // world_size)
        master = mp_policy.master_dtype(param.dtype)
        compute = mp_policy.compute_dtype(master)
        trainable = param.requires_grad
        totals[unit][0] += elements * master.itemsize
        totals[unit][1] += state_per_master * elements * master.itemsize if trainable else 0
        totals[unit][2] += elements * compute.itemsize
    order = [REST, *blocks]
    return [
        Unit(name=name, order=order.index(name), master_bytes=m, optimizer_bytes=o, copy_bytes=c)
        for name, (m, o, c) in totals.items()
        if m
    ]
