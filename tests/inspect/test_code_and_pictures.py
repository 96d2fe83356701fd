"""Inductor on the CPU (fake world of 8): the schedule view's claims against the order in the
generated code; the pictures; the CLI.

Fast tier: the CLI end to end (its dry run, tables and pictures) and its bad input; the tests on
inductor's generated code (a compile of their own) run in the full suite, and test_overlap.py
checks the generated code's order in the fast tier."""

from __future__ import annotations

import matplotlib.image
import numpy as np
import pytest

from simplefsdp import cli
from simplefsdp.inspect.dryrun import dry_run
from simplefsdp.inspect.shapes import SHAPES
from simplefsdp.inspect.timeline import _COMM, _COMPUTE, EXPOSED, save_html, save_png
from tests.passes.test_overlap import _code_events, _launches

SHAPE = SHAPES["tiny"]


def _on_cpu():
    return SHAPE.build(device="cpu"), SHAPE.example_input(device="cpu")


@pytest.fixture(scope="module")
def compiled():
    """A 2-block model compiled by inductor, fp32 (bf16 matmuls run slowly on the CPU)."""
    import simplefsdp

    return dry_run(_on_cpu, world_size=8, device="cpu-gloo", mp_policy=simplefsdp.MixedPrecisionPolicy(), code=True)


@pytest.mark.slow
def test_claims_agree_with_generated_code(compiled):
    """Per collective, in launch order: the schedule says whether matmuls run between its launch and
    its wait (overlap) or none do; inductor's code must show the same."""
    capture, schedule = compiled.report.capture, compiled.report.schedule
    checked = 0
    for phase, code in [(schedule.forward, capture.forward_code), (schedule.backward, capture.backward_code)]:
        events = _code_events(code)
        position = {event: i for i, event in enumerate(events)}
        # a gloo profile: each reduce-scatter bucket is an in-place all-reduce (passes/backend.py), a
        # reduce-scatter left out of a bucket stays one
        launches = [("all_gather", "all_gather_into_tensor"), ("reduce_scatter", "reduce_scatter_tensor")]
        for kind, collective in [*launches, ("all_reduce", "all_reduce_")]:
            claimed = [e for e in phase.comm if e.collective == kind]
            buffers = _launches(code, collective)
            assert len(buffers) == len(claimed), f"{phase.phase}: {kind} count differs between FX and code"
            for event, buf in zip(claimed, buffers, strict=True):
                between = events[position[("L", buf)] : position[("W", buf)]]
                code_overlaps = any(kind == "mm" for kind, _ in between)
                assert code_overlaps == (event.matmuls_between > 0), f"{phase.phase} {event.name}: {event.status}"
                checked += 1
    assert checked == len(schedule.comm) > 0
    statuses = {e.status for e in schedule.comm}
    assert "exposed" in statuses, statuses
    assert statuses & {"overlapped", "partly exposed"}, statuses


def _has_color(pixels: np.ndarray, hex_color: str) -> bool:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)]) / 255
    return bool((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).any())


@pytest.mark.slow
def test_pictures_show_both_lanes(compiled, tmp_path):
    schedule = compiled.report.schedule
    png = save_png(schedule, tmp_path / "t.png")
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 100
    assert pixels.shape[1] > 500
    # a collective's bar shows in its kind's colour where it runs behind compute, in EXPOSED's where
    # it stalls the step: each kind with some hidden time must show its colour (the gradient buckets'
    # reductions are in-place all-reduces on a gloo profile, passes/backend.py)
    events = [*schedule.forward.comm, *schedule.backward.comm]
    hidden = {e.collective for e in events if e.exposed_s < e.duration_s}
    assert "all_gather" in hidden, "the prefetched all-gathers run behind compute"
    assert _has_color(pixels, _COMPUTE[0]), "no compute bar in the PNG"
    assert _has_color(pixels, EXPOSED), "no exposed bar in the PNG"
    for kind in hidden:
        assert _has_color(pixels, _COMM[kind]), f"no {kind} bar in the PNG"
    page = save_html(schedule, tmp_path / "t.html").read_text()
    assert ">compute</text>" in page
    assert ">comm</text>" in page
    for color in (_COMPUTE[0], _COMM["all_gather"], _COMM["reduce_scatter"], _COMM["all_reduce"], EXPOSED):
        assert f'fill="{color}"' in page
    assert "<script" not in page, "self-contained"
    assert "http" not in page.replace("http://www.w3.org/2000/svg", ""), "self-contained"


@pytest.mark.slow
def test_report_saves_graphs_and_code(compiled, tmp_path):
    written = compiled.report.save(tmp_path)
    assert "all_gather_into_tensor" in written["forward_graph"].read_text()
    assert "def call(" in written["backward_code"].read_text()
    assert all(path.stat().st_size > 0 for path in written.values())


def test_cli_smoke(tmp_path, capsys):
    assert cli.main(["inspect", "tiny", "--world", "8", "--device", "a100", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for title in ("dry run", "buckets", "schedule on a100", "memory per rank"):
        assert title in out
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "timeline.html").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "tiny", "--device", "tpu"], "unknown device profile 'tpu'"),
        (["inspect", "tiny", "--world", "6", "--strategy", "HYBRID_SHARD", "--shard-size", "4"], "must divide"),
        (["inspect", "nosuch.module:build"], "cannot load model factory"),
        (["inspect", "llama9"], "simplefsdp inspect: error: unknown model shape 'llama9'; known: ["),
        (["inspect", "tiny", "--wrld", "8"], "simplefsdp inspect: error: unrecognized arguments: --wrld"),
        (["inspect", "tiny", "--world", "0"], "simplefsdp inspect: error: argument --world: must be a positive"),
        (["frobnicate"], "unknown command 'frobnicate'"),
    ],
)
def test_cli_bad_input(argv, message, capsys):
    """A bad model, flag or world: one line on stderr (as `simplefsdp train`'s), exit code 2, nothing on stdout."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert not captured.out
