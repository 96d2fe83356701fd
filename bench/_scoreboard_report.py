"""The scoreboard's outputs: the setup line, the targets, the markdown table and the plot."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["OURS", "PREDICTION_TOLERANCE", "bf16_units", "describe_setup", "markdown", "plot", "targets"]

OURS = "ours"  # simplefsdp compiled with its passes, default plan
SGO_AUTO = "SHARD_GRAD_OP, auto plan"  # the SHARD_GRAD_OP targets met by the auto plan instead of the default
INT8 = "FULL_SHARD, int8 gathers"  # the targets of the quantized gathers (bf16 policy, block 128)
PREDICTION_TOLERANCE = {"step": 0.15, "peak": 0.10}  # |predicted / measured - 1| at most


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_units() -> dict[str, Any]:
    """Whether this host has bf16 matmul units: the CPU's bf16 instruction flags (None on a GPU)."""
    if torch.cuda.is_available():
        return {"cpu_bf16_flags": None}
    return {"cpu_bf16_flags": sorted(f for f in _cpu_flags() if "bf16" in f)}


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


def describe_setup(args: argparse.Namespace, world: int, *, precisions: set[str]) -> dict[str, Any]:
    """The run's setup (its `summary` is the line above the table); `precisions`: the rows' ("fp32",
    "bf16")."""
    summary = (
        f"{world} {args.backend} ranks on {_machine()}; Llama-style model, {args.layers} blocks, dim {args.dim}, "
        f"vocab {args.vocab}, batch {args.batch}x{args.seq} per rank, {_precisions(precisions)}, AdamW; "
        f"median of {args.steps} steps after {args.warmup} warm-up; inductor buffer reuse "
        f"{'on' if args.buffer_reuse else 'off'} in every compiled row; torch {torch.__version__}"
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
        "buffer_reuse": args.buffer_reuse,
    }


def _precisions(precisions: set[str]) -> str:
    """The mixed precision of the run's rows ("fp32" / "bf16"), for the setup line."""
    policy = "bf16 parameters in compute, fp32 masters and gradient reductions"
    if "bf16" not in precisions:
        return "fp32"
    return f"bf16 rows: {policy}" if precisions == {"bf16"} else f"fp32, and the bf16 rows: {policy}"


def _ratio_target(rows: dict, what: str, key: str, baseline: str, metric: str, op: str, bound: float) -> dict | None:
    if key not in rows or baseline not in rows:
        return None
    base = rows[baseline][metric]
    ratio = rows[key][metric] / base if base else float("inf")  # a baseline of 0 (nothing gathered) meets nothing
    met = ratio >= bound if op == ">=" else ratio <= bound
    return {
        "target": f"{what}: {metric} / {rows[baseline]['label']} {op} {bound}",
        "ratio": ratio,
        "met": met,
        "missed_by_pct": 0.0 if met else 100.0 * abs(ratio - bound) / bound,
    }


def _auto_at_same_memory(rows: dict, *, default: str, autos: list[str], what: str) -> dict | None:
    """The fastest of the auto-plan rows `autos` (calibrated profile) whose peak is at most the
    default plan's (row `default`), against it."""
    autos = [rows[k] for k in autos if k in rows]
    if default not in rows or not autos:
        return None
    fits = [r for r in autos if r["peak_memory_bytes"] <= rows[default]["peak_memory_bytes"]]
    best = max(fits, key=lambda r: r["tokens_per_s"]) if fits else None
    ratio = best["tokens_per_s"] / rows[default]["tokens_per_s"] if best else 0.0
    return {
        "target": f"{what} (calibrated profile): tokens_per_s / default plan >= 1.0 at no more peak memory"
        + (f" (best: {best['label']})" if best else " (no auto row fits the default plan's memory)"),
        "ratio": ratio,
        "met": ratio >= 1.0,
        "missed_by_pct": 0.0 if ratio >= 1.0 else 100.0 * (1.0 - ratio),
    }


def _full_shard_targets(rows: dict, what: str, ours: str, precision: str = "") -> list[dict | None]:
    """The FULL_SHARD targets of row `ours` against the baselines of its precision (`precision`: the
    suffix of their keys, "" for fp32)."""
    return [
        _ratio_target(rows, what, ours, f"fsdp2{precision}", "tokens_per_s", ">=", 1.5),
        _ratio_target(rows, what, ours, f"fsdp2{precision}", "peak_memory_bytes", "<=", 0.8),
        _ratio_target(rows, what, ours, f"fsdp2-compile{precision}", "tokens_per_s", ">=", 1.0),
        _ratio_target(rows, what, ours, f"torch-passes{precision}", "tokens_per_s", ">=", 1.0),
    ]


