"""`simplefsdp inspect --advise`: run the advisor from parsed flags and show its ranking and winner."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import simplefsdp
from simplefsdp.inspect.advise import Advice, Choice, Row, advise
from simplefsdp.inspect.advised_run import run_settings, torchrun_command, train_command, write_toml
from simplefsdp.inspect.cli import LOSSY_ADVICE
from simplefsdp.inspect.dryrun import AC_POLICIES
from simplefsdp.inspect.report import builtin_profile_note
from simplefsdp.inspect.shapes import ModelShape
from simplefsdp.inspect.tables import Column, table

__all__ = ["advice_json", "run_advise", "show_advice"]

GIB = 2**30


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def _verdict_cell(row: Row) -> str:
    verdict = row.verdict
    if row.pruned:
        return "[red]no (bound, not traced)[/red]"
    if row.steady is False:
        return "[yellow]unsteady extrapolation (not ranked)[/yellow]"
    if row.steady is None and verdict.fits:  # [Note: checking only what can win] in advise.py
        return "[green]fits[/green], not checked (cannot win)"
    if verdict.fits:
        return "[green]fits[/green]"
    if verdict.host_fits is False:
        return "[red]host memory too small[/red]"
    if verdict.headroom_bytes >= 0:
        return "[yellow]only without the margin[/yellow]"
    return f"[red]over by {_size(-verdict.headroom_bytes)}[/red]"


def _offload_cell(row: Row) -> str:
    """The tier, with the bytes per rank it puts in host memory."""
    if row.choice.offload == "none":
        return "none"
    host = "" if row.result is None else f" ({_size(row.result.host_bytes)} host)"
    return f"{row.choice.offload}{host}"


def ranking_table(advice: Advice, *, rows: int, wide: bool = False) -> Table:
    """The ranked configurations; `wide`: every column (else MFU and exposed communication are left
    out); a gather column where the search had quantized gathers in it."""
    capacity = f"{_size(advice.capacity_bytes)}, margin {advice.margin:.0%}"
    lossy = any(row.choice.gather_dtype is not None for row in advice.rows)
    columns = [
        Column("#", right=True),
        Column("strategy"),
        Column("AC"),
        Column("TP", right=True),
        Column("plan", wrap=True),
        Column("offload", wrap=True),
        *([Column("gather", wrap=True)] if lossy else []),
        Column("step ms", right=True, wide=True),
        Column("tokens/s/GPU", right=True),
        Column("MFU", wide=True),
        Column("peak / rank"),
        Column("exposed", wide=True),
        Column("", wrap=True),
    ]
    cells = []
    for i, row in enumerate(advice.rows[:rows], 1):
        choice, result = row.choice, row.result
        if result is None:
            numbers = ["-", "-", "-", f">= {_size(row.bound_bytes)}", "-"]
        else:
            per_gpu = "-" if result.tokens_per_s is None else f"{result.tokens_per_s / advice.world_size:,.0f}"
            numbers = [
                f"{result.step_s * 1e3:,.1f}",
                per_gpu,
                "-" if row.mfu is None else f"{row.mfu:.0%}",
                _size(result.peak_bytes),
                f"{result.exposed_pct:.0f}%",
            ]
        cells.append(
            (
                str(i),
                choice.strategy.value,
                choice.ac,
                str(choice.tp),
                choice.plan_label(),
                _offload_cell(row),
                *([choice.gather_dtype or "-"] if lossy else []),
                *numbers,
                _verdict_cell(row),
            )
        )
    return table(
        f"advise: {advice.model} at world {advice.world_size} on {advice.device.name} ({capacity}); "
        f"{len(advice.rows)} configurations, {advice.traces} traced, {advice.search_s:.0f} s",
        columns,
        cells,
        wide=wide,
    )


def show_advice(advice: Advice, args: argparse.Namespace, console: Console, *, shape: ModelShape | None) -> None:
    """The ranking, then the winner's run -- for a named `shape`: the `simplefsdp train` command and
    its torchrun line (`advised_run.py`), and with `--advise-toml` the file -- and wrap call, or what
    came closest."""
    console.print(ranking_table(advice, rows=args.rows, wide=args.wide))
    note = builtin_profile_note(advice.device)
    if note:
        console.print(f"[yellow]{note}[/yellow]")
    winner = advice.winner
    if winner is None:
        traced = [row for row in advice.rows if not row.pruned] or list(advice.rows)
        closest = min(traced, key=lambda row: row.verdict.peak_bytes)
        console.print(
            f"[red]nothing fits[/red] on {advice.device.name} ({_size(advice.capacity_bytes)} with a "
            f"{advice.margin:.0%} margin); the smallest peak is {_size(closest.verdict.peak_bytes)} "
            f"({closest.choice.label()}): more ranks, a larger --tp, or a smaller --micro-batch / --seq"
        )
        unsure = [row for row in advice.rows if row.steady is False and row.verdict.fits]
        if unsure:
            console.print(
                f"{len(unsure)} configuration(s) fit by an unsteady extrapolation (e.g. {unsure[0].choice.label()}): "
                "dry-run one with a larger --max-traced-blocks to settle it"
            )
        return
    result = winner.result
    console.print(f"[green]run:[/green] {winner.choice.label()} -- {result.describe()}")
    if winner.choice.offload != "none":
        console.print(winner.verdict.line())
    param, reduce = args.param_dtype, args.reduce_dtype
    if shape is not None:
        _show_run(winner, args, console, shape=shape)
    console.print(
        winner.choice.wrap_call(
            param_dtype=param, reduce_dtype=reduce, profile=args.device, shard_size=args.shard_size
        ),
        soft_wrap=True,
        highlight=False,
    )
    if advice.lossy is not None:
        _show_lossy(advice.lossy, winner, args, console, shape=shape)


def _show_lossy(
    lossy: Row, winner: Row, args: argparse.Namespace, console: Console, *, shape: ModelShape | None
) -> None:
    """The winner re-evaluated with quantized gathers ([Note: lossy gathers, on request] in
    `advise.py`): apart from the advice, with what it would change and the command that runs it."""
    result = lossy.result
    fits = "fits" if lossy.verdict.fits else "[red]does not fit[/red]"
    console.print(
        f"[yellow]lossy alternative[/yellow] (the model computes with rounded weights): {lossy.choice.label()} -- "
        f"{result.step_s / winner.result.step_s:.2f}x the step time, peak {_size(result.peak_bytes)}, {fits}; "
        "--advise-lossy search lets the search choose it",
        soft_wrap=True,
    )
    if shape is not None:
        console.print(train_command(_settings(lossy.choice, args, shape=shape)), soft_wrap=True, highlight=False)


def _settings(choice: Choice, args: argparse.Namespace, *, shape: ModelShape) -> dict:
    """The `simplefsdp train` settings of `choice` for a named shape, with the flags' dtypes and sizes."""
    return run_settings(
        choice,
        shape=shape,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        batch=args.batch or shape.batch,
        seq=args.seq or shape.seq,
        profile=args.device,
        shard_size=args.shard_size,
        world_size=args.world,
    )


