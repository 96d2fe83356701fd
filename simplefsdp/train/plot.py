"""The loss curve of a `simplefsdp train` run folder, drawn from its `metrics.jsonl`.

    write_loss_curve(read_records(run / "metrics.jsonl"), run / "loss.png")

matplotlib is imported when a curve is drawn (not when training starts) and draws on its Agg canvas
through `matplotlib.figure.Figure`, never through pyplot: no window, no global figure state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["read_records", "write_loss_curve"]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The per-step records of a metrics file in step order, the newest of each step (a resumed run
    appends the steps after its checkpoint again); [] when there is no file."""
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "step" in record:
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def write_loss_curve(records: list[dict[str, Any]], path: Path) -> bool:
    """Draw the training loss per step (and the eval loss where records carry `eval_loss`) to the PNG
    `path`, replacing it whole; False (nothing written) when there is no record."""
    if not records:
        return False
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", linewidth=1.2)
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        axes.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss", markersize=3)
    axes.set(xlabel="step", ylabel="loss (cross-entropy)")
    axes.grid(alpha=0.3)
    axes.legend()
    partial = path.with_name(path.name + ".partial")
    figure.savefig(partial, format="png")
    os.replace(partial, path)  # a reader never sees half a picture
    return True
