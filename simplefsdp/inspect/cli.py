"""`simplefsdp inspect`: dry-run a model and show buckets, schedule, memory and a timeline.

    simplefsdp inspect llama3-70b --world 1024 --device h100 --out inspect-70b/
    simplefsdp inspect small-8 --world 8 --code --out inspect-small/   # also inductor's code (CPU)
    simplefsdp inspect mypkg.models:build --world 64                   # a factory -> (model, input)
    simplefsdp inspect llama3-405b --world 1024 --max-in-flight-gib 16  # let 6.4 GB blocks prefetch
    simplefsdp inspect llama3-70b --world 64 --tp 8 --ac full --device h100  # does it fit, and how fast?
    simplefsdp inspect llama3-70b --world 64 --device h100 --advise --tp 1,8  # what should I run?

The output is this command's product, so it prints (rich tables); the library logs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import simplefsdp
from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.buckets import module_summary
from simplefsdp.inspect.dryrun import AC_POLICIES, DryRunResult, dry_run
from simplefsdp.inspect.offload_cost import copy_fraction, reshards, with_plan
from simplefsdp.inspect.report import builtin_profile_note
from simplefsdp.inspect.shapes import SHAPES, ModelShape, model_shape
from simplefsdp.inspect.verdict import MemoryVerdict, memory_verdict
from simplefsdp.offload import TIERS
from simplefsdp.offload_plan import OffloadPlan, offload_units, plan_offload
from simplefsdp.passes import cost
from simplefsdp.passes.fsdp_pass import parse_memory_budget
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.writable import check_directory, check_file

__all__ = ["add_arguments", "main", "run"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Parser(argparse.ArgumentParser):
    """argparse that raises a ValueError instead of exiting, so a bad flag is one line like any other."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def _positive(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:,.2f} GiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"a shape ({', '.join(SHAPES)}) or 'module:function' -> (model, example input)")
    parser.add_argument("--world", type=_positive, default=8, help="ranks in all, data x tensor parallel (fake group)")
    parser.add_argument(
        "--tp",
        type=_degrees,
        default=(1,),
        help="tensor-parallel degree (named shapes), dividing --world; with --advise a list to search, e.g. 1,8",
    )
    parser.add_argument(
        "--ac",
        choices=AC_POLICIES,
        default=None,
        help="activation checkpointing of every block (default none; --advise: searches all unless given)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive,
        default=os.cpu_count() or 1,
        help="--advise: traces run at once, in worker processes (default: one per CPU core)",
    )
    parser.add_argument(
        "--advise",
        action="store_true",
        help="search strategy x AC x bucket plan x prefetch (x --tp degrees) and rank what fits by speed",
    )
    parser.add_argument(
        "--advise-toml",
        default=None,
        metavar="FILE",
        help="--advise: also write the advised run as a `simplefsdp train --config` TOML file",
    )
    parser.add_argument(
        "--device",
        default="h100",
        help=f"device profile: {', '.join(sorted(cost.PROFILES))}, or a file from `simplefsdp calibrate`",
    )
    parser.add_argument(
        "--strategy",
        default=None,
        help=f"{', '.join(ShardingStrategy.__members__)} (default FULL_SHARD; --advise: searches them unless given)",
    )
    parser.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (HYBRID_* only)")
    parser.add_argument("--param-dtype", choices=sorted(_DTYPES), default="bf16", help="all-gather / compute dtype")
    parser.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default="fp32", help="gradient reduction dtype")
    parser.add_argument(
        "--plan",
        choices=["blocks", "auto", "none"],
        default=None,
        help="bucket plan (default blocks); none: no passes; --advise searches the plans itself",
    )
    parser.add_argument(
        "--max-in-flight-gib", type=float, default=None, help="reorder budget for prefetched / in-flight buffers"
    )
    parser.add_argument(
        "--memory-budget",
        type=parse_memory_budget,
        default=None,
        help="auto plan: bytes the pass may add to a graph's peak, 0.25 (a fraction) or 512MiB",
    )
    parser.add_argument(
        "--micro-batch", "--batch", dest="batch", type=_positive, default=None, help="sequences per data-parallel rank"
    )
    parser.add_argument("--seq", type=_positive, default=None, help="sequence length (shapes only)")
    parser.add_argument("--optimizer", choices=["adamw", "sgd", "none"], default="adamw")
    parser.add_argument("--max-traced-blocks", type=int, default=8, help="deeper shapes: trace 4 and 5, extrapolate")
    parser.add_argument(
        "--device-memory-gib", type=float, default=None, help="memory per device (default: the profile's capacity)"
    )
    parser.add_argument(
        "--offload",
        choices=(*TIERS, "auto"),
        default=None,
        help="what lives in host memory: optimizer (state, masters, gradients) or all; auto: per block, "
        "as little as meets --device-memory-limit-gib (default none; --advise: searches the tiers unless given)",
    )
    parser.add_argument(
        "--device-memory-limit-gib",
        type=float,
        default=None,
        help="--offload auto: the device memory per rank a step may use (default: the capacity less the margin)",
    )
    parser.add_argument(
        "--host-memory-gib", type=float, default=None, help="host memory per rank (default: the profile's)"
    )
    parser.add_argument("--margin", type=float, default=0.1, help="safety margin of the fits verdict (default 0.1)")
    parser.add_argument("--code", action="store_true", help="build on the CPU, compile with inductor, keep its code")
    parser.add_argument("--out", default=None, help="directory for graphs, code, JSON tables and timeline.png/html")
    parser.add_argument("--rows", type=_positive, default=20, help="rows shown per table (all are in --out's JSON)")


