"""bench/_scoreboard_report.py's host-speed line ([Note: the host's speed, twice] in bench/scoreboard.py),
its picture's labels, and the scoreboard's refusal of torch's passes on uneven shards before torch
2.13: pure functions on hand-made rows and models, no run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _scoreboard_report as report  # bench/ is not a package: its scripts import it the same way
import pytest
import scoreboard
import torch


def _row(label: str, measured_s: float, predicted_s: float | None) -> dict:
    return {
        "label": label,
        "strategy": "FULL_SHARD",
        "step_time_s": measured_s,
        "tokens_per_s": 1.0 / measured_s,
        "peak_memory_bytes": 2**20,
        "compile_s": 0.0,
        "collectives_per_step": 1,
        "predicted_step_s": predicted_s,
        "predicted_peak_bytes": None if predicted_s is None else 2**20,
    }


def test_host_speed_line_counts_predictions_as_made_and_scaled_by_the_host():
    # the host ran 1.25x slower beside the rows than while calibrating: 0.8x predictions miss as made
    rows = {
        "eager": _row("eager", 1.0, None),  # no prediction: not counted
        "a": _row("a", 1.0, 0.80),  # -20% as made; 1.00 scaled
        "b": _row("b", 1.0, 0.90),  # -10% as made; +12.5% scaled
        "c": _row("c", 1.0, 1.00),  # exact as made; +25% scaled
        "d": _row("d", 2.0, 1.64),  # -18% as made; +2.5% scaled
    }
    host = {"matmul_n": 64, "calibration_matmul_s": 0.004, "rows_matmul_s": 0.005}
    line = report._host_speed_counts(rows, host)
    assert "2 of 4 as made; 3 of 4 if each were scaled by that speed (1.25x" in line, line
    table = report.markdown({"setup": {"summary": "s", "date": "d", "host_probe": host}, "rows": rows, "targets": []})
    assert line in table
    # no prediction anywhere (e.g. --no-predict): no count
    assert report._host_speed_counts({"eager": rows["eager"]}, host) == ""


def test_each_row_is_compared_with_its_strategys_baselines_of_the_same_buffer_reuse():
    """Speed / memory against FSDP2 eager, FSDP2 + compile and torch's passes; a `~reuse-on` twin
    against the baseline's twin where that ran, else the baseline; "-" for the baseline itself."""
    rows = {key: _row(key, seconds, None) for key, seconds in [("fsdp2", 4.0), ("fsdp2-compile", 2.0), ("ours", 1.0)]}
    rows["fsdp2-compile~reuse-on"] = _row("fsdp2-compile~reuse-on", 1.6, None)
    rows["ours~reuse-on"] = _row("ours~reuse-on", 0.8, None) | {"peak_memory_bytes": 2**21}
    table = report.markdown({"setup": {"summary": "s", "date": "d"}, "rows": rows, "targets": []})
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[4:7] for line in table.splitlines()[4:]}
    assert cells["ours"] == ["4.00x / 1.00x", "2.00x / 1.00x", "-"]
    assert cells["ours~reuse-on"] == ["5.00x / 2.00x", "2.00x / 2.00x", "-"]
    assert cells["fsdp2"][0] == "-"


def test_torch_passes_refuse_uneven_shards_before_torch_2_13():
    """[Note: torch 2.11's FX bucketing and uneven shards]: refused by name below 2.13, not at or above."""
    model = torch.nn.Sequential(torch.nn.Embedding(68, 4), torch.nn.Linear(4, 67))
    scoreboard.check_torch_passes(model, 2, version="2.13.0")
    scoreboard.check_torch_passes(torch.nn.Embedding(68, 4), 2, version="2.11.0")
    refused = r"torch 2\.11\.0\+cu130's own FX bucketing .* 1\.weight has 67 rows over 2 ranks"
    with pytest.raises(ValueError, match=refused):
        scoreboard.check_torch_passes(model, 2, version="2.11.0+cu130")


def _overlapping(boxes: list) -> list[tuple[int, int]]:
    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]


def test_labels_of_crowded_points_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # four points as close as the scoreboard's budget rows, long labels as theirs
    points = [(68.1, 202.6), (69.9, 209.1), (71.3, 193.3), (70.0, 200.0)]
    labels = [(f"simplefsdp compiled, auto plan, budget 0.{i}", xy) for i, xy in enumerate(points)]
    fig, ax = plt.subplots(figsize=(10, 6.5))
    ax.set_xlim(55, 140)
    ax.set_ylim(120, 390)
    renderer = fig.canvas.get_renderer()
    for text, xy in labels:  # the control: every label at the first spot overlaps another
        ax.annotate(text, xy, fontsize=7, xytext=(4, 3), textcoords="offset points")
    assert _overlapping([t.get_window_extent(renderer) for t in ax.texts])
    for text in list(ax.texts):
        text.remove()
    report._place_labels(fig, ax, labels)
    assert [t.get_text() for t in ax.texts] == [text for text, _ in labels]
    assert _overlapping([t.get_window_extent(renderer) for t in ax.texts]) == []
    plt.close(fig)
