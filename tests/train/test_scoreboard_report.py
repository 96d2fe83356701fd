"""bench/_scoreboard_report.py's host-speed line ([Note: the host's speed, twice] in bench/scoreboard.py),
its picture's labels, the bf16 and quantized rows' targets, baselines, bytes column and bf16 compute
line, bench/_scoreboard_rows.py's row sets and policies, and the scoreboard's refusal of torch's passes
on uneven shards before torch 2.13: pure functions on hand-made rows and models, no run."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _scoreboard_report as report  # bench/ is not a package: its scripts import it the same way
import _scoreboard_rows as rows
import pytest
import scoreboard
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

import simplefsdp


def _row(label: str, measured_s: float, predicted_s: float | None) -> dict:
    return {
        "label": label,
        "strategy": "FULL_SHARD",
        "step_time_s": measured_s,
        "tokens_per_s": 1.0 / measured_s,
        "peak_memory_bytes": 2**20,
        "compile_s": 0.0,
        "collectives_per_step": 1,
        "gathered_bytes_per_step": 2**20,
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


def test_row_sets_select_the_rows_in_order():
    """`--set`: fp32 (with the frontier), bf16, quant, any of them comma-separated, or all; in that order."""
    bf16_and_quant = ["fsdp2-bf16", "fsdp2-compile-bf16", "ours-bf16", "ours-auto-bf16", "ours-int8", "ours-fp8"]
    assert rows.rows_of_sets("quant, bf16", "0.2") == bf16_and_quant
    fp32 = rows.rows_of_sets("fp32", "0.2,0.5")
    assert fp32[0] == "ddp"
    assert fp32[-2:] == ["auto@0.2", "auto@0.5"]
    assert "ours-bf16" not in fp32
    assert rows.rows_of_sets("all", "0.2") == fp32[:-1] + bf16_and_quant
    with pytest.raises(ValueError, match="--set 'fp16'"):
        rows.rows_of_sets("fp16", "0.2")


def test_bf16_rows_share_one_policy_and_the_quantized_rows_add_their_gather():
    assert rows.fsdp2_policy(rows.config_of("fsdp2-bf16")) == FSDP2Policy(torch.bfloat16, torch.float32)
    assert rows.fsdp2_policy(rows.config_of("fsdp2")) == FSDP2Policy()
    bf16 = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert rows.simplefsdp_policy(rows.config_of("ours-bf16~reuse-on")) == bf16
    assert rows.simplefsdp_policy(rows.config_of("ours-fp8")) == dataclasses.replace(
        bf16, gather_dtype="float8_e4m3fn", gather_block=128
    )
    assert rows.simplefsdp_policy(rows.config_of("ours")) == simplefsdp.MixedPrecisionPolicy()


def _bf16_rows() -> dict[str, dict]:
    """FSDP2 eager bf16 at 4 s, ours bf16 at 2 s, int8 at 1.6 s (0.7x / 0.6x FSDP2's memory), fp32 FSDP2 at 8 s."""
    table = {
        "fsdp2": (8.0, 2**20, 400),
        "fsdp2-bf16": (4.0, 2**20, 200),
        "fsdp2-compile-bf16": (3.0, 2**20, 200),
        "ours-bf16": (2.0, 0.7 * 2**20, 256),
        "ours-int8": (1.6, 0.6 * 2**20, 136),
    }
    made = {}
    for key, (seconds, peak, gathered) in table.items():
        made[key] = _row(key, seconds, None) | {"peak_memory_bytes": peak, "gathered_bytes_per_step": gathered}
        made[key]["precision"] = "fp32" if key == "fsdp2" else "bf16"
    return made


def test_bf16_rows_meet_their_targets_against_bf16_baselines():
    found = {t["target"]: (round(t["ratio"], 4), t["met"]) for t in report.targets(_bf16_rows())}
    assert found == {
        "FULL_SHARD default, bf16: tokens_per_s / fsdp2-bf16 >= 1.5": (2.0, True),
        "FULL_SHARD default, bf16: peak_memory_bytes / fsdp2-bf16 <= 0.8": (0.7, True),
        "FULL_SHARD default, bf16: tokens_per_s / fsdp2-compile-bf16 >= 1.0": (1.5, True),
        "FULL_SHARD, int8 gathers: tokens_per_s / fsdp2-bf16 >= 1.5": (2.5, True),
        "FULL_SHARD, int8 gathers: peak_memory_bytes / fsdp2-bf16 <= 0.8": (0.6, True),
        "FULL_SHARD, int8 gathers: gathered_bytes_per_step / ours-bf16 <= 0.55": (0.5312, True),
    }
    slower = _bf16_rows()
    slower["ours-int8"] |= {"gathered_bytes_per_step": 150, "tokens_per_s": 1 / 3.0}
    int8 = [t for t in report.targets(slower) if t["target"].startswith("FULL_SHARD, int8")]
    missed = {t["target"].split(": ")[1]: t for t in int8}
    assert not missed["gathered_bytes_per_step / ours-bf16 <= 0.55"]["met"]  # 150 / 256 = 0.59
    assert missed["tokens_per_s / fsdp2-bf16 >= 1.5"]["missed_by_pct"] == pytest.approx(100 * (1 - 4 / 3 / 1.5))


def test_the_table_compares_bf16_rows_with_bf16_baselines_and_shows_the_bytes_gathered():
    made = _bf16_rows()
    made["ours-int8"]["gathered_bytes_per_step"] = 3 * 2**20
    matmuls = {"fp32_s": 0.010, "bf16_s": 0.025, "cpu_bf16_flags": []}
    setup = {"summary": "s", "date": "d", "bf16_matmuls": matmuls}
    table = report.markdown({"setup": setup, "rows": made, "targets": []})
    cells = {line.split(" | ")[0].removeprefix("| "): line.split(" | ") for line in table.splitlines() if "| " in line}
    assert cells["ours-int8"][4:7] == ["2.50x / 0.60x", "1.88x / 0.60x", "-"]  # against fsdp2-bf16, not fsdp2
    assert cells["ours-int8"][10] == "3.0 MiB"
    assert "took 25.00 ms in bf16 and 10.00 ms in fp32" in table
    assert "2.50x (the CPU's bf16 flags: none): bf16 matmuls ran slower than fp32 on this host" in table
    matmuls |= {"bf16_s": 0.005, "cpu_bf16_flags": ["avx512_bf16"]}
    assert "0.50x (the CPU's bf16 flags: avx512_bf16): bf16 matmuls were not slower" in report._bf16_line(matmuls)[0]
    assert report._bf16_line(None) == []
