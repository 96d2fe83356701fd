"""`simplefsdp inspect`: dry-run a model and show buckets, schedule, memory and a timeline.

    simplefsdp inspect llama3-70b --world 1024 --device h100 --out inspect-70b/
    simplefsdp inspect small-8 --world 8 --code --out inspect-small/   # also inductor's code (CPU)
    simplefsdp inspect mypkg.models:build --world 64                   # a factory -> (model, input)
    simplefsdp inspect llama3-405b --world 1024 --max-in-flight-gib 16  # let 6.4 GB blocks prefetch
    simplefsdp inspect llama3-70b --world 64 --tp 8 --ac full --device h100  # does it fit, and how fast?
    simplefsdp inspect llama3-70b --world 64 --device h100 --advise --tp 1,8  # what should I run?

The output is this command's product, so it prints (rich tables); the library logs. This module
parses the flags without torch; `from_flags.py` runs what they ask for; `dryrun_view.py` shows a
dry run, `advice_view.py` the advice, in tables that fit the terminal (`--wide`: every column).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from simplefsdp.inspect.tables import console
from simplefsdp.settings import (
    AC_POLICIES,
    DEFAULT_GATHER_BLOCK,
    DTYPES,
    QUANTIZED_GATHER_DTYPES,
    TIERS,
    check_gather_block,
    parse_memory_budget,
    profile_names,
)
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.writable import check_directory, check_file

__all__ = ["LOSSY_ADVICE", "add_arguments", "main"]

LOSSY_ADVICE = ("alternative", "search", "none")  # --advise-lossy: the first is the default


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="a shape, e.g. tiny, small-8, llama3-8b (an unknown name is answered with the list), "
        "or 'module:function' -> (model, example input)",
    )
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
        help=f"device profile: {', '.join(profile_names())}, or a file from `simplefsdp calibrate`",
    )
    parser.add_argument(
        "--strategy",
        default=None,
        help=f"{', '.join(ShardingStrategy.__members__)} (default FULL_SHARD; --advise: searches them unless given)",
    )
    parser.add_argument("--shard-size", type=int, default=None, help="ranks per shard group (HYBRID_* only)")
    parser.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16", help="all-gather / compute dtype")
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32", help="gradient reduction dtype")
    parser.add_argument(
        "--gather-dtype",
        choices=("none", *QUANTIZED_GATHER_DTYPES),
        default="none",
        help="parameters travel the all-gather as block-scaled codes of this type (lossy); none: in --param-dtype",
    )
    parser.add_argument(
        "--gather-block",
        type=_gather_block,
        default=DEFAULT_GATHER_BLOCK,
        help=f"--gather-dtype: elements per quantization block (default {DEFAULT_GATHER_BLOCK})",
    )
    parser.add_argument(
        "--advise-lossy",
        choices=LOSSY_ADVICE,
        default=None,
        help="--advise and quantized gathers (lossy): alternative (default) prices the winner with int8 gathers "
        "beside the advice; search also searches every configuration with them (int8, or --gather-dtype's) "
        "and lets them win; none leaves them out",
    )
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
    parser.add_argument(
        "--wide", action="store_true", help="every table column, each at its full width (default: fit the terminal)"
    )


def _gather_block(text: str) -> int:
    """An argparse type: a quantization block (`settings.check_gather_block`)."""
    try:
        block = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    try:
        check_gather_block(block)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return block


def _degrees(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or a comma-separated list such as 1,8; got {text!r}"
        ) from None
    return degrees


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
    if args.gather_dtype == "none" and args.gather_block != DEFAULT_GATHER_BLOCK:
        raise ValueError(f"--gather-block ({args.gather_block}) is for a quantized --gather-dtype; got none")
    if args.advise_lossy is not None and not args.advise:
        raise ValueError("--advise-lossy says what --advise does with quantized gathers: give --advise")
    if args.advise_toml is not None:
        if not args.advise:
            raise ValueError("--advise-toml writes what --advise advises: give --advise")
        check_file(args.advise_toml, name="--advise-toml")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a bad flag or model, or a dry run that failed (one line on stderr)."""
    parser = _Parser(prog="simplefsdp inspect", description=__doc__.split("\n")[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
        _check(args)
        out = console(wide=args.wide)
        # torch loads here, once the flags have parsed: the help and a bad flag answer at once
        from simplefsdp.inspect.dryrun_view import show
        from simplefsdp.inspect.from_flags import advise_command, run, verdict_of

        if args.advise:
            return advise_command(args, out)
        result = run(args)
        verdict = verdict_of(result, args)
    except (ValueError, RuntimeError) as error:
        print(f"simplefsdp inspect: error: {error}", file=sys.stderr)
        return 2
    show(result, verdict, args, out)
    if args.out:
        written = result.report.save(args.out)
        out.print(f"wrote {', '.join(str(p) for p in written.values())}")
    return 0
