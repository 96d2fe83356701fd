"""The run folder of `simplefsdp train` (`simplefsdp/train/output.py`): a 5-step run leaves its settings
(which read back into the same `TrainConfig`), one metrics record per step, the loss curve and, on
request, TensorBoard event files; a resumed run appends. And the pieces on their own: the TOML
writer, the start-up summary line, the progress bar's estimate without the compile step, the curve."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from tqdm import tqdm

from simplefsdp.cli import main as simplefsdp_main
from simplefsdp.train.config import ConfigError, TrainConfig, load_toml, parse_args, to_toml
from simplefsdp.train.launch import check_outputs
from simplefsdp.train.output import restart_clock, summary_line
from simplefsdp.train.plot import read_records, write_loss_curve
from tests._tiers import fast_first
from tests.train import _run_dir_ranks

PNG = b"\x89PNG\r\n\x1a\n"


def test_config_toml_reads_back_into_the_same_config(tmp_path):
    odd = 'a "quoted" \\ path\twith\nlines, \x01 and ü'
    config = TrainConfig(
        checkpoint_dir=odd,
        lr=1e-05,
        bucket_cap_mib=0.5,
        progress=False,
        strategy="SHARD_GRAD_OP",
        steps=7,
        gather_dtype="float8_e4m3fn",
        gather_block=64,
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    document = load_toml(path)  # tomllib, type-checked against the fields
    assert document["checkpoint_dir"] == odd
    assert set(document) == set(TrainConfig.__dataclass_fields__)
    assert parse_args(["--config", str(path)]) == config
    assert parse_args(["--config", str(path), "--steps", "9"]) == TrainConfig(**{**vars(config), "steps": 9})


def test_summary_line():
    config = TrainConfig(steps=100, checkpoint_dir="ckpt", reduce_dtype="fp32", param_dtype="bf16")
    line = summary_line(config, parameters=2_134_000, mesh=[("dp", 2), ("tp", 2)], tokens_per_step=1024, start=40)
    assert line == (
        "simplefsdp train: built-in model, 2.13M parameters | mesh dp=2 x tp=2 | FULL_SHARD | bf16/fp32 | "
        "offload none | 1,024 tokens/step | steps 41-100 | inductor | run folder ckpt/run"
    )
    quantized = TrainConfig(param_dtype="bf16", reduce_dtype="fp32", gather_dtype="int8")
    line = summary_line(quantized, parameters=950, mesh=[("dp", 2)], tokens_per_step=64, start=0)
    assert " | bf16/fp32 gather int8 | offload none | " in line
    other = TrainConfig(run_dir="elsewhere", backend="eager")
    assert summary_line(other, parameters=950, mesh=[("dp", 1)], tokens_per_step=64, start=0).endswith(
        "fp32/fp32 | offload none | 64 tokens/step | steps 1-100 | eager | run folder elsewhere"
    )


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _bar(clock: _Clock) -> tqdm:
    bar = tqdm(total=10, file=io.StringIO(), mininterval=0, miniters=1)
    bar._time = clock  # tqdm's own clock, an attribute of the bar (as tqdm's tests drive it)
    bar.start_t = bar.last_print_t = clock()
    return bar


@pytest.mark.parametrize("restart", [True, False])
def test_the_time_estimate_leaves_the_compile_step_out(restart):
    """A 100 s compiling step, then 1 s steps: after three of them the estimate for the 6 left is 6 s
    (with the compile step counted, the rate says over ten times that)."""
    clock = _Clock()
    bar = _bar(clock)
    clock.now += 100.0
    bar.update(1)
    if restart:
        restart_clock(bar)
    for _ in range(3):
        clock.now += 1.0
        bar.update(1)
    stats = bar.format_dict
    remaining = (stats["total"] - stats["n"]) / (stats["rate"] or stats["n"] / stats["elapsed"])
    assert stats["n"] == 4
    if restart:
        assert stats["elapsed"] == pytest.approx(3.0)
        assert remaining == pytest.approx(6.0)
    else:
        assert stats["elapsed"] == pytest.approx(103.0)
        assert remaining > 60.0


def test_curve_from_the_newest_record_of_each_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}, {"summary": {}}, {"step": 2, "loss": 2.5}]
    lines.append({"step": 3, "loss": 2.0, "eval_loss": 2.2})
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_records(metrics)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 4.0), (2, 2.5), (3, 2.0)]
    assert write_loss_curve(records, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG)
    assert not write_loss_curve(read_records(tmp_path / "none.jsonl"), tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_tensorboard_missing_is_one_line_before_any_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec says None
    config = TrainConfig(tensorboard=True, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match="tensorboard: the tensorboard package is not installed"):
        check_outputs(config)
    assert simplefsdp_main(["train", "--tensorboard", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.startswith("simplefsdp train: error: tensorboard:")


def test_run_dir_that_cannot_be_made_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert simplefsdp_main(["train", "--run-dir", str(tmp_path / "file" / "run")]) == 2
    assert f"run_dir {tmp_path}/file/run: {tmp_path}/file is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("tensorboard", fast_first([True, False]))
def test_a_five_step_run_fills_its_run_folder_and_a_resumed_one_appends(ranks2, tmp_path, tensorboard):
    listing = ranks2.run(_run_dir_ranks.run_and_resume, str(tmp_path), tensorboard)[0]
    run = tmp_path / "ckpt" / "run"
    assert listing == ["config.toml", "loss.png", "metrics.jsonl", *(["tensorboard"] if tensorboard else [])]
    config = parse_args(["--config", str(run / "config.toml")])
    assert (config.steps, config.resume, config.checkpoint_dir) == (7, True, str(tmp_path / "ckpt"))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "step" in line]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6, 7]
    for record in steps:
        assert {"loss", "seconds", "tokens_per_s", "peak_rss_bytes"} <= set(record), record
        assert record["peak_rss_bytes"] > 2**20
    assert [line["summary"]["start_step"] for line in lines if "summary" in line] == [0, 5]
    assert (run / "loss.png").read_bytes().startswith(PNG)
    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = [EventAccumulator(str(path)).Reload() for path in sorted((run / "tensorboard").iterdir())]
        assert [[e.step for e in acc.Scalars("loss")] for acc in events] == [[1, 2, 3, 4, 5], [6, 7]]


@pytest.mark.slow  # a compiled 2-rank run (13 s on a busy 2-core host): the gathers quantize in compiled steps only
def test_an_int8_gather_run_quantizes_its_gathers_and_records_it(ranks2, tmp_path):
    """`--steps 2 --backend aot_eager --gather-dtype int8`: every rank quantizes its shards for the
    all-gathers, the loss stays finite, and the run folder's config.toml reads back with the gather."""
    (calls0, losses), (calls1, _) = ranks2.run(_run_dir_ranks.run_quantized, str(tmp_path))
    assert calls0 > 0
    assert calls1 == calls0
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)
    config = parse_args(["--config", str(tmp_path / "ckpt" / "run" / "config.toml")])
    assert (config.gather_dtype, config.gather_block, config.param_dtype) == ("int8", 128, "bf16")