def _show_run(winner: Row, args: argparse.Namespace, console: Console, *, shape: ModelShape) -> None:
    """The advised `simplefsdp train` run of a named shape: the command (this machine's ranks), the
    torchrun line for the advised world, and with `--advise-toml` the file both can read."""
    settings = _settings(winner.choice, args, shape=shape)
    console.print(train_command(settings), soft_wrap=True, highlight=False)
    toml = None
    if args.advise_toml:
        toml = str(write_toml(settings, args.advise_toml))
        console.print(f"wrote {toml}: simplefsdp train --config {toml}", soft_wrap=True, highlight=False)
    console.print(torchrun_command(settings, world_size=args.world, config=toml), soft_wrap=True, highlight=False)


def advice_json(advice: Advice) -> dict:
    """The ranking as plain data (what `--out` writes)."""

    def row(r: Row) -> dict:
        out = {
            "strategy": r.choice.strategy.value,
            "ac": r.choice.ac,
            "tp": r.choice.tp,
            "plan": r.choice.plan,
            "prefetch_depth": r.choice.prefetch_depth,
            "memory_budget": r.choice.memory_budget,
            "offload": r.choice.offload,
            "gather_dtype": r.choice.gather_dtype,  # None: in the param dtype
            "host_bytes": r.verdict.host_bytes,
            "fits": r.fits,
            "peak_bytes": r.verdict.peak_bytes,
            "pruned_by_bound": r.pruned,
            "steady": r.steady,  # None: not checked (nothing of its configuration fits)
        }
        if r.result is not None:
            out |= {"step_s": r.result.step_s, "exposed_s": r.result.exposed_s, "tokens_per_s": r.result.tokens_per_s}
            out |= {"mfu": r.mfu, "parts": r.verdict.parts}
        return out

    return {
        "model": advice.model,
        "world_size": advice.world_size,
        "device": advice.device.name,
        "capacity_bytes": advice.capacity_bytes,
        "margin": advice.margin,
        "rows": [row(r) for r in advice.rows],
        "lossy_alternative": None if advice.lossy is None else row(advice.lossy),
    }


