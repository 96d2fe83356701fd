"""The cost model: alpha-beta collectives and roofline compute on traced nodes."""

from __future__ import annotations

import dataclasses
import json
import math
import operator

import pytest
import torch
from torch import fx

from simplefsdp._compat import FakeTensorMode
from simplefsdp.passes import cost
from simplefsdp.passes.fsdp_pass import BucketConfig

H100 = cost.profile("h100")


def test_collective_seconds_alpha_beta():
    one_gib = 2**30
    ag = cost.collective_seconds(H100, kind="all_gather", nbytes=one_gib, world=8)
    assert ag == pytest.approx(H100.latency_s + 7 / 8 * one_gib / H100.bus_bytes_per_s)
    ar = cost.collective_seconds(H100, kind="all_reduce", nbytes=one_gib, world=8)
    assert ar - H100.latency_s == pytest.approx(2 * (ag - H100.latency_s)), "an all-reduce moves twice the bytes"
    assert cost.collective_seconds(H100, kind="all_gather", nbytes=10, world=8) == pytest.approx(
        H100.latency_s, rel=1e-3
    )


def _node(target, *shapes):
    with FakeTensorMode() as mode:
        vals = [mode.from_tensor(torch.empty(s)) for s in shapes]
        out = target(*vals)
    graph = fx.Graph()
    inputs = []
    for i, v in enumerate(vals):
        node = graph.placeholder(f"x{i}")
        node.meta["val"] = v
        inputs.append(node)
    node = graph.call_function(target, tuple(inputs))
    node.meta["val"] = out
    return node


def test_matmul_is_compute_bound_and_pointwise_memory_bound():
    mm = _node(torch.ops.aten.mm.default, (4096, 4096), (4096, 4096))
    assert cost.node_seconds(H100, mm) == pytest.approx(2 * 4096**3 / H100.flops_per_s)
    add = _node(torch.ops.aten.add.Tensor, (4096, 4096), (4096, 4096))
    assert cost.node_seconds(H100, add) == pytest.approx(3 * 4096**2 * 4 / H100.memory_bytes_per_s)
    view = _node(torch.ops.aten.t.default, (4096, 4096))
    assert cost.node_seconds(H100, view) == 0.0


def test_cpu_attention_counts_its_matmuls():
    """[Note: attention on the CPU]: the CPU's fused attention has no formula in torch's registry; the
    cost model counts two attention-sized matmuls forward and five backward (2 * B * H * S_q * S_k * D each)."""
    aten = torch.ops.aten
    b, h, s, d = 2, 8, 128, 64
    forward = _node(aten._scaled_dot_product_flash_attention_for_cpu.default, *[(b, h, s, d)] * 3)
    one = 2 * b * h * s * s * d
    assert cost.counts_flops(forward)
    assert cost.node_flops(forward) == 2 * one
    with FakeTensorMode() as mode:
        q, k, v, grad_out = (mode.from_tensor(torch.empty(b, h, s, d)) for _ in range(4))
        out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out, q, k, v, out, logsumexp, 0.0, False
        )
    graph = fx.Graph()
    inputs = []
    for name, val in zip(("g", "q", "k", "v", "o", "l"), (grad_out, q, k, v, out, logsumexp), strict=True):
        inputs.append(graph.placeholder(name))
        inputs[-1].meta["val"] = val
    backward = graph.call_function(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (*inputs, 0.0, False)
    )
    backward.meta["val"] = grads
    assert cost.node_flops(backward) == 5 * one
    cpu = cost.profile("cpu-gloo")
    assert cost.node_seconds(cpu, backward) == pytest.approx(5 * one / cpu.flops_per_s), "compute bound"


def test_reshape_is_free_only_when_it_is_a_view():
    """A reshape of a contiguous tensor is a view (free); of a transposed one, a copy (memory bound);
    `getitem` picks one output of a multi-output op and moves nothing."""
    aten = torch.ops.aten
    with FakeTensorMode() as mode:
        contiguous = mode.from_tensor(torch.empty(64, 32))
        transposed = mode.from_tensor(torch.empty(32, 64)).t()
        flat, pieces = aten.reshape.default(contiguous, [-1]), aten.split.Tensor(contiguous, 32)
    graph = fx.Graph()
    x = graph.placeholder("x")
    reshape = graph.call_function(aten.reshape.default, (x, [-1]))
    split = graph.call_function(aten.split.Tensor, (x, 32))
    pick = graph.call_function(operator.getitem, (split, 0))
    x.meta["val"], reshape.meta["val"], split.meta["val"], pick.meta["val"] = contiguous, flat, pieces, pieces[0]
    assert cost.node_seconds(H100, reshape) == 0.0
    assert cost.node_seconds(H100, pick) == 0.0
    assert cost.node_seconds(H100, split) == 0.0, "split returns views"
    x.meta["val"] = transposed
    assert cost.node_seconds(H100, reshape) == pytest.approx(2 * 64 * 32 * 4 / H100.memory_bytes_per_s)


