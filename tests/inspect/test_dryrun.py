"""Dry runs on the fake process group: an 8-block model at world 64, extrapolation, Llama-3-405B
at world 1024, the cost model's bookkeeping, memory, and every bad input."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import simplefsdp
from simplefsdp.inspect.dryrun import dry_run
from simplefsdp.inspect.shapes import SHAPES, model_shape
from simplefsdp.passes import cost

SMALL = SHAPES["small-8"]
TINY = SHAPES["tiny"]


@pytest.fixture(scope="module")
def small_w64():
    started = time.perf_counter()
    result = dry_run("small-8", world_size=64, device="h100")
    return result, time.perf_counter() - started


@pytest.fixture(scope="module")
def tiny_w64():
    """The 2-block shape at world 64 (uneven shards: its vocabulary does not divide by 64), for the
    fast tier's schedule and memory checks; `small_w64`'s 8 blocks run in the full suite."""
    return dry_run(TINY, world_size=64, device="h100")


@pytest.mark.slow
def test_world_64_eight_blocks(small_w64):
    result, seconds = small_w64
    # a guard against a pathological slowdown, not a speed target: about 10 s alone on a 2-core
    # machine, several times that on a loaded one (the README's dry-run times are measured by hand)
    assert seconds < 300, f"dry run took {seconds:.1f}s"
    assert result.traced_blocks == (8,)
    assert not result.extrapolated
    assert 0 < result.exposed_s < result.step_s
    forward = [row for row in result.report.buckets if row.phase == "forward"]
    assert len(forward) == SMALL.n_layers + 2, "the default plan: one all-gather per block, the rest in two runs"
    assert {row.group_size for row in result.report.buckets} == {64}
    assert [row.modules for row in forward[1:-1]] == [(f"layers.{i}",) for i in range(SMALL.n_layers)]
    assert sum(row.numel for row in forward) == sum(p.numel() for p in SMALL.build().parameters())


def test_schedule_accounts_for_every_second(tiny_w64):
    """Each phase's end = its start + the roofline seconds of its compute nodes + its stalls, and each
    collective lasts its alpha-beta seconds."""
    result = tiny_w64
    report = result.report
    schedule, device = report.schedule, report.schedule.device
    for phase in (schedule.forward, schedule.backward):
        graph = getattr(report.capture, phase.phase)
        compute = sum(cost.node_seconds(device, node) for node in graph.nodes)
        assert phase.end_s - phase.start_s == pytest.approx(compute + phase.exposed_s, rel=1e-9)
        for event in phase.comm:
            expected = cost.collective_seconds(device, kind=event.collective, nbytes=event.nbytes, world=64)
            assert event.duration_s == pytest.approx(expected)
            assert event.start_s >= event.launch_s, "a collective starts no earlier than its launch"
            # the wait stalls until the collective ends (which includes queueing behind its group's others)
            assert event.exposed_s == pytest.approx(max(0.0, event.end_s - event.wait_s), abs=1e-15)
    assert schedule.step_s == pytest.approx(schedule.backward.end_s + schedule.optimizer_s)
    assert result.exposed_pct == pytest.approx(100 * schedule.exposed_s / schedule.step_s)


def test_memory_counts_this_ranks_shards(tiny_w64):
    result = tiny_w64
    memory = result.report.memory
    # rank 0 holds ceil(dim0 / 64) rows of each fp32 parameter
    expected = sum(math.ceil(p.shape[0] / 64) * math.prod(p.shape[1:]) * 4 for p in TINY.build().parameters())
    assert memory.params_bytes == memory.grads_bytes == expected
    assert memory.optimizer_bytes == 2 * expected, "AdamW: two moments"
    assert memory.backward.end_bytes == memory.grads_bytes, "the backward ends holding exactly the reduced gradients"
    assert memory.activations_bytes > 0
    assert memory.max_in_flight_bytes > 0
    assert (
        result.peak_bytes
        == memory.peak_bytes
        == memory.params_bytes + memory.optimizer_bytes + max(memory.forward.peak_bytes, memory.backward.peak_bytes)
    )


@pytest.mark.slow
def test_extrapolation_matches_a_full_trace(small_w64):
    full, _ = small_w64
    guessed = dry_run("small-8", world_size=64, device="h100", max_traced_blocks=2)
    assert guessed.extrapolated
    assert guessed.traced_blocks == (4, 5)
    assert guessed.step_s == pytest.approx(full.step_s, rel=1e-6)
    assert guessed.exposed_s == pytest.approx(full.exposed_s, rel=1e-6)
    # the peak is a maximum over time, not a sum: where it falls shifts a little with depth (seen: 0.6%)
    assert guessed.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)


@pytest.mark.slow
def test_extrapolation_with_activation_checkpointing_matches_a_full_trace():
    """With AC the forward and backward peaks are close and the backward settles later: the peak is
    extrapolated per graph, from 4 and 5 blocks (from 3 and 4 a Llama-3-70B shape was off 5x)."""
    full = dry_run("small-8", world_size=64, device="h100", ac="full")
    guessed = dry_run("small-8", world_size=64, device="h100", ac="full", max_traced_blocks=2)
    assert guessed.traced_blocks == (4, 5)
    assert guessed.step_s == pytest.approx(full.step_s, rel=1e-6)
    assert guessed.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)
    assert sum(guessed.transient_parts.values()) == guessed.peak_bytes - (
        guessed.persistent.params_bytes + guessed.persistent.optimizer_bytes
    ), "the parts add up to the extrapolated transient"


@pytest.mark.slow
def test_llama3_405b_at_world_1024():
    result = dry_run("llama3-405b", world_size=1024, device="h100")
    assert result.extrapolated
    assert result.n_layers == 126
    n_params = sum(p.numel() for p in model_shape("llama3-405b").build().parameters())
    assert n_params == pytest.approx(405e9, rel=0.01), "the paper's 405B"
    assert result.persistent.params_bytes == pytest.approx(4 * n_params / 1024, rel=1e-3)
    # at least 6 * params * tokens FLOPs (forward + backward matmuls) at the profile's peak
    floor = 6 * n_params * 8192 / result.device.flops_per_s
    assert floor < result.step_s < 10 * floor
    assert 0 <= result.exposed_pct < 100
    assert result.peak_bytes > result.persistent.params_bytes + result.persistent.optimizer_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, r"unknown device profile 'tpu'; known: .*'h100'"),
        ({"world_size": 0}, r"world_size must be an integer from 1"),
        ({"strategy": "HYBRID_SHARD", "shard_size": 5}, r"shard_size must divide the world size 64"),
        ({"strategy": "HYBRID_SHARD"}, r"HYBRID_SHARD needs a 2-D mesh"),
        ({"strategy": "ZERO9"}, r"unknown sharding strategy 'ZERO9'"),
        ({"model": "gpt-7"}, r"unknown model shape 'gpt-7'; known: .*'llama3-405b'"),
        ({"optimizer": "adafactor"}, r"unknown optimizer 'adafactor'"),
    ],
)
def test_bad_input_is_named(kwargs, message):
    call = {"model": "tiny", "world_size": 64, "device": "h100"} | kwargs
    with pytest.raises(ValueError, match=message):
        dry_run(call.pop("model"), **call)


def test_model_failing_on_its_input_is_named():
    def broken():
        return nn.Sequential(nn.Linear(4, 4)), torch.zeros(2, 5)

    with pytest.raises(ValueError, match=r"Sequential does not run on the example input \(\(2, 5\) torch.float32\)"):
        dry_run(broken, world_size=8, mp_policy=simplefsdp.MixedPrecisionPolicy())


def test_int8_gathers_send_about_half_of_bf16s_bytes_and_the_models_price_what_was_traced():
    """`inspect --gather-dtype int8` traces the quantized gathers: each forward / backward all-gather
    is a uint8 collective of codes + fp32 scales (block 128) whose bytes per step are at most 0.55x of
    what a bf16 gather of the same parameters sends (2 bytes each: the elements, padding left out),
    and the schedule charges those bytes; the quantize / dequantize copies are bucket plumbing."""
    from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT
    from simplefsdp.passes.collectives import is_bucket_copy

    policy = simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, gather_dtype="int8", gather_block=128
    )
    report = dry_run(TINY, world_size=8, device="h100", mp_policy=policy).report
    gathers = [row for row in report.buckets if row.collective == "all_gather"]
    assert {row.dtype for row in gathers} == {torch.uint8}
    assert sum(row.nbytes for row in gathers) <= 0.55 * sum(2 * row.numel for row in gathers)
    charged = {event.name: event.nbytes for event in report.schedule.comm if event.collective == "all_gather"}
    assert charged == {row.node: row.nbytes for row in gathers}
    graphs = (report.capture.forward, report.capture.backward)
    quantized = [node for graph in graphs for node in graph.nodes if node.target in (QUANT_COPY_IN, QUANT_COPY_OUT)]
    assert len(quantized) == 2 * len(gathers), "one quantize and one dequantize per bucket"
    assert all(is_bucket_copy(node) for node in quantized)