def _degrees(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or a comma-separated list such as 1,8; got {text!r}"
        ) from None
    return degrees


def _factory(spec: str) -> Callable[[], tuple[torch.nn.Module, Any]]:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load model factory {spec!r}: {error}") from error
    if not callable(factory):
        raise ValueError(f"model factory {spec!r} is a {type(factory).__name__}, not a function")
    return factory


def _model(args: argparse.Namespace) -> str | ModelShape | Callable[[], tuple[torch.nn.Module, Any]]:
    if ":" in args.model:
        return _factory(args.model)
    shape = model_shape(args.model)
    if not args.code:
        return shape

    def on_cpu() -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        return shape.build(device="cpu"), shape.example_input(batch=args.batch, seq=args.seq, device="cpu")

    on_cpu.__name__ = shape.name
    return on_cpu


def run(args: argparse.Namespace) -> DryRunResult:
    """Dry-run per the parsed arguments; returns the result (the CLI prints it)."""
    if len(args.tp) != 1:
        raise ValueError(f"--tp takes one degree without --advise, got {','.join(map(str, args.tp))}")
    plan = args.plan or "blocks"
    if plan == "none":
        passes = None
    else:
        reorder = simplefsdp.ReorderConfig()
        if args.max_in_flight_gib is not None:
            reorder = simplefsdp.ReorderConfig(max_in_flight_bytes=int(args.max_in_flight_gib * 2**30))
        bucket = simplefsdp.BucketConfig(plan=plan, device=args.device, memory_budget=args.memory_budget)
        passes = simplefsdp.PassConfig(bucket=bucket, reorder=reorder)
    result = dry_run(
        _model(args),
        world_size=args.world,
        device=args.device,
        strategy=args.strategy or "FULL_SHARD",
        shard_size=args.shard_size,
        mp_policy=_mp_policy(args),
        passes=passes,
        batch=args.batch,
        seq=args.seq,
        optimizer=args.optimizer,
        max_traced_blocks=args.max_traced_blocks,
        code=args.code,
        tp=args.tp[0],
        ac=args.ac or "none",
        offload="none" if args.offload in (None, "auto") else args.offload,
    )
    if args.offload != "auto":
        return result
    return _planned(result, args)