def _prediction(rows: dict, what: str, predicted: str, measured: str) -> dict | None:
    errors = {r["label"]: r[predicted] / r[measured] - 1.0 for r in rows.values() if r.get(predicted) is not None}
    if not errors:
        return None
    worst_label, worst = max(errors.items(), key=lambda item: abs(item[1]))
    bound = PREDICTION_TOLERANCE[what]
    met = abs(worst) <= bound
    return {
        "target": f"predicted {what} within +-{bound:.0%} of measured, every simplefsdp row (worst: {worst_label})",
        "ratio": 1.0 + worst,
        "met": met,
        "missed_by_pct": 0.0 if met else 100.0 * (abs(worst) - bound),
    }


def targets(rows: dict[str, dict]) -> list[dict[str, Any]]:
    """Each target whose rows ran: the ratio, met or not, and by how much it is missed."""
    frontier = [k for k in rows if k.startswith("auto@")]
    found = [
        *_full_shard_targets(rows, "FULL_SHARD default", OURS),
        _ratio_target(rows, "SHARD_GRAD_OP", "ours-zero2", "torch-passes-zero2", "tokens_per_s", ">=", 1.05),
        _ratio_target(rows, "SHARD_GRAD_OP", "ours-zero2", "torch-passes-zero2", "peak_memory_bytes", "<=", 1.0),
        _ratio_target(rows, SGO_AUTO, "ours-zero2-auto", "torch-passes-zero2", "tokens_per_s", ">=", 1.05),
        _ratio_target(rows, SGO_AUTO, "ours-zero2-auto", "torch-passes-zero2", "peak_memory_bytes", "<=", 1.0),
        _auto_at_same_memory(rows, default=OURS, autos=["ours-auto", *frontier], what="auto plan"),
        *_full_shard_targets(rows, "FULL_SHARD default, bf16", "ours-bf16", "-bf16"),
        _auto_at_same_memory(rows, default="ours-bf16", autos=["ours-auto-bf16"], what="auto plan, bf16"),
        # the target for quantized gathers: both rows under the bf16 policy
        _ratio_target(rows, INT8, "ours-int8", "fsdp2-bf16", "tokens_per_s", ">=", 1.5),
        _ratio_target(rows, INT8, "ours-int8", "fsdp2-bf16", "peak_memory_bytes", "<=", 0.8),
        # int8 codes are half of bf16's bytes, plus one fp32 scale per 128 elements: 0.5 + 4 / 256
        _ratio_target(rows, INT8, "ours-int8", "ours-bf16", "gathered_bytes_per_step", "<=", 0.55),
        _prediction(rows, "step", "predicted_step_s", "step_time_s"),
        _prediction(rows, "peak", "predicted_peak_bytes", "peak_memory_bytes"),
    ]
    return [t for t in found if t is not None]


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _resident(row: dict) -> str:
    resident = row.get("resident_peak_bytes")  # CPU runs only (see scoreboard.py's [Note: peak memory])
    return "-" if resident is None else _mib(resident)


def _predicted(row: dict) -> str:
    if row.get("predicted_step_s") is None:
        return "- | -"
    return f"{row['predicted_step_s'] * 1e3:.1f} ms | {_mib(row['predicted_peak_bytes'])}"


def _host_speed_counts(rows: dict, host: dict) -> str:
    """How many step predictions land within the tolerance as made, and how many would once each is
    scaled by the host's speed ratio (probe beside the rows / probe at calibration): a diagnostic that
    tells a model error from a host that changed speed; the targets count the predictions as made."""
    made = [(r["predicted_step_s"], r["step_time_s"]) for r in rows.values() if r.get("predicted_step_s") is not None]
    if not made:
        return ""
    scale = host["rows_matmul_s"] / host["calibration_matmul_s"]
    bound = PREDICTION_TOLERANCE["step"]
    raw = sum(abs(p / m - 1.0) <= bound for p, m in made)
    scaled = sum(abs(scale * p / m - 1.0) <= bound for p, m in made)
    return (
        f" Step predictions within +-{bound:.0%}: {raw} of {len(made)} as made; {scaled} of {len(made)} "
        f"if each were scaled by that speed ({scale:.2f}x; a diagnostic, the targets count them as made)."
    )


