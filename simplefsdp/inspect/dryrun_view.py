"""`simplefsdp inspect` without `--advise`: a dry run's tables, the batch and sequence it assumed,
and its verdict, readable at 80 columns (`tables.py`).

    show(result, verdict, args, Console())

[Note: the traced model and the whole model]
A shape deeper than `--max-traced-blocks` is traced at fewer blocks and extrapolated
(`dryrun.py`): its tables (buckets, schedule, memory) are the last trace's, while the summary's
step time and peak and the verdict are the whole depth's. Every number says which it is -- "the
5-block trace", "all 32 blocks" -- so that a traced peak far below the verdict's explains itself:
both count the same parts (sharded parameters, gradients, optimizer state, the transient peak),
for different depths. With `--offload`, the trace's memory table is before offload, the verdict after.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from simplefsdp.inspect.buckets import module_summary
from simplefsdp.inspect.dryrun import DryRunResult
from simplefsdp.inspect.report import builtin_profile_note
from simplefsdp.inspect.shapes import model_shape
from simplefsdp.inspect.tables import Column, table
from simplefsdp.inspect.verdict import MemoryVerdict
from simplefsdp.settings import dtype_name

__all__ = ["assumed_sizes", "show"]

_PHASES = {"forward": "fwd", "backward": "bwd"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:,.2f} GiB"


def _show_verdict(verdict: MemoryVerdict, result: DryRunResult, out: Console, *, wide: bool) -> None:
    """The verdict line, then the whole model's peak by part."""
    style = {True: "green", False: "red", None: "yellow"}[verdict.fits]
    out.print(f"[{style}]{verdict.line()}[/]", highlight=False)
    total = sum(verdict.parts.values()) or 1
    parts = table(
        "",
        [
            Column(f"peak memory per rank ({_depth(result)[1]}), by part", wrap=True),
            Column("bytes", right=True),
            Column("share", right=True),
        ],
        [(part, _mib(nbytes), f"{100 * nbytes / total:.0f}%") for part, nbytes in verdict.parts.items()],
        wide=wide,
    )
    out.print(parts)


def _depth(result: DryRunResult) -> tuple[str, str]:
    """How the traced model and the whole model are called: ("5-block trace", "all 32 blocks"), or
    both "the whole model" when it was traced in full."""
    if not result.extrapolated:
        return "traced model (the whole model)", "the whole model"
    return f"{result.traced_blocks[-1]}-block trace", f"all {result.n_layers} blocks"


def _summary(result: DryRunResult, *, wide: bool) -> Table:
    """What was run, what was traced, and the predictions for the whole model."""
    report = result.report
    traced_params = sum(p.numel() for p in report.capture.model.parameters()) / 1e6
    if result.extrapolated:
        first, last = result.traced_blocks[0], result.traced_blocks[-1]
        traced = (
            f"{first} and {last} of {result.n_layers} blocks ({traced_params:,.1f}M parameters at {last}); "
            f"the tables show the {last}-block trace, the step, peak and verdict are extrapolated to "
            f"{result.n_layers} blocks"
        )
    else:
        traced = f"in full ({traced_params:,.1f}M parameters)"
    dp = result.world_size // result.tp
    layout = f"{dp} data x {result.tp} tensor parallel" if result.tp > 1 else "data parallel"
    rows = [
        ("model", result.model),
        ("world / device", f"{result.world_size} ranks ({layout}), {result.device.name}"),
        ("activation checkpointing", result.ac),
        ("traced", traced),
        ("step time", f"{result.step_s * 1e3:,.3f} ms"),
    ]
    if result.tokens_per_s is not None:
        per_device = result.tokens_per_s / result.world_size
        rows.append(("tokens / s", f"{result.tokens_per_s:,.0f} ({per_device:,.0f} per device)"))
    rows.append(("exposed communication", f"{result.exposed_pct:.1f}% ({result.exposed_s * 1e3:,.3f} ms)"))
    whole = _depth(result)[1]
    rows.append((f"peak memory / rank ({whole})", _mib(result.peak_bytes)))
    if result.offload != "none":
        rows.append((f"offload {result.offload}: host memory / rank", _mib(result.host_bytes)))
    return table(
        "simplefsdp inspect: dry run",
        [Column("", wrap=True), Column("", wrap=True)],
        rows,
        wide=wide,
        show_header=False,
    )


