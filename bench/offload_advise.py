"""What `simplefsdp inspect --advise` makes of a model that fits only by offloading to host memory.

    python bench/offload_advise.py                      # Llama-3-70B at world 8 on H100s, ~1 minute on 2 cores
    python bench/offload_advise.py --out bench/results  # also writes offload_advise.md

A dry run: the advisor traces on the meta device with a fake process group, so no GPU is needed;
the numbers are the built-in profile's predictions (datasheet figures and assumptions, each with
its source in `passes/profiles.toml`), not measurements. The record lists the best row of each
offload tier and the winner's `simplefsdp train` flags and `wrap(...)` call.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from _harness import record_header

from simplefsdp.inspect.advise import Advice, Row, advise
from simplefsdp.inspect.advised_run import run_settings, torchrun_command, train_command
from simplefsdp.inspect.shapes import model_shape

GIB = 2**30


def _row(row: Row) -> str:
    result, verdict = row.result, row.verdict
    if result is None:
        return f"| {row.choice.label()} | - | >= {row.bound_bytes / GIB:,.1f} GiB | - | no (bound) |"
    fits = "yes" if row.fits else ("no: host" if verdict.host_fits is False else "no")
    return (
        f"| {row.choice.label()} | {result.step_s:,.2f} s | {result.peak_bytes / GIB:,.1f} GiB "
        f"| {result.host_bytes / GIB:,.1f} GiB | {fits} |"
    )


def report(advice: Advice, *, model: str, header: str) -> str:
    best = {}
    for row in advice.rows:  # ranked: the first of each tier is its best
        best.setdefault(row.choice.offload, row)
    lines = [
        header,
        f"{advice.model} at world {advice.world_size} on {advice.device.name} "
        f"({advice.capacity_bytes / GIB:,.1f} GiB, margin {advice.margin:.0%}): {len(advice.rows)} configurations, "
        f"{advice.traces} traced, {advice.search_s:.0f} s. The best row of each offload tier:",
        "",
        "| configuration | step (predicted) | device peak / rank | host / rank | fits |",
        "|---|---|---|---|---|",
        *(_row(best[tier]) for tier in ("none", "optimizer", "all") if tier in best),
        "",
    ]
    winner = advice.winner
    if winner is None:
        lines.append("Nothing fits.")
    else:
        shape = model_shape(model)
        settings = run_settings(
            winner.choice,
            shape=shape,
            param_dtype="bf16",
            reduce_dtype="fp32",
            batch=shape.batch,
            seq=shape.seq,
            profile=advice.device.name,
            shard_size=None,
            world_size=advice.world_size,
        )
        call = winner.choice.wrap_call(
            param_dtype="bf16", reduce_dtype="fp32", profile=advice.device.name, shard_size=None
        )
        lines += [
            f"Advised: {winner.choice.label()}; {winner.verdict.line()}.",
            "",
            "```",
            train_command(settings),
            torchrun_command(settings, world_size=advice.world_size),
            "```",
            "",
            "```python",
            call,
            "```",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None, help="directory for offload_advise.md")
    args = parser.parse_args()
    header = record_header(
        "Advice that offloads: the advisor on a model that does not fit without it",
        host=f"{os.cpu_count()} CPU cores, no GPU (a dry run)",
        files="offload_advise.md",
    )
    advice = advise(args.model, world_size=args.world, device=args.device, jobs=args.jobs)
    text = report(advice, model=args.model, header=header)
    print(text)
    if args.out:
        Path(args.out, "offload_advise.md").write_text(text)


if __name__ == "__main__":
    main()
