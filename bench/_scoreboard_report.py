"""The scoreboard's outputs: the setup line, the targets, the markdown table and the plot."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["OURS", "TARGETS", "describe_setup", "markdown", "plot", "targets"]

OURS = "ours"  # simplefsdp compiled with its passes, default plan
# (baseline row, what is compared, at least / at most this ratio of ours to the baseline)
TARGETS = (
    ("fsdp2", "tokens_per_s", ">=", 1.5),
    ("fsdp2-compile", "tokens_per_s", ">=", 1.0),
    ("torch-passes", "tokens_per_s", ">=", 1.0),
    ("fsdp2", "peak_memory_bytes", "<=", 1.0),
)


def _machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({model})"


def describe_setup(args: argparse.Namespace, world: int) -> dict[str, Any]:
    summary = (
        f"{world} {args.backend} ranks on {_machine()}; Llama-style model, {args.layers} blocks, dim {args.dim}, "
        f"vocab {args.vocab}, batch {args.batch}x{args.seq} per rank, fp32, AdamW; "
        f"median of {args.steps} steps after {args.warmup} warm-up; torch {torch.__version__}"
    )
    return {
        "summary": summary,
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "world": world,
        "backend": args.backend,
        "torch": torch.__version__,
        "model": {k: getattr(args, k) for k in ("layers", "dim", "heads", "ffn", "vocab", "seq", "batch")},
        "warmup": args.warmup,
        "steps": args.steps,
    }


def targets(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """Each target whose rows ran: ours / baseline, met or not, and by how much it is missed."""
    found = []
    for baseline, metric, op, bound in TARGETS:
        if OURS not in rows or baseline not in rows:
            continue
        ratio = rows[OURS][metric] / rows[baseline][metric]
        met = ratio >= bound if op == ">=" else ratio <= bound
        found.append(
            {
                "target": f"{metric}: ours / {rows[baseline]['label']} {op} {bound}",
                "ratio": ratio,
                "met": met,
                "missed_by_pct": 0.0 if met else 100.0 * abs(ratio - bound) / bound,
            }
        )
    return found


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def markdown(document: dict[str, Any]) -> str:
    rows = document["rows"]
    base = rows.get("fsdp2", next(iter(rows.values())))
    lines = [
        f"{document['setup']['summary']} ({document['setup']['date']})",
        "",
        "| configuration | step time (median) | tokens/s | vs FSDP2 eager | peak memory / rank | compile "
        "| collectives / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        compile_s = f"{row['compile_s']:.1f} s" if row["compile_s"] else "-"
        lines.append(
            f"| {row['label']} | {row['step_time_s'] * 1e3:.1f} ms | {row['tokens_per_s']:,.0f} | "
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {_mib(row['peak_memory_bytes'])} | {compile_s} | "
            f"{row['collectives_per_step']} |"
        )
    if document["targets"]:
        lines += ["", "| target (ours = simplefsdp compiled, our passes) | ratio | met |", "|---|---|---|"]
        for t in document["targets"]:
            verdict = "yes" if t["met"] else f"no (missed by {t['missed_by_pct']:.1f}%)"
            lines.append(f"| {t['target']} | {t['ratio']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["label"] for row in rows.values()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(labels) + 1.8), sharey=True)
    left.barh(labels, [row["tokens_per_s"] for row in rows.values()], color="tab:blue")
    left.set_xlabel("tokens / s (higher is better)")
    right.barh(labels, [row["peak_memory_bytes"] / 2**20 for row in rows.values()], color="tab:orange")
    right.set_xlabel("peak memory per rank, MiB (lower is better)")
    left.invert_yaxis()
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