LOSSY_CODE = "int8"  # the code type of --advise-lossy's gathers unless --gather-dtype names one


def _gathers(args: argparse.Namespace, mp_policy: simplefsdp.MixedPrecisionPolicy) -> dict:
    """`advise`'s gather arguments per `--advise-lossy` ([Note: lossy gathers, on request]): "search"
    searches quantized gathers beside gathers in the param dtype; "alternative" (the default) keeps
    the search in the policy's gather dtype and, where that is the param dtype, prices the winner
    with quantized gathers beside the advice; "none" only keeps the search in the policy's."""
    code = mp_policy.gather_dtype or LOSSY_CODE
    mode = args.advise_lossy or LOSSY_ADVICE[0]
    if mode == "search":
        return {"gathers": (None, code), "lossy_alternative": None}
    alternative = mode == "alternative" and mp_policy.gather_dtype is None
    return {"gathers": None, "lossy_alternative": code if alternative else None}


def run_advise(args: argparse.Namespace, *, model, mp_policy: simplefsdp.MixedPrecisionPolicy) -> Advice:
    """The advisor per the parsed flags, its progress on stderr: a live line on a terminal, else a
    line per finished task (so a piped or logged run still shows it is working)."""
    capacity = None if args.device_memory_gib is None else args.device_memory_gib * 2**30
    host = None if args.host_memory_gib is None else args.host_memory_gib * 2**30
    console = Console(stderr=True)
    live = console.is_terminal  # rich's live line; elsewhere it would print nothing until the end
    bar = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    )
    with bar if live else contextlib.nullcontext():
        task = bar.add_task("advise: starting", total=None)
        started = time.perf_counter()

        def progress(label: str) -> None:
            if live:
                bar.update(task, description=f"advise: {label}")
            else:
                print(f"advise: {label} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)

        advice = advise(
            model,
            world_size=args.world,
            device=args.device,
            tp=args.tp,
            ac=(args.ac,) if args.ac else AC_POLICIES,
            strategies=None if args.strategy is None else (args.strategy,),
            shard_size=args.shard_size,
            mp_policy=mp_policy,
            batch=args.batch,
            seq=args.seq,
            optimizer=args.optimizer,
            margin=args.margin,
            capacity_bytes=capacity,
            max_traced_blocks=args.max_traced_blocks,
            jobs=args.jobs,
            offload=None if args.offload is None else (args.offload,),
            host_capacity_bytes=host,
            on_progress=progress,
            **_gathers(args, mp_policy),
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "advice.json").write_text(json.dumps(advice_json(advice), indent=1))
    return advice
