"""The planner's inputs and verdict: memory capacity, fits / does not fit with the peak's parts,
activation checkpointing and tensor parallelism in the dry run, and the bad input they can get."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io

import pytest
from rich.console import Console

from simplefsdp.inspect import cli
from simplefsdp.inspect.dryrun import dry_run
from simplefsdp.inspect.dryrun_view import show
from simplefsdp.inspect.from_flags import verdict_of
from simplefsdp.inspect.shapes import SHAPES
from simplefsdp.inspect.verdict import OPTIMIZER, PARAMETERS, MemoryVerdict, memory_verdict
from simplefsdp.passes import cost
from simplefsdp.passes.collectives import find_collectives
from simplefsdp.passes.liveness import ACTIVATIONS
from tests._tiers import fast_first

GIB = 2**30
SHAPE = SHAPES["tiny"]  # the smallest shape with repeated blocks: each dry run here takes seconds


@pytest.fixture(scope="module")
def small_w8():
    return dry_run(SHAPE, world_size=8, device="h100")


@pytest.fixture(scope="module")
def checkpointed():
    """`ac` ("full", "selective") -> `small_w8` with its blocks checkpointed so, dry-run once per module."""
    return functools.cache(lambda ac: dry_run(SHAPE, world_size=8, device="h100", ac=ac))


def test_profiles_carry_their_memory_capacity():
    assert cost.profile("h100").capacity_bytes == 80e9
    assert cost.profile("h200").capacity_bytes == 141e9
    assert cost.profile("a100").capacity_bytes == 80e9
    assert cost.profile("a100-40gb").capacity_bytes == 40e9
    assert cost.profile("cpu-gloo").capacity_bytes is None, "a host's memory is not a datasheet number"


def test_verdict_against_the_capacity_and_its_margin(small_w8):
    peak = small_w8.peak_bytes
    roomy = memory_verdict(small_w8, capacity_bytes=2 * peak)
    assert roomy.fits is True
    assert sum(roomy.parts.values()) == peak, "the parts are the whole peak"
    assert roomy.line().startswith("fits on h100")
    tight = memory_verdict(small_w8, capacity_bytes=peak / 0.95)  # inside the 10% margin
    assert tight.fits is False
    assert "only without the 10% safety margin" in tight.line()
    assert memory_verdict(small_w8, capacity_bytes=peak / 0.95, margin=0.0).fits is True
    short = memory_verdict(small_w8, capacity_bytes=peak / 2)
    assert short.fits is False
    assert short.headroom_bytes == pytest.approx(-peak / 2)
    assert f"over by {peak / 2 / GIB:,.2f} GiB" in short.line()
    datasheet = memory_verdict(small_w8)
    assert datasheet.capacity_bytes == 80e9
    assert datasheet.fits is True, "a small model fits an H100"
    unknown = memory_verdict(dataclasses.replace(small_w8, device=cost.profile("cpu-gloo")))
    assert unknown.fits is None
    assert "no verdict" in unknown.line()


def _compute_s(result) -> float:
    graphs = (result.report.capture.forward, result.report.capture.backward)
    return sum(cost.node_seconds(result.device, node) for graph in graphs for node in graph.nodes)


def test_activation_checkpointing_trades_activations_for_recompute(small_w8, checkpointed):
    full = checkpointed("full")
    plain, checkpointed = memory_verdict(small_w8), memory_verdict(full)
    assert checkpointed.parts[ACTIVATIONS] < plain.parts[ACTIVATIONS]
    assert full.peak_bytes < small_w8.peak_bytes
    assert _compute_s(full) > _compute_s(small_w8), "the recomputation costs compute (hidden or not)"
    assert checkpointed.parts[PARAMETERS] == plain.parts[PARAMETERS]
    assert checkpointed.parts[OPTIMIZER] == plain.parts[OPTIMIZER]


@pytest.mark.parametrize("ac", fast_first(["full", "selective"]))  # "full": the dry run the test above made
def test_checkpointed_blocks_trace_the_flash_kernel_on_meta(checkpointed, ac):
    """On meta, attention is rewritten to the flash kernel also inside checkpointed blocks (whose
    body reaches the backend as a subgraph): a math-path softmax would be [B, H, S, S] per block."""
    result = checkpointed(ac)
    targets = [str(node.target) for node in result.report.capture.forward.nodes if node.op == "call_function"]
    assert sum("_scaled_dot_product_flash_attention" in t for t in targets) == SHAPE.args.n_layers, "one per block"
    assert not [t for t in targets if "softmax" in t], "no math-path attention"


def test_tensor_parallel_dry_run_splits_the_world(small_w8):
    tp = dry_run(SHAPE, world_size=8, device="h100", tp=2)
    graphs = (tp.report.capture.forward, tp.report.capture.backward)
    kinds = ("all_gather", "reduce_scatter")  # an all-reduce reads its size from the (gone) process group
    sizes = {c.group_size for graph in graphs for c in find_collectives(graph, kinds=kinds)}
    assert sizes == {4, 2}, "FSDP over the 4 data-parallel ranks, TP over pairs"
    # both shard every block matmul 8 ways; TP keeps the norms whole on its 2 ranks, so a little more
    assert tp.persistent.params_bytes == pytest.approx(small_w8.persistent.params_bytes, rel=0.05)
    assert (tp.tp, small_w8.tp) == (2, 1)
    # tokens: batch x seq per data-parallel rank; the tp ranks of one dp rank share theirs
    tokens = SHAPE.batch * SHAPE.seq
    assert tp.tokens_per_s == pytest.approx(tokens * 4 / tp.step_s)
    assert small_w8.tokens_per_s == pytest.approx(tokens * 8 / small_w8.step_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3}, r"tp must be a positive integer dividing the world size 8, got 3"),
        ({"tp": 2, "strategy": "HYBRID_SHARD", "shard_size": 2}, r"with FULL_SHARD / SHARD_GRAD_OP, not HYBRID_SHARD"),
        ({"ac": "some"}, r"unknown activation checkpointing 'some'; known: none, full, selective"),
        ({"batch": 0}, r"^batch must be a positive integer, got 0$"),
        ({"seq": -5}, r"^seq must be a positive integer, got -5$"),
    ],
)
def test_bad_planner_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dry_run("tiny", world_size=8, device="h100", **kwargs)


def test_bad_capacity_or_margin_is_named(small_w8):
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\), got 1.0"):
        memory_verdict(small_w8, margin=1.0)
    with pytest.raises(ValueError, match=r"capacity must be > 0 bytes, got 0"):
        memory_verdict(small_w8, capacity_bytes=0)


def test_cli_prints_the_verdict_and_refuses_impossible_memory(capsys):
    assert cli.main(["tiny", "--world", "8", "--device-memory-gib", "0.0001", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "does not fit on h100" in out
    assert "activations" in out
    assert cli.main(["tiny", "--world", "8", "--device-memory-gib", "-1"]) == 2
    assert "--device-memory-gib must be > 0, got -1.0" in capsys.readouterr().err
    assert cli.main(["tiny", "--world", "6", "--tp", "4"]) == 2
    assert "tp must be a positive integer dividing the world size 6, got 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["os:getcwd"], "model factory getcwd must return (nn.Module, example input), got str '"),
        (["os:sep"], "model factory 'os:sep' is a str, not a function"),
        (["tiny", "--micro-batch", "0"], "argument --micro-batch/--batch: must be a positive integer, got '0'"),
        (["tiny", "--seq", "-5"], "argument --seq: must be a positive integer, got '-5'"),
        (["tiny", "--world", "x"], "argument --world: must be a positive integer, got 'x'"),
        (["tiny", "--out", "{file}/inspect"], "--out {file}/inspect: {file} is a file, not a directory"),
    ],
)
def test_cli_bad_model_or_sizes_are_one_line_naming_them(tmp_path, capsys, argv, message):
    """Found before the dry run (the factory's result right after it is called), one line on stderr."""
    file = tmp_path / "a-file"
    file.write_text("")
    assert cli.main([a.format(file=file) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"simplefsdp inspect: error: {message.format(file=file)}"), err
    assert err.count("\n") == 1, err


def test_offloaded_bytes_must_fit_the_host_too():
    """An offload tier's host share is checked against the host's memory with the same margin."""
    gib = 2**30
    verdict = MemoryVerdict(
        device="h100",
        capacity_bytes=80 * gib,
        peak_bytes=40 * gib,
        margin=0.1,
        parts={},
        hint="",
        host_bytes=100 * gib,
        host_capacity_bytes=200 * gib,
    )
    assert verdict.fits
    assert verdict.line().endswith("100.00 GiB/rank offloaded to host memory (of 200.00 GiB)")
    small_host = dataclasses.replace(verdict, host_capacity_bytes=105 * gib)  # 100 > 0.9 * 105
    assert small_host.host_fits is False
    assert small_host.fits is False
    assert small_host.line().startswith("does not fit: host memory cannot hold 100.00 GiB/rank")
    unknown = dataclasses.replace(verdict, host_capacity_bytes=None)
    assert unknown.fits is None
    assert "host capacity unknown" in unknown.line()
    assert dataclasses.replace(verdict, host_bytes=0, host_capacity_bytes=None).fits, "no offload: no host check"


def test_cli_plans_offload_per_block_under_a_limit(capsys):
    """`--offload auto`: "tiny" at world 8 peaks at 0.21 MiB per rank without offload; under a
    0.19 MiB limit some of its units offload (the cheapest tier first) and the verdict fits."""
    argv = ["tiny", "--world", "8", "--offload", "auto", "--rows", "1"]
    assert cli.main([*argv, "--device-memory-limit-gib", str(0.19 / 1024)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "offload auto (" in out
    assert "units optimizer" in out
    assert "offloaded to host memory" in out
    assert "fits on h100" in out


def _printed(result, argv, *, width):
    """What `simplefsdp inspect` prints for `result` under `argv`, on a terminal `width` columns wide."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    out = Console(width=width, file=io.StringIO(), record=True)
    show(result, verdict_of(result, args), args, out)
    return out.export_text()


def test_the_tables_read_at_80_columns_and_wide_shows_every_column(small_w8):
    """At 80 columns no line is longer and no cell is cut short ("…"): long cells wrap, and the
    columns of least use (elements, group, comm and overlap ms) are left out; `--wide` shows them
    all, each cell on one line."""
    narrow = _printed(small_w8, ["tiny", "--world", "8"], width=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80
    assert "…" not in narrow
    assert "..." not in narrow
    for header in ("elements", "group", "comm ms", "overlap ms"):
        assert header not in narrow
    assert "reduce_scatter" in narrow, "names and numbers keep their width; only prose wraps"
    wide = _printed(small_w8, ["tiny", "--world", "8", "--wide"], width=10_000)
    assert "…" not in wide
    for header in ("elements", "group", "comm ms", "overlap ms", "launched before", "exposed ms"):
        assert header in wide
    event = small_w8.report.schedule.comm[0]
    assert any(event.launched_before in line for line in wide.splitlines()), "a cell on one line"


def test_the_assumed_batch_and_the_traced_depth_are_printed_with_the_verdict(small_w8):
    """Above the verdict: the micro-batch and sequence the prediction assumes (the shape's own, or the
    flags'). A model traced at fewer blocks than it has says so wherever its numbers differ: the
    tables are the trace's, the summary's peak and the verdict the whole depth's."""
    text = _printed(small_w8, ["tiny", "--world", "8"], width=80)
    assumed = "assumed per data-parallel rank: micro-batch 2 x sequence 16 = 32 tokens a step"
    assert assumed in text
    assert text.index(assumed) < text.index("fits on h100")
    assert "micro-batch 3 x sequence 8 = 24 tokens" in _printed(
        small_w8, ["tiny", "--micro-batch", "3", "--seq", "8"], width=80
    )
    assert "memory per rank: the traced model (the whole model)" in text
    assert "gathers:" not in text
    quantized = _printed(small_w8, ["tiny", "--gather-dtype", "int8", "--gather-block", "64"], width=10_000)
    assert (
        "gathers: int8 codes and an fp32 scale per 64 elements, the uint8 all-gathers above, dequantized" in quantized
    )
    assert "peak memory / rank (the whole model)" in text
    deep = dataclasses.replace(small_w8, traced_blocks=(4, 5), n_layers=32)
    text = " ".join(_printed(deep, ["tiny"], width=80).replace("│", " ").split())
    assert "4 and 5 of 32 blocks" in text
    assert "the tables show the 5-block trace, the step, peak and verdict are extrapolated to 32 blocks" in text
    assert "peak memory / rank (all 32 blocks)" in text
    assert "memory per rank: the 5-block trace; the verdict below is for all 32 blocks" in text
    assert "peak of the 5-block trace" in text
    assert "peak memory per rank (all 32 blocks), by part" in text