def _tables(result: DryRunResult, rows: int, *, wide: bool = False) -> list[Table]:
    """The summary, buckets, schedule and memory tables; `wide`: every column (else what fits 80 columns)."""
    report, schedule, memory = result.report, result.report.schedule, result.report.memory
    buckets = table(
        "buckets (one row per collective, launch order)",
        [
            Column("id", right=True),
            Column("phase"),
            Column("collective"),
            Column("modules", wrap=True),
            Column("params", right=True),
            Column("elements", right=True, wide=True),
            Column("bytes", right=True),
            Column("dtype"),
            Column("group", right=True, wide=True),
        ],
        [
            (
                str(row.id),
                row.phase,
                row.collective,
                module_summary(row.modules),
                str(len(row.parameters)),
                f"{row.numel:,}",
                _mib(row.nbytes),
                dtype_name(row.dtype),
                str(row.group_size),
            )
            for row in report.buckets[:rows]
        ],
        wide=wide,
    )
    style = {"exposed": "red", "partly exposed": "yellow"}
    timing = table(
        f"schedule on {schedule.device.name} (cost model)",
        [
            Column("collective"),
            Column("launched before", wrap=True),
            Column("waited before", wrap=True),
            Column("comm ms", right=True, wide=True),
            Column("overlap ms", right=True, wide=True),
            Column("exposed ms", right=True),
            Column("status", wrap=True),
        ],
        [
            (
                f"{_PHASES.get(event.phase, event.phase)} {event.collective}",
                event.launched_before,
                event.waited_before,
                f"{event.duration_s * 1e3:.3f}",
                f"{event.compute_between_s * 1e3:.3f}",
                f"{event.exposed_s * 1e3:.3f}",
                f"[{style.get(event.status, 'green')}]{event.status}[/]",
            )
            for event in schedule.comm[:rows]
        ],
        wide=wide,
    )
    traced, whole = _depth(result)
    offload = "" if result.offload == "none" else f", before offload {result.offload}"
    mem = table(
        f"memory per rank: the {traced}{offload}"
        + (f"; the verdict below is for {whole}" if result.extrapolated else ""),
        [Column("", wrap=True), Column("", right=True)],
        [
            ("sharded parameters", _mib(memory.params_bytes)),
            ("sharded gradients", _mib(memory.grads_bytes)),
            ("optimizer state", _mib(memory.optimizer_bytes)),
            ("activations saved for backward", _mib(memory.activations_bytes)),
            ("max in-flight gathered / comm buffers", _mib(memory.max_in_flight_bytes)),
            ("forward peak (transient)", _mib(memory.forward.peak_bytes)),
            ("backward peak (transient, incl. gradients)", _mib(memory.backward.peak_bytes)),
            (f"peak of the {traced}", _mib(memory.peak_bytes)),
        ],
        wide=wide,
        show_header=False,
    )
    return [_summary(result, wide=wide), buckets, timing, mem]


def assumed_sizes(args: argparse.Namespace) -> tuple[int, int] | None:
    """(micro-batch, sequence length) per data-parallel rank that a named shape runs with: the
    flags', else the shape's own; None for a model factory (its example input decides)."""
    if ":" in args.model:
        return None
    shape = model_shape(args.model)
    return args.batch or shape.batch, args.seq or shape.seq


def _assumed_line(args: argparse.Namespace) -> str:
    sizes = assumed_sizes(args)
    if sizes is None:
        return "assumed: the example input the model factory returns, per data-parallel rank"
    batch, seq = sizes
    return (
        f"assumed per data-parallel rank: micro-batch {batch} x sequence {seq:,} = {batch * seq:,} tokens a step "
        "(--micro-batch, --seq)"
    )


def show(result: DryRunResult, verdict: MemoryVerdict, args: argparse.Namespace, out: Console) -> None:
    """The dry run's tables, the batch and sequence it assumed, and the verdict, as the command prints them."""
    for shown in _tables(result, args.rows, wide=args.wide):
        out.print(shown)
    out.print(_assumed_line(args), highlight=False)
    if args.gather_dtype != "none":
        out.print(
            f"gathers: {args.gather_dtype} codes and an fp32 scale per {args.gather_block} elements, the uint8 "
            f"all-gathers above, dequantized into {args.param_dtype} (lossy: --gather-dtype)",
            highlight=False,
        )
    _show_verdict(verdict, result, out, wide=args.wide)
    note = builtin_profile_note(result.device)
    if note:
        out.print(f"[yellow]{note}[/yellow]")