def _planned(result: DryRunResult, args: argparse.Namespace) -> DryRunResult:
    """`--offload auto`: the per-block plan that keeps the step under the limit ([Note: planning
    offload under a limit] in `offload_plan.py`), priced; everything at "all" when none does (the
    verdict then says it does not fit)."""
    model = _model(args)
    module = model.build() if isinstance(model, ModelShape) else model()[0]
    units = offload_units(
        module, blocks=find_repeated_blocks(module), world_size=args.world, mp_policy=_mp_policy(args)
    )
    capacity = args.device_memory_gib * 2**30 if args.device_memory_gib else result.device.capacity_bytes
    if args.device_memory_limit_gib is not None:
        limit = args.device_memory_limit_gib * 2**30
    elif capacity is not None:
        limit = (1.0 - args.margin) * capacity
    else:
        raise ValueError("--offload auto needs a device memory: --device-memory-limit-gib or --device-memory-gib")
    persistent = result.persistent
    transient = result.peak_bytes - persistent.params_bytes - persistent.optimizer_bytes
    plan = plan_offload(units, transient_bytes=transient, limit_bytes=limit)
    if plan is None:
        plan = OffloadPlan(tiers=tuple((unit.name, "all") for unit in units))
    strategy = ShardingStrategy.parse(args.strategy or "FULL_SHARD")
    return with_plan(
        result,
        plan,
        units=units,
        copy_fraction=copy_fraction(_mp_policy(args)),
        reshards=reshards(strategy, args.ac or "none"),
    )


def verdict_of(result: DryRunResult, args: argparse.Namespace) -> MemoryVerdict:
    """The fits verdict per the parsed `--device-memory-gib`, `--host-memory-gib` and `--margin`."""
    capacity = None if args.device_memory_gib is None else args.device_memory_gib * 2**30
    host = None if args.host_memory_gib is None else args.host_memory_gib * 2**30
    return memory_verdict(result, margin=args.margin, capacity_bytes=capacity, host_capacity_bytes=host)


def _verdict_table(verdict: MemoryVerdict) -> Table:
    style = {True: "green", False: "red", None: "yellow"}[verdict.fits]
    table = Table(title=f"[{style}]{verdict.line()}[/{style}]", show_header=True)
    table.add_column("peak memory per rank, by part")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    total = sum(verdict.parts.values()) or 1
    for part, nbytes in verdict.parts.items():
        table.add_row(part, _mib(nbytes), f"{100 * nbytes / total:.0f}%")
    return table


def _tables(result: DryRunResult, rows: int) -> list[Table]:
    report, schedule, memory = result.report, result.report.schedule, result.report.memory
    summary = Table(title="simplefsdp inspect: dry run", show_header=False)
    summary.add_row(
        "model",
        f"{result.model} ({sum(p.numel() for p in report.capture.model.parameters()) / 1e6:,.1f}M parameters traced)",
    )
    dp = result.world_size // result.tp
    layout = f"{dp} data x {result.tp} tensor parallel" if result.tp > 1 else "data parallel"
    summary.add_row("world / device", f"{result.world_size} ranks ({layout}), {result.device.name}")
    summary.add_row("activation checkpointing", result.ac)
    summary.add_row(
        "traced",
        "in full"
        if not result.extrapolated
        else f"{result.traced_blocks[0]} and {result.traced_blocks[1]} of {result.n_layers} blocks; "
        "numbers below the tables are extrapolated per block, tables show the last trace",
    )
    summary.add_row("step time", f"{result.step_s * 1e3:,.3f} ms")
    if result.tokens_per_s is not None:
        per_device = result.tokens_per_s / result.world_size
        summary.add_row("tokens / s", f"{result.tokens_per_s:,.0f} ({per_device:,.0f} per device)")
    summary.add_row("exposed communication", f"{result.exposed_pct:.1f}% ({result.exposed_s * 1e3:,.3f} ms)")
    summary.add_row("peak memory / rank", _mib(result.peak_bytes))
    if result.offload != "none":
        summary.add_row(f"offload {result.offload}: host memory / rank", _mib(result.host_bytes))

    buckets = Table(title="buckets (one row per collective, launch order)")
    for column in ("id", "phase", "collective", "modules", "params", "elements", "bytes", "dtype", "group"):
        buckets.add_column(column, justify="right" if column in ("id", "params", "elements", "bytes") else "left")
    for row in report.buckets[:rows]:
        buckets.add_row(
            str(row.id),
            row.phase,
            row.collective,
            module_summary(row.modules),
            str(len(row.parameters)),
            f"{row.numel:,}",
            _mib(row.nbytes),
            str(row.dtype).removeprefix("torch."),
            str(row.group_size),
        )

    timing = Table(title=f"schedule on {schedule.device.name} (cost model)")
    for column in ("collective", "launched before", "waited before", "comm ms", "overlap ms", "exposed ms", "status"):
        timing.add_column(column)
    for event in schedule.comm[:rows]:
        style = {"exposed": "red", "partly exposed": "yellow"}.get(event.status, "green")
        timing.add_row(
            f"{event.phase[:3]} {event.collective}",
            event.launched_before,
            event.waited_before,
            f"{event.duration_s * 1e3:.3f}",
            f"{event.compute_between_s * 1e3:.3f}",
            f"{event.exposed_s * 1e3:.3f}",
            f"[{style}]{event.status}[/{style}]",
        )

    mem = Table(title="memory per rank (traced model)", show_header=False)
    mem.add_row("sharded parameters", _mib(memory.params_bytes))
    mem.add_row("sharded gradients", _mib(memory.grads_bytes))
    mem.add_row("optimizer state", _mib(memory.optimizer_bytes))
    mem.add_row("activations saved for backward", _mib(memory.activations_bytes))
    mem.add_row("max in-flight gathered / comm buffers", _mib(memory.max_in_flight_bytes))
    mem.add_row("forward peak (transient)", _mib(memory.forward.peak_bytes))
    mem.add_row("backward peak (transient, incl. gradients)", _mib(memory.backward.peak_bytes))
    mem.add_row("peak", _mib(memory.peak_bytes))
    return [summary, buckets, timing, mem]