def test_unknown_profile_is_named():
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu'.*'h100'"):
        BucketConfig(plan="auto", device="tpu")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[x]\nlatency_s = 1e-5\n", r"\[x\] latency_s: must be \{ value = \.\.\., source"),
        ('[x]\nlatency_s = { value = 1e-5, source = " " }\n', r"\[x\] latency_s: the source must say"),
        ('[x]\nlatency = { value = 1e-5, source = "s" }\n', r"\[x\] latency: not a DeviceProfile field"),
        ("x = 1\n", r"\[x\]: must be a table of DeviceProfile fields"),
        ('[x]\nlatency_s = { value = 1e-5, source = "s" }\n', r"\[x\]: .*missing .*bus_bytes_per_s"),
        ("[x\n", r"p\.toml"),
    ],
    ids=["bare value", "blank source", "unknown field", "not a table", "missing field", "not toml"],
)
def test_profiles_file_refuses_what_it_cannot_read(tmp_path, text, message):
    """`cost.read_profiles` (the named profiles' data file): every value names its source; an error
    names the file, the profile and the key."""
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ValueError, match=message):
        cost.read_profiles(tmp_path / "p.toml")


def test_named_profiles_come_from_the_data_file():
    assert cost.read_profiles(cost.PROFILES_FILE) == cost.PROFILES
    assert set(cost.PROFILES) == {"h100", "h200", "a100", "a100-40gb", "cpu-gloo"}


def test_wake_seconds_saturate_and_drift_grows_with_compute():
    device = dataclasses.replace(cost.profile("cpu-gloo"), wake_s=3e-3, wake_tau_s=2e-3)
    assert cost.wake_seconds(device, idle_s=0.0, compute_s=0.0) == 0.0
    assert cost.wake_seconds(device, idle_s=-1.0, compute_s=0.0) == 0.0, "the stream is still busy: no idle time"
    assert cost.wake_seconds(device, idle_s=2e-3, compute_s=2e-3) == pytest.approx(3e-3 * (1 - math.exp(-1)))
    assert cost.wake_seconds(device, idle_s=math.inf, compute_s=0.0) == pytest.approx(3e-3)
    drifting = dataclasses.replace(device, drift=0.25)
    assert cost.wake_seconds(drifting, idle_s=math.inf, compute_s=8e-3) == pytest.approx(3e-3 + 2e-3)
    assert cost.wake_seconds(drifting, idle_s=math.inf, compute_s=1.0) == pytest.approx(3e-3 + 0.25)
    # the line is not extrapolated past the longest stretch calibration measured
    spanned = dataclasses.replace(drifting, drift_span_s=4e-3)
    assert cost.wake_seconds(spanned, idle_s=math.inf, compute_s=2e-3) == pytest.approx(3e-3 + 0.5e-3)
    assert cost.wake_seconds(spanned, idle_s=math.inf, compute_s=1.0) == pytest.approx(3e-3 + 1e-3)
    assert cost.wake_seconds(H100, idle_s=math.inf, compute_s=1.0) == 0.0, "datasheet profiles charge none"


def test_optimizer_seconds_measured_or_memory_bound():
    elements = 10**6
    assert cost.optimizer_seconds(H100, optimizer="adamw", tensors=7, elements=elements) == pytest.approx(
        elements * 28 / H100.memory_bytes_per_s
    )
    assert cost.optimizer_seconds(H100, optimizer="none", tensors=7, elements=elements) == 0.0
    measured = dataclasses.replace(H100, optimizers=(("adamw", 1e-4, 2e-9),))
    assert cost.optimizer_seconds(measured, optimizer="adamw", tensors=7, elements=elements) == pytest.approx(
        7e-4 + 2e-3
    )
    assert cost.optimizer_seconds(measured, optimizer="sgd", tensors=7, elements=elements) == pytest.approx(
        elements * 20 / H100.memory_bytes_per_s
    ), "an optimizer the profile did not measure falls back to memory bound"
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        cost.optimizer_seconds(H100, optimizer="lamb", tensors=1, elements=1)