# The baselines each row is compared with, by strategy: FSDP2 eager, then the strongest like-for-like
# ones -- FSDP2 with each block compiled, and torch's own passes on simplefsdp's front end
BASELINES = {
    "FULL_SHARD": (("FSDP2 eager", "fsdp2"), ("FSDP2 + compile", "fsdp2-compile"), ("torch's passes", "torch-passes")),
    "SHARD_GRAD_OP": (
        ("FSDP2 eager", "fsdp2-zero2"),
        ("FSDP2 + compile", "fsdp2-compile-zero2"),
        ("torch's passes", "torch-passes-zero2"),
    ),
}
TWIN = "~reuse-"  # scoreboard.py's suffix of a row compiled with buffer reuse forced


def _versus(rows: dict, key: str, baseline: str) -> str:
    """Speed / memory of row `key` against `baseline` of the same precision (a bf16 row against the
    baseline's bf16 row, `baseline-bf16`) and buffer-reuse setting (a twin row against the baseline's
    twin when it ran), as "1.28x / 0.90x"; "-" if absent or the row itself."""
    precision = rows[key].get("precision", "fp32")
    baseline += "" if precision == "fp32" else f"-{precision}"
    twin = key[key.index(TWIN) :] if TWIN in key else ""
    other = rows.get(baseline + twin, rows.get(baseline))
    if other is None or other is rows[key]:
        return "-"
    row = rows[key]
    speed = row["tokens_per_s"] / other["tokens_per_s"]
    return f"{speed:.2f}x / {row['peak_memory_bytes'] / other['peak_memory_bytes']:.2f}x"


def _bf16_line(matmuls: dict | None) -> list[str]:
    """What bf16 compute costs on this host against fp32 ([Note: bf16 compute here] in scoreboard.py)."""
    if not matmuls:
        return []
    ratio = matmuls["bf16_s"] / matmuls["fp32_s"]
    flags = matmuls.get("cpu_bf16_flags")
    units = "" if flags is None else f" (the CPU's bf16 flags: {', '.join(flags) or 'none'})"
    verdict = (
        "bf16 matmuls ran slower than fp32 on this host: the bf16 rows pay for their halved gathers with slower "
        "compute, and the fp32 rows are the comparison in fp32 compute"
        if ratio > 1.0
        else "bf16 matmuls were not slower than fp32 on this host"
    )
    return [
        f"bf16 compute: the model's matmuls (one block's linear layers and the output layer, at its shapes) took "
        f"{matmuls['bf16_s'] * 1e3:.2f} ms in bf16 and {matmuls['fp32_s'] * 1e3:.2f} ms in fp32 beside the rows' "
        f"steps (median), {ratio:.2f}x{units}: {verdict}.",
        "",
    ]


