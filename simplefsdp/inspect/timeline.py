"""Timeline pictures of a simulated step: a compute lane and a communication lane per process group.

Forward and backward share one time axis (the backward starts where the forward ends). Compute
spans are coloured per module group and labelled when wide enough; collectives are coloured by
kind; communication the compute had to wait for is red, on both lanes: the stall on the compute
lane, the last `exposed_s` of the collective on its lane
(or all of it, when the compute also waited for it to get its turn on the stream). Two formats with the same content:
a PNG (matplotlib, Agg backend, no display needed) and a self-contained HTML file (inline SVG,
hover for details, no scripts or external files).
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path

from simplefsdp.inspect.schedule import StepSchedule

__all__ = ["Bar", "lanes", "save_html", "save_png"]

EXPOSED = "#d62728"
_COMPUTE = ("#4c78a8", "#72a1cf")
_COMM = {"all_gather": "#59a14f", "reduce_scatter": "#f28e2b", "all_reduce": "#b07aa1"}


@dataclasses.dataclass(frozen=True)
class Bar:
    start_s: float
    end_s: float
    color: str
    label: str  # drawn inside when it fits
    detail: str  # hover text


def lanes(schedule: StepSchedule) -> dict[str, list[Bar]]:
    """Lane name -> bars, in drawing order (exposed parts drawn over their bars)."""
    compute: list[Bar] = []
    comm: dict[str, list[Bar]] = {}
    for phase in (schedule.forward, schedule.backward):
        for i, span in enumerate(phase.compute):
            ms = (span.end_s - span.start_s) * 1e3
            detail = f"{phase.phase}: {span.label}, {ms:.3f} ms"
            compute.append(Bar(span.start_s, span.end_s, _COMPUTE[i % 2], span.label, detail))
        for start, end in phase.stalls:
            detail = f"{phase.phase}: compute waits {(end - start) * 1e3:.3f} ms for communication"
            compute.append(Bar(start, end, EXPOSED, "", detail))
        for event in phase.comm:
            lane = comm.setdefault(event.lane, [])
            detail = (
                f"{event.phase} {event.collective} {event.name}: {event.nbytes / 2**20:.2f} MiB, "
                f"{event.duration_s * 1e3:.3f} ms, exposed {event.exposed_s * 1e3:.3f} ms ({event.status})"
            )
            lane.append(Bar(event.start_s, event.end_s, _COMM[event.collective], event.collective[:2].upper(), detail))
            if event.exposed_s > 0:
                exposed_from = max(event.start_s, event.end_s - event.exposed_s)  # the rest was queueing
                lane.append(Bar(exposed_from, event.end_s, EXPOSED, "", detail + " [exposed]"))
    named = {"compute": compute}
    for group, bars in sorted(comm.items()):
        named[f"comm (group {group})" if len(comm) > 1 else "comm"] = bars
    return named


def _title(schedule: StepSchedule) -> str:
    return (
        f"{schedule.device.name}: step {schedule.step_s * 1e3:.2f} ms (forward {schedule.forward.end_s * 1e3:.2f} ms, "
        f"then backward), exposed communication {schedule.exposed_pct:.1f}% (red)"
    )


def save_png(schedule: StepSchedule, path: str | Path) -> Path:
    """Draw the lanes with matplotlib into `path` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    rows = lanes(schedule)
    figure, axes = plt.subplots(figsize=(14, 1.2 + 0.9 * len(rows)))
    try:
        scale = 1e3  # ms
        for y, bars in enumerate(reversed(list(rows.values()))):
            for bar in bars:
                width = (bar.end_s - bar.start_s) * scale
                axes.broken_barh([(bar.start_s * scale, width)], (y - 0.4, 0.8), facecolors=bar.color)
        axes.set_yticks(range(len(rows)), list(reversed(list(rows))))
        axes.axvline(schedule.forward.end_s * scale, color="black", linewidth=0.8, linestyle="--")
        axes.set_xlabel("time (ms); dashed line: forward | backward")
        axes.set_title(_title(schedule), fontsize=10)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
    return Path(path)


def save_html(schedule: StepSchedule, path: str | Path) -> Path:
    """Write a self-contained HTML page (inline SVG) with the same lanes into `path`; returns the path."""
    rows = lanes(schedule)
    width, lane_h, left, total = 1400, 36, 170, schedule.step_s or 1.0

    def x(seconds: float) -> float:
        return left + (width - left - 10) * seconds / total

    parts = []
    for row, (name, bars) in enumerate(rows.items()):
        y = 10 + row * (lane_h + 8)
        parts.append(f'<text x="4" y="{y + lane_h / 2 + 4}" class="lane">{html.escape(name)}</text>')
        for bar in bars:
            x0, x1 = x(bar.start_s), x(bar.end_s)
            parts.append(
                f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.5):.2f}" height="{lane_h}" fill="{bar.color}">'
                f"<title>{html.escape(bar.detail)}</title></rect>"
            )
            if bar.label and x1 - x0 > 7 * len(bar.label):
                parts.append(
                    f'<text x="{x0 + 3:.2f}" y="{y + lane_h / 2 + 4}" class="bar">{html.escape(bar.label)}</text>'
                )
    boundary = x(schedule.forward.end_s)
    height = 20 + len(rows) * (lane_h + 8)
    parts.append(f'<line x1="{boundary:.2f}" x2="{boundary:.2f}" y1="0" y2="{height}" class="phase"/>')
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>simplefsdp timeline</title>
<style>body{{font-family:sans-serif}} .lane{{font-size:13px}} .bar{{font-size:11px;fill:white}}
.phase{{stroke:black;stroke-dasharray:4}}</style></head>
<body><h3>{html.escape(_title(schedule))}</h3>
<p>Lanes: compute and communication (one per process group). Hover a bar for details; red: exposed
communication. Dashed line: forward | backward. Total {schedule.step_s * 1e3:.3f} ms
(optimizer {schedule.optimizer_s * 1e3:.3f} ms at the end).</p>
<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">
{chr(10).join(parts)}
</svg></body></html>
"""
    Path(path).write_text(page)
    return Path(path)