def test_profile_file_round_trips_the_step_terms(tmp_path):
    device = dataclasses.replace(
        H100,
        name="measured",
        wake_s=1e-3,
        wake_tau_s=4e-3,
        drift=0.1,
        drift_span_s=8e-3,
        staging=(("all_gather", 1.0),),
        optimizers=(("adamw", 1e-4, 2e-9), ("sgd", 5e-5, 1e-9)),
        launch=(("all_gather", 2e-4, 1e-11),),
        copy_ops=(("all_gather_copy_out", 3e-5, 7e-6), ("reduce_scatter_copy_in", 2e-5, 2e-6)),
        step_collective_s=3e-4,
        step_exposed_wait_s=5e-4,
        step_hidden_s=2e-4,
        compute_scale=1.2,
        backend="gloo",
    )
    cost.save_profile(device, tmp_path / "p.json")
    assert cost.profile(str(tmp_path / "p.json")) == device
    # a file written before profiles named their backend: unknown, so a dry run issues reduce-scatters
    data = json.loads((tmp_path / "p.json").read_text())
    del data["backend"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert cost.profile(str(tmp_path / "old.json")).backend == ""
    assert {p.name: p.backend for p in cost.PROFILES.values()}["cpu-gloo"] == "gloo"
    assert {p.backend for name, p in cost.PROFILES.items() if name != "cpu-gloo"} == {"nccl"}
    with pytest.raises(ValueError, match=r"compute_scale must be > 0"):
        dataclasses.replace(H100, compute_scale=0.0)
    with pytest.raises(ValueError, match=r"drift_span_s must be > 0 or None"):
        dataclasses.replace(H100, drift_span_s=0.0)
    with pytest.raises(ValueError, match=r"copy_ops must be at most one each of .*\('pack', "):
        dataclasses.replace(H100, copy_ops=(("pack", 1e-5, 0.0),))
    with pytest.raises(ValueError, match=r"copy_ops must be .* seconds >= 0"):
        dataclasses.replace(H100, copy_ops=(("all_gather_copy_in", 1e-5, -1e-6),))
    with pytest.raises(ValueError, match=r"optimizers must be at most one each of .*got \['adam'\]"):
        dataclasses.replace(H100, optimizers=(("adam", 1e-4, 1e-9),))
    terms = "wake_s, drift, step_collective_s, step_exposed_wait_s and step_hidden_s must be >= 0"
    for field, value in (
        ("wake_s", -1.0),
        ("drift", -0.1),
        ("step_collective_s", -1e-4),
        ("step_exposed_wait_s", -1e-4),
        ("step_hidden_s", -1e-4),
    ):
        with pytest.raises(ValueError, match=terms):
            dataclasses.replace(H100, **{field: value})


def test_a_copy_op_costs_its_call_on_top_of_its_bytes():
    """[Note: what a training step adds], the copy ops' calls: a measured profile charges each bucket
    copy op `seconds + seconds per member tensor` beyond its roofline; other nodes and named profiles
    pay nothing extra."""
    from simplefsdp.kernels.copy_ops import ALL_GATHER_COPY_OUT, REDUCE_SCATTER_COPY_IN

    world, chunks = 2, [64, 256, 32]
    with FakeTensorMode() as mode:
        gathered = mode.from_tensor(torch.empty(world * sum(chunks)))
        outs = ALL_GATHER_COPY_OUT(gathered, chunks, [128, 512, 64], [1, 1, 1], world)
        grads = [mode.from_tensor(torch.empty(n)) for n in (128, 512)]
        flat = REDUCE_SCATTER_COPY_IN(grads, world, torch.float32, 1.0)
    graph = fx.Graph()
    g, r0, r1 = (graph.placeholder(name) for name in ("g", "r0", "r1"))
    g.meta["val"], r0.meta["val"], r1.meta["val"] = gathered, *grads
    out = graph.call_function(ALL_GATHER_COPY_OUT, (g, chunks, [128, 512, 64], [1, 1, 1], world))
    out.meta["val"] = outs
    rs = graph.call_function(REDUCE_SCATTER_COPY_IN, ([r0, r1], world, torch.float32, 1.0))
    rs.meta["val"] = flat
    cpu = cost.profile("cpu-gloo")
    measured = dataclasses.replace(
        cpu, copy_ops=(("all_gather_copy_out", 3e-5, 7e-6), ("reduce_scatter_copy_in", 2e-5, 0.0))
    )
    assert cost.node_seconds(measured, out) == pytest.approx(cost.node_seconds(cpu, out) + 3e-5 + 3 * 7e-6)
    assert cost.node_seconds(cpu, out) == pytest.approx(2 * 4 * world * sum(chunks) / cpu.memory_bytes_per_s)
    assert cost.node_seconds(measured, rs) == pytest.approx(cost.node_seconds(cpu, rs) + 2e-5), "fixed only"
    assert cost.copy_call_seconds(measured, op="all_gather_copy_in", tensors=5) == 0.0, "not measured: nothing"
    mm = _node(torch.ops.aten.mm.default, (64, 64), (64, 64))
    assert cost.node_seconds(measured, mm) == cost.node_seconds(cpu, mm), "only the copy ops pay a call"
    # [Note: what a training step adds], compute as compiled: the scale multiplies the roofline, not the call
    scaled = dataclasses.replace(measured, compute_scale=1.5)
    assert cost.node_seconds(scaled, mm) == pytest.approx(1.5 * cost.node_seconds(cpu, mm))
    roofline = cost.node_seconds(cpu, out)
    assert cost.node_seconds(scaled, out) == pytest.approx(1.5 * roofline + 3e-5 + 3 * 7e-6)


def test_the_quantized_copy_ops_cost_their_bytes_and_the_gather_copy_calls():
    """The quantized gather's copy-in / copy-out are priced like the plain ones: their bytes on the
    roofline (fp32 shards in, the uint8 slot buffer out; the buffer in, bf16 members out), plus the
    plain gather copy op's measured call."""
    from simplefsdp.kernels import quantize
    from simplefsdp.kernels.quant_ops import QUANT_COPY_IN, QUANT_COPY_OUT

    world, block, chunks, sizes = 2, 128, [64, 256, 32], [128, 512, 64]
    slot = quantize.slot_layout(chunks, block).nbytes
    with FakeTensorMode() as mode:
        shards = [mode.from_tensor(torch.empty(n)) for n in chunks]
        slot_val = QUANT_COPY_IN(shards, chunks, torch.int8, block)
        buffer = slot_val.repeat(world)  # what the all-gather returns
        outs = QUANT_COPY_OUT(buffer, chunks, sizes, [1, 1, 1], world, torch.int8, block, torch.bfloat16)
    assert slot_val.shape == (slot,)
    graph = fx.Graph()
    inputs = [graph.placeholder(f"s{i}") for i in range(len(chunks))]
    for node, shard in zip(inputs, shards, strict=True):
        node.meta["val"] = shard
    copy_in = graph.call_function(QUANT_COPY_IN, (inputs, chunks, torch.int8, block))
    copy_in.meta["val"] = slot_val
    gathered = graph.placeholder("gathered")
    gathered.meta["val"] = buffer
    copy_out = graph.call_function(
        QUANT_COPY_OUT, (gathered, chunks, sizes, [1, 1, 1], world, torch.int8, block, torch.bfloat16)
    )
    copy_out.meta["val"] = outs
    cpu = cost.profile("cpu-gloo")
    assert cost.node_seconds(cpu, copy_in) == pytest.approx((4 * sum(chunks) + slot) / cpu.memory_bytes_per_s)
    assert cost.node_seconds(cpu, copy_out) == pytest.approx((world * slot + 2 * sum(sizes)) / cpu.memory_bytes_per_s)
    measured = dataclasses.replace(
        cpu, copy_ops=(("all_gather_copy_in", 5e-5, 1e-6), ("all_gather_copy_out", 3e-5, 7e-6))
    )
    assert cost.node_seconds(measured, copy_in) == pytest.approx(cost.node_seconds(cpu, copy_in) + 5e-5 + 3 * 1e-6)
    assert cost.node_seconds(measured, copy_out) == pytest.approx(cost.node_seconds(cpu, copy_out) + 3e-5 + 3 * 7e-6)
    assert "quant_copy_in" not in cost.COPY_OPS, "a profile times the plain ops' calls only"