def _mp_policy(args: argparse.Namespace) -> simplefsdp.MixedPrecisionPolicy:
    return simplefsdp.MixedPrecisionPolicy(
        param_dtype=_DTYPES[args.param_dtype], reduce_dtype=_DTYPES[args.reduce_dtype]
    )


def _advise(args: argparse.Namespace, console: Console) -> int:
    from simplefsdp.inspect.advice_view import run_advise, show_advice

    if args.code:
        raise ValueError("--advise traces on the meta device; --code is for a single dry run")
    fixed = {"--plan": args.plan, "--memory-budget": args.memory_budget, "--max-in-flight-gib": args.max_in_flight_gib}
    if args.offload == "auto":
        raise ValueError("--advise searches the offload tiers itself; --offload auto plans one dry run")
    if args.advise_toml and ":" in args.model:
        raise ValueError("--advise-toml writes a `simplefsdp train` run of a named shape; a factory's model has none")
    given = [flag for flag, value in fixed.items() if value is not None]
    if given:
        raise ValueError(f"--advise searches the bucket plans and prefetch depths itself; drop {', '.join(given)}")
    model = _model(args)
    advice = run_advise(args, model=model, mp_policy=_mp_policy(args))
    show_advice(advice, args, console, shape=model if isinstance(model, ModelShape) else None)
    return 0


def _check(args: argparse.Namespace) -> None:
    """What the flags' types do not check, before any work."""
    for flag in ("device_memory_gib", "host_memory_gib", "device_memory_limit_gib"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if not 0.0 <= args.margin < 1.0:
        raise ValueError(f"--margin must be in [0, 1), got {args.margin}")
    if args.out is not None:
        check_directory(args.out, name="--out")
    if args.advise_toml is not None:
        if not args.advise:
            raise ValueError("--advise-toml writes what --advise advises: give --advise")
        check_file(args.advise_toml, name="--advise-toml")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a bad flag or model, or a dry run that failed (one line on stderr)."""
    parser = _Parser(prog="simplefsdp inspect", description=__doc__.split("\n")[0])
    add_arguments(parser)
    console = Console()
    try:
        args = parser.parse_args(argv)
        _check(args)
        if args.advise:
            return _advise(args, console)
        result = run(args)
        verdict = verdict_of(result, args)
    except (ValueError, RuntimeError) as error:
        print(f"simplefsdp inspect: error: {error}", file=sys.stderr)
        return 2
    for table in _tables(result, args.rows):
        console.print(table)
    console.print(_verdict_table(verdict))
    note = builtin_profile_note(result.device)
    if note:
        console.print(f"[yellow]{note}[/yellow]")
    if args.out:
        written = result.report.save(args.out)
        console.print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0
