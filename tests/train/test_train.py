"""`simplefsdp train` end to end on 2 CPU ranks it spawns itself: the loss falls, checkpoints are
written, and --resume continues the step count and the loss curve.

One run is shared (module fixture): 6 steps compiled with inductor (the command's default),
checkpoints at steps 3 and 6. The resume test removes the step-6 checkpoint and resumes from step 3
to step 6 under `aot_eager` (a third of inductor's compile time) with selective activation
checkpointing (which recomputes the same ops: the numbers do not change, and torch's warning about
it must not reach the terminal); steps 4-6 must repeat the first run's losses.
[Note: resume tolerance] The first run's steps 4-6 ran inductor's fused kernels, the resumed ones
run the same ops unfused: fp32 sums in another order, a few ulps per op, which after
three AdamW steps stay far below 1e-4 relative (seen: 1e-7). A resume that lost the weights or
the data position is off by far more at step 4 already, one that lost the optimizer state at step 5.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

# slow: see tests/_tiers.py; the first test also runs the shared 6-step inductor run (its fixture)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TINY = ["--n-layers", "2", "--dim", "32", "--n-heads", "4", "--ffn-dim", "88", "--seq-len", "16", "--lr", "1e-2"]


def _train(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "simplefsdp.cli", "train", *TINY, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=400, check=False)


def _records(path) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if "step" in r], next(r["summary"] for r in lines if "summary" in r)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    done = _train(
        "--steps", "6", "--checkpoint-every", "3", "--keep-last", "3",
        "--checkpoint-dir", str(root / "ckpt"), "--metrics-file", str(root / "metrics.jsonl"), cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root, done


def test_loss_falls_and_checkpoints_are_written(first_run):
    root, done = first_run
    records, summary = _records(root / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    losses = [r["loss"] for r in records]
    assert losses[-1] < 0.8 * losses[0], losses
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["run", "step_000000003", "step_000000006"]
    assert [r["step"] for r in _records(root / "ckpt" / "run" / "metrics.jsonl")[0]] == [1, 2, 3, 4, 5, 6]
    # the progress output: a bar with loss and tokens/s, and the communication summary after compiling
    assert "tok/s" in done.stderr
    assert "loss" in done.stderr
    assert summary["traced"]
    assert 0 < summary["collectives"] < summary["collectives_before_pass"]
    assert f"comm: {summary['collectives']} collectives/step (from {summary['collectives_before_pass']}" in done.stderr
    assert 0.0 <= summary["overlapped_pct"] <= 100.0
    assert summary["peak_bytes"] > 0, "the liveness walk's transient peak"
    assert summary["peak_bytes_before_pass"] > 0
    assert f"transient peak {summary['peak_bytes'] / 2**20:.1f} MiB" in done.stderr
    # the default sample at the end (eager: no evaluation compiled a no-grad graph), printed by rank 0
    assert len(summary["sample"]) == 64
    assert f"sample (64 tokens, greedy, after the held-out prompt):\n{summary['sample']}" in done.stderr
    assert all(r["grad_norm"] > 0 and r["lr"] == 1e-2 for r in records), "constant lr, no warmup: the defaults"


def test_resume_continues_step_count_and_loss_curve(first_run, tmp_path):
    root, _ = first_run
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "step_000000006")  # the newest is now step 3
    done = _train(
        "--steps", "6", "--resume", "--backend", "aot_eager", "--no-progress", "--activation-checkpoint", "selective",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "metrics.jsonl"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    resumed, summary = _records(tmp_path / "metrics.jsonl")
    first, _ = _records(root / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert summary["start_step"] == 3
    for mine, theirs in zip(resumed, first[3:], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)  # see [Note: resume tolerance]
    assert "step_000000006" in {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert "resumed from" in done.stderr
    # the output is for people: rank 1 stays quiet, torch's benign selective-checkpoint warning is dropped
    assert "rank1]" not in done.stderr
    assert "[rank 1]" not in done.stderr
    assert "context_fn" not in done.stderr
    assert "Warning" not in done.stderr, done.stderr


def _train_planned(argv: list[str], plan) -> tuple[int, int]:
    """On a pool rank: the train loop with `plan`, as `launch` hands it to the spawned ranks."""
    import torch

    from simplefsdp.train.config import parse_args
    from simplefsdp.train.loop import train

    outcome = train(parse_args(argv), device=torch.device("cpu"), offload_plan=plan)
    return outcome.start_step, outcome.end_step


def test_offload_auto_plans_before_the_ranks_and_offloads_as_little_as_the_limit_needs(ranks2, tmp_path):
    """`--offload auto` with a limit a little under the predicted step: the last block alone goes to
    the optimizer tier (the planner's rule: the cheapest tier, the latest block among equal savings),
    and the ranks train with that plan."""
    from simplefsdp.train.config import parse_args
    from simplefsdp.train.offload_auto import plan_for, predicted

    units, transient = predicted(parse_args([*TINY, "--backend", "eager"]), world_size=2, device_type="cpu")
    blocks = [u for u in units if u.name.startswith("layers.")]
    everything = transient + sum(u.kept("none") for u in units)
    saving = blocks[-1].kept("none") - blocks[-1].kept("optimizer")
    argv = [*TINY, "--offload", "auto", "--device-memory-limit", f"{everything - saving // 2}B", "--steps", "2"]
    argv += ["--backend", "eager", "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress"]
    plan = plan_for(parse_args(argv), world_size=2, device_type="cpu")
    assert plan.summary() == f"optimizer: {blocks[-1].name}"
    assert ranks2.run(_train_planned, argv, plan)[0] == (0, 2)


def test_offload_auto_refuses_a_limit_nothing_meets_before_any_rank_starts():
    from simplefsdp.train.config import ConfigError, parse_args
    from simplefsdp.train.offload_auto import plan_for

    config = parse_args([*TINY, "--offload", "auto", "--device-memory-limit", "1KiB"])
    with pytest.raises(ConfigError, match="offload auto: even with everything offloaded a step needs"):
        plan_for(config, world_size=2, device_type="cpu")
    with pytest.raises(ConfigError, match="device_memory_limit is for offload auto"):
        parse_args([*TINY, "--device-memory-limit", "1GiB"])
