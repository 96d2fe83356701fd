"""The offload planner ([Note: planning offload under a limit] in simplefsdp/offload_plan.py) and
per-block plans in `wrap()`."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import simplefsdp
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.offload import device_copy_of
from simplefsdp.offload_plan import REST, OffloadPlan, Unit, offload_units, plan_offload

TIERS = ("none", "optimizer", "all")


@st.composite
def _units(draw) -> list[Unit]:
    n = draw(st.integers(1, 6))
    units = []
    for i in range(n):
        master = draw(st.integers(1, 1000))
        copy = draw(st.sampled_from([master, master // 2]))
        state = draw(st.sampled_from([0, 2 * master]))
        units.append(Unit(name=f"u{i}", order=i, master_bytes=master, optimizer_bytes=state, copy_bytes=copy))
    return units


def _device(units: list[Unit], tiers: dict[str, str], transient: int) -> int:
    return transient + sum(u.kept(tiers.get(u.name, "none")) for u in units)


@settings(max_examples=300, deadline=None)
@given(units=_units(), transient=st.integers(0, 3000), limit=st.integers(0, 12000))
def test_the_plan_fits_whenever_some_plan_does_and_takes_the_cheapest_tiers_first(units, transient, limit):
    plan = plan_offload(units, transient_bytes=transient, limit_bytes=limit)
    names = [u.name for u in units]
    every_plan = [dict(zip(names, tiers, strict=True)) for tiers in itertools.product(TIERS, repeat=len(units))]
    some_fit = any(_device(units, tiers, transient) <= limit for tiers in every_plan)
    assert (plan is not None) == some_fit, "a plan exactly when some plan fits"
    if plan is None:
        return
    tiers = dict(plan.tiers)
    assert _device(units, tiers, transient) <= limit
    if _device(units, {}, transient) <= limit:
        assert plan.tiers == (), "everything fits: nothing offloaded"
    if plan.count("all"):
        assert all(tiers.get(u.name) in ("optimizer", "all") for u in units), "all only once every unit is at optimizer"
        moved = [u for u in units if tiers[u.name] == "all"]
        for unit in moved:  # per tier, no unit more than needed
            assert _device(units, {**tiers, unit.name: "optimizer"}, transient) > limit
    else:
        for unit in (u for u in units if tiers.get(u.name) == "optimizer"):
            assert _device(units, {**tiers, unit.name: "none"}, transient) > limit


def test_among_equal_savings_the_unit_gathered_later_goes_first():
    units = [Unit(name=f"layers.{i}", order=i, master_bytes=100, optimizer_bytes=200, copy_bytes=50) for i in range(4)]
    plan = plan_offload(units, transient_bytes=0, limit_bytes=4 * 300 - 250)  # one unit's saving is enough
    assert plan.tiers == (("layers.3", "optimizer"),)


def test_a_plan_names_units_and_tiers_it_knows():
    with pytest.raises(ValueError, match="unknown tiers"):
        OffloadPlan(tiers=(("layers.0", "some"),))
    with pytest.raises(ValueError, match="names a unit twice"):
        OffloadPlan(tiers=(("layers.0", "all"), ("layers.0", "optimizer")))
    plan = OffloadPlan(tiers=(("layers.0", "all"), ("layers.1", "optimizer"), (REST, "all")), pin_memory=False)
    assert plan.policy_for("layers.0.attention.wq.weight") == simplefsdp.OffloadPolicy(pin_memory=False)
    assert plan.policy_for("layers.1.feed_forward.w1.weight") == simplefsdp.OffloadPolicy(
        parameters=False, pin_memory=False
    )
    assert plan.policy_for("layers.10.feed_forward.w1.weight") == simplefsdp.OffloadPolicy(pin_memory=False), (
        "layers.10 is not inside layers.1: it is the rest"
    )
    assert OffloadPlan(tiers=(("layers.0", "all"),)).policy_for("output.weight") is None


ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=3, n_heads=4, ffn_dim=88, max_seq_len=16)


def test_units_split_a_model_by_block_and_rank_share():
    with torch.device("meta"):
        model = Transformer(ARGS)
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    units = offload_units(model, blocks=[f"layers.{i}" for i in range(3)], world_size=4, mp_policy=policy)
    assert [u.name for u in units] == [REST, "layers.0", "layers.1", "layers.2"]
    block = model.layers[0]
    shard = sum(-(-p.numel() // 4) for p in block.parameters())
    assert units[1] == Unit(
        name="layers.0", order=1, master_bytes=4 * shard, optimizer_bytes=8 * shard, copy_bytes=2 * shard
    )


def test_wrap_refuses_a_plan_naming_a_block_the_model_lacks(fake_world8):
    model = Transformer(ARGS)
    plan = OffloadPlan(tiers=(("layers.0", "all"), ("layer.1", "optimizer")))
    with pytest.raises(ValueError, match=r"OffloadPlan names blocks \['layer.1'\] that are no modules of Transformer"):
        simplefsdp.wrap(model, offload=plan)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()), "left as it was"


def test_wrap_applies_a_plan_block_by_block(fake_world8):
    from torch.distributed.device_mesh import init_device_mesh

    plan = OffloadPlan(tiers=(("layers.1", "optimizer"), ("layers.2", "all")))
    model = simplefsdp.wrap(Transformer(ARGS), init_device_mesh("cpu", (8,)), offload=plan)
    specs = {spec.fqn: spec for spec in simplefsdp.parametrize.gather_specs(model)}
    for fqn, spec in specs.items():
        if fqn.startswith("layers.1."):
            assert spec.host is not None
            assert spec.host.keep_device_copy
            assert device_copy_of(dict(model.named_parameters())[fqn]) is not None
        elif fqn.startswith("layers.2."):
            assert spec.host is not None
            assert not spec.host.keep_device_copy
        else:
            assert spec.host is None, fqn
