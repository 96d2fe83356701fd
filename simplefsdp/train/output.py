"""What rank 0 of `simplefsdp train` shows and keeps: the progress bar, the start-up summary line and
the run folder.

    out = RunOutput(config, start=0, enabled=dist.get_rank() == 0, compiling="compile (cold)")
    out.say(summary_line(config, parameters=n, mesh=(("dp", 2),), tokens_per_step=1024, start=0))
    out.step({"step": 1, "loss": 4.2, "seconds": 9.1, "tokens_per_s": 112.5}, compiling=True)  # "compile (cold)"
    out.finish({"start_step": 0, ...})   # the summary record, the loss curve
    out.close()

The run folder (`config.run_path`: `--run-dir`, default `<checkpoint_dir>/run`) holds
- `config.toml`: every setting of the run (`to_toml`), so `simplefsdp train --config <run>/config.toml`
  runs it again;
- `metrics.jsonl`: one JSON record per step (what the loop puts in it), then one `{"summary": ...}`
  line per run; `--metrics-file` gets the same lines as well;
- `loss.png`: the loss curve (`plot.py`), every `--plot-every` steps and at the end;
- `tensorboard/`: event files, with `--tensorboard`.
A fresh run replaces the folder's `metrics.jsonl`; a resumed one appends to it, and its curve is
drawn from the whole file (the newest record of a step wins: a step run again after a resume from
an earlier checkpoint replaces the first run's). Invariant: only the rank with `enabled` touches
the terminal or the file system; the other ranks' calls do nothing.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import IO, Any

from tqdm import tqdm

from simplefsdp.train.config import TrainConfig, to_toml
from simplefsdp.train.plot import read_records, write_loss_curve

__all__ = ["RunOutput", "restart_clock", "summary_line"]

logger = logging.getLogger(__name__)


def _count(n: int) -> str:
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def summary_line(
    config: TrainConfig, *, parameters: int, mesh: Sequence[tuple[str, int]], tokens_per_step: int, start: int
) -> str:
    """The start-up line: what is trained, how, and where its run folder is."""
    reduce = config.param_dtype if config.reduce_dtype == "auto" else config.reduce_dtype
    model = config.shape or config.model or "built-in model"
    fields = [
        f"{model}, {_count(parameters)} parameters",
        "mesh " + " x ".join(f"{name}={size}" for name, size in mesh),
        config.strategy,
        f"{config.param_dtype}/{reduce}" + (f" gather {config.gather_dtype}" if config.gather_dtype != "none" else ""),
        f"offload {config.offload}",
        f"{tokens_per_step:,} tokens/step",
        f"steps {start + 1}-{config.steps}",
        config.backend,
        f"run folder {config.run_path}",
    ]
    return "simplefsdp train: " + " | ".join(fields)


def restart_clock(bar: tqdm) -> None:
    """Start `bar`'s rate and time estimate afresh from its current count: called after the first
    (compiling) step, whose seconds say nothing about the steps to come."""
    if bar.disable:
        return
    done = bar.n
    bar.reset(total=bar.total)  # the clock and the smoothed rate; the count goes to 0
    bar.n = bar.last_print_n = bar.initial = done
    bar.refresh()


def _tensorboard_writer(path: Any) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: checked at launch

    return SummaryWriter(log_dir=str(path))


class RunOutput:
    """Rank 0's progress bar and run folder; silent on the other ranks (see the module docstring)."""

    def __init__(self, config: TrainConfig, *, start: int, enabled: bool, compiling: str = "compile") -> None:
        """`compiling`: what the bar shows for the first (compiling) step, e.g. "compile (warm)"."""
        self.enabled, self.every, self.plot_every = enabled, 10, config.plot_every
        self.compiling = compiling
        self.eval_loss: float | None = None  # the latest held-out loss, which the bar keeps showing
        show = enabled and config.progress
        self.bar = tqdm(total=config.steps, initial=start, disable=not show, file=sys.stderr, unit="step")
        self.files: list[IO[str]] = []
        self.tensorboard = None
        self.run = config.run_path
        if not enabled:
            return
        self.run.mkdir(parents=True, exist_ok=True)
        (self.run / "config.toml").write_text(to_toml(config))
        self.files.append(open(self.run / "metrics.jsonl", "a" if start else "w"))  # noqa: SIM115
        if config.metrics_file:
            self.files.append(open(config.metrics_file, "a"))  # noqa: SIM115
        if config.tensorboard:
            self.tensorboard = _tensorboard_writer(self.run / "tensorboard")

    def step(self, record: dict[str, Any], *, compiling: bool) -> None:
        if not self.enabled:
            return
        rate = self.compiling if compiling else f"{record['tokens_per_s']:,.0f} tok/s"
        scale = f" | scale {record['loss_scale']:g}" if "loss_scale" in record else ""
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        held = f" | eval {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        self.bar.set_postfix_str(f"loss {record['loss']:.4f}{held} | {rate}{scale}")
        self.bar.update(1)
        if compiling:
            restart_clock(self.bar)
        if self.bar.disable and (record["step"] % self.every == 0 or compiling or "eval_loss" in record):
            step, loss, seconds = record["step"], record["loss"], record["seconds"]
            logger.info("step %d: loss %.4f%s, %s (%.2fs)", step, loss, held, rate, seconds)
        self.write_metrics(record)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, global_step=record["step"])
        if self.plot_every and record["step"] % self.plot_every == 0:
            self.plot()

    def write_metrics(self, record: dict[str, Any]) -> None:
        for file in self.files:
            file.write(json.dumps(record) + "\n")
            file.flush()

    def plot(self) -> None:
        """Rewrite `loss.png` from the whole of `metrics.jsonl`."""
        write_loss_curve(read_records(self.run / "metrics.jsonl"), self.run / "loss.png")

    def steps_done(self) -> None:
        """After the last step: the bar closes (its rate is the steps', not what follows)."""
        self.bar.close()

    def finish(self, summary: dict[str, Any]) -> None:
        """After the last step: the run's summary record and the loss curve."""
        self.bar.close()  # its last rate is the steps', not the drawing's
        if not self.enabled:
            return
        self.write_metrics({"summary": summary})
        self.plot()

    def say(self, line: str) -> None:
        if self.enabled:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        for file in self.files:
            file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