def markdown(document: dict[str, Any]) -> str:
    rows = document["rows"]
    lines = [f"{document['setup']['summary']} ({document['setup']['date']})", ""]
    load = document["setup"].get("load_average_1min")
    if load:  # other jobs share the host: what they left of it moves every row's time
        lines += [f"Host load (1-minute average): {load['start']:.1f} at the start, {load['end']:.1f} at the end.", ""]
    host = document["setup"].get("host_probe")
    if host:  # [Note: the host's speed, twice] in scoreboard.py
        lines += [
            f"Host speed: a {host['matmul_n']}^3 matmul took {host['calibration_matmul_s'] * 1e3:.1f} ms while the "
            f"profile was measured, {host['rows_matmul_s'] * 1e3:.1f} ms beside the rows' steps (median): the rows "
            f"ran at {host['calibration_matmul_s'] / host['rows_matmul_s']:.2f}x the calibrated host's speed."
            + _host_speed_counts(rows, host),
            "",
        ]
    lines += _bf16_line(document["setup"].get("bf16_matmuls"))
    names = [name for name, _ in BASELINES["FULL_SHARD"]]
    lines += [
        'Each "vs" column: tokens/s / peak memory against that baseline of the row\'s strategy and precision'
        " (1.20x / 0.90x: 1.2 times its speed at 0.9 times its memory). Gathered / step: bytes of the tensors"
        " the step's all-gathers gathered on a rank (profiler-recorded inputs x ranks; parameters only).",
        "",
        "| configuration | step time (median) | tokens/s | peak memory / rank | "
        + " | ".join(f"vs {name}" for name in names)
        + " | resident peak | compile | collectives / step | gathered / step | predicted step | predicted peak |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        compile_s = f"{row['compile_s']:.1f} s" if row["compile_s"] else "-"
        versus = [_versus(rows, key, baseline) for _, baseline in BASELINES.get(row["strategy"], ())]
        lines.append(
            f"| {row['label']} | {row['step_time_s'] * 1e3:.1f} ms | {row['tokens_per_s']:,.0f} | "
            f"{_mib(row['peak_memory_bytes'])} | {' | '.join(versus)} | {_resident(row)} | {compile_s} | "
            f"{row['collectives_per_step']} | {_mib(row['gathered_bytes_per_step'])} | {_predicted(row)} |"
        )
    if document["targets"]:
        lines += ["", "| target (ours = simplefsdp compiled, our passes) | ratio | met |", "|---|---|---|"]
        for t in document["targets"]:
            verdict = "yes" if t["met"] else f"no (missed by {t['missed_by_pct']:.1f}%)"
            lines.append(f"| {t['target']} | {t['ratio']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


# Where a label may sit, in points from its point, with its horizontal alignment: right of it, then
# below, left, above and below that, further out. The first that overlaps no label placed before wins.
_LABEL_SPOTS = (
    ((4, 3), "left"),
    ((4, -10), "left"),
    ((-4, 3), "right"),
    ((-4, -10), "right"),
    ((4, 12), "left"),
    ((4, -19), "left"),
    ((-4, 12), "right"),
    ((-4, -19), "right"),
)


def _place_labels(fig, ax, labels: list[tuple[str, tuple[float, float]]]) -> None:
    """Annotate each point with its label at the first spot of `_LABEL_SPOTS` whose text box overlaps
    no label placed before it (the first spot where every one does): deterministic, in `labels`
    order. Call once the axes' limits and layout are final: the boxes are measured on the canvas."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for text, xy in labels:
        for offset, align in _LABEL_SPOTS:
            note = ax.annotate(text, xy, fontsize=7, xytext=offset, textcoords="offset points", ha=align)
            box = note.get_window_extent(renderer).expanded(1.02, 1.15)
            if not any(box.overlaps(other) for other in placed):
                break
            note.remove()
        else:  # crowded everywhere: the first spot
            offset, align = _LABEL_SPOTS[0]
            note = ax.annotate(text, xy, fontsize=7, xytext=offset, textcoords="offset points", ha=align)
            box = note.get_window_extent(renderer)
        placed.append(box)


def plot(rows: dict[str, dict], path: Path, *, title: str, frontier_prefix: str) -> None:
    """Step time against peak memory per rank, one point per row; the auto plan's budgets as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    points = {key: (row["peak_memory_bytes"] / 2**20, row["step_time_s"] * 1e3) for key, row in rows.items()}
    for key, row in rows.items():
        marker = "s" if row.get("strategy") == "SHARD_GRAD_OP" else "^" if row.get("precision") == "bf16" else "o"
        ax.scatter(*points[key], marker=marker, color="tab:red" if key == "ours" else "tab:blue")
    frontier = sorted(
        (r for k, r in rows.items() if k.startswith(frontier_prefix) or k == "ours-auto"),
        key=lambda r: r["peak_memory_bytes"],
    )
    if len(frontier) > 1:
        ax.plot(
            [r["peak_memory_bytes"] / 2**20 for r in frontier],
            [r["step_time_s"] * 1e3 for r in frontier],
            color="tab:green",
            label="auto plan over memory budgets",
        )
        ax.legend(fontsize=8)
    ax.set_xlabel("peak memory per rank, MiB (lower is better; squares: SHARD_GRAD_OP; triangles: bf16)")
    ax.set_ylabel("step time, ms (lower is better)")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.margins(x=0.12, y=0.06)  # room for the labels of the outermost points
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())  # fixed from here: the labels are placed on the final canvas
    ax.set_ylim(ax.get_ylim())
    _place_labels(fig, ax, [(rows[key]["label"], points[key]) for key in rows])
    fig.savefig(path, dpi=120)
    plt.close(fig)
