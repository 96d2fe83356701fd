"""Pricing an offload tier on a dry run's result ([Note: pricing the host tier] in offload_cost.py)."""

from __future__ import annotations

import pytest
import torch

import simplefsdp
from simplefsdp.inspect.dryrun import DryRunResult
from simplefsdp.inspect.memory import Persistent
from simplefsdp.inspect.offload_cost import copy_fraction, host_cost, reshards, with_offload
from simplefsdp.passes import cost
from simplefsdp.strategy import ShardingStrategy

GB = 10**9
H100 = cost.profile("h100")


def _result(*, step_s: float = 2.0, exposed_s: float = 0.5, device: cost.DeviceProfile = H100) -> DryRunResult:
    """A 10 GB-master rank (fp32 masters and gradients, AdamW state twice that) with 6 GB transient."""
    held = Persistent(params_bytes=10 * GB, grads_bytes=10 * GB, optimizer_bytes=20 * GB)
    return DryRunResult(
        model="m",
        world_size=8,
        device=device,
        n_layers=4,
        traced_blocks=(4,),
        step_s=step_s,
        exposed_s=exposed_s,
        peak_bytes=36 * GB,
        persistent=held,
        transient_parts={},
        report=None,
        trace_s=0.0,
    )


def test_all_moves_parameters_and_state_off_the_device_and_prices_copies_and_the_host_step():
    result = _result()
    link, memory = H100.host_link_bytes_per_s, H100.host_memory_bytes_per_s
    offloaded = with_offload(result, tier="all", copy_fraction=0.5, reshards=True)
    assert offloaded.peak_bytes == 6 * GB, "the transient peak stays, the persistent state leaves"
    assert offloaded.host_bytes == 40 * GB
    assert (offloaded.persistent.params_bytes, offloaded.persistent.optimizer_bytes) == (0, 0)
    copies = (2 * 10 + 10) * GB / link  # each shard in twice (re-gathered), each gradient out
    assert copies < 1.5, "within the step's 1.5 s of compute: hidden"
    host_step = (2 * 10 + 10 + 2 * 20) * GB / memory
    assert offloaded.step_s == pytest.approx(2.0 + host_step)
    assert offloaded.exposed_s == pytest.approx(0.5)
    short = with_offload(_result(step_s=0.6, exposed_s=0.1), tier="all", copy_fraction=0.5, reshards=True)
    assert short.exposed_s == pytest.approx(0.1 + copies - 0.5), "what exceeds the compute is exposed"


def test_the_optimizer_tier_keeps_a_compute_dtype_copy_and_refreshes_it_once_a_step():
    priced = host_cost(_result(), shares={"optimizer": 1.0}, copy_fraction=0.5, reshards=True)
    assert priced.device.params_bytes == 5 * GB
    assert priced.host_bytes == 40 * GB
    assert priced.copy_s == pytest.approx(10 * GB / H100.host_link_bytes_per_s), "gradients out only"
    assert priced.refresh_s == pytest.approx(5 * GB / H100.host_link_bytes_per_s)
    assert with_offload(_result(), tier="optimizer", copy_fraction=0.5, reshards=True).peak_bytes == 11 * GB


def test_none_is_the_result_itself_and_a_profile_without_a_host_tier_cannot_price_one():
    result = _result()
    assert with_offload(result, tier="none", copy_fraction=0.5, reshards=True) is result
    with pytest.raises(ValueError, match="the profile 'cpu-gloo' has no host tier"):
        with_offload(_result(device=cost.profile("cpu-gloo")), tier="all", copy_fraction=0.5, reshards=True)
    with pytest.raises(ValueError, match="unknown offload tier 'some'"):
        with_offload(result, tier="some", copy_fraction=0.5, reshards=True)


def test_the_copy_fraction_and_the_regather_follow_the_policy_and_strategy():
    bf16 = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert copy_fraction(bf16) == 0.5
    assert copy_fraction(simplefsdp.MixedPrecisionPolicy()) == 1.0
    # a quantized gather encodes the device copy on the device: the copy stays in the compute dtype
    assert copy_fraction(simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_dtype="int8")) == 0.5
    assert reshards(ShardingStrategy.FULL_SHARD, "none")
    assert not reshards(ShardingStrategy.SHARD_GRAD_OP, "none")
    assert reshards(ShardingStrategy.SHARD_GRAD_OP, "full"), "checkpointing re-gathers with the blocks"
