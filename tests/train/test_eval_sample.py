"""`simplefsdp train --eval-every` / `--sample-tokens` / `--lr-schedule` / `--grad-clip` in the train
loop, on 2 ranks of the pool: every step's metrics carry its learning rate and gradient norm, eval
steps the held-out loss; the run ends with a greedy sample, the same on every rank; and evaluating
and sampling change nothing in training (the same losses and norms as a run without them). Compiled,
evaluation adds one graph (the no-grad one) and no recompile of the training step. The `--resume`
run with nothing left to train exits 0 with one line, before any rank starts.
"""

from __future__ import annotations

import json

import pytest
import torch

from simplefsdp.cli import main as simplefsdp_main
from simplefsdp.train.config import TrainConfig
from simplefsdp.train.data import VOCAB
from simplefsdp.train.evaluate import EVAL_BATCHES, HeldOut
from simplefsdp.train.schedule import lr_at
from tests.train import _eval_ranks


def test_held_out_batches_come_from_the_tail_split_over_the_ranks():
    ids = torch.arange(750)  # each token its position; the tail is 675..749
    config = TrainConfig(seq_len=16, batch_per_rank=2)
    ranks = [HeldOut.of(config, ids, dp_rank=rank, dp_size=2) for rank in range(2)]
    for held in ranks:
        assert len(held.batches) == EVAL_BATCHES
        assert all(batch.shape == (2, 17) and int(batch.min()) >= 675 for batch in held.batches)
        assert torch.equal(held.prompt, torch.arange(675, 691))
    windows = torch.cat([torch.cat(held.batches) for held in ranks])[:, 0]
    assert len(set(windows.tolist())) == len(windows), "every window another one"
    assert int(windows.max()) == 749 - 16, "spread to the tail's end"


KNOBS = {"steps": 3, "lr_schedule": "cosine", "warmup_steps": 1, "grad_clip": 0.5}


def test_eval_sample_and_schedule_in_the_metrics_and_training_unchanged(ranks2, tmp_path):
    on = ranks2.run(_eval_ranks.run, str(tmp_path / "on"), backend="eager", eval_every=2, sample_tokens=6, **KNOBS)
    off = ranks2.run(_eval_ranks.run, str(tmp_path / "off"), backend="eager", eval_every=0, sample_tokens=0, **KNOBS)
    records = on[0]["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [("eval_loss" in r) for r in records] == [False, True, True], "every 2 steps and at the end"
    assert on[0]["eval_loss"] == records[-1]["eval_loss"] == on[0]["summary"]["eval_loss"]
    assert 0 < records[-1]["eval_loss"] < records[0]["loss"], "a trained model's held-out loss"
    lrs = [lr_at(step, lr=1e-2, schedule="cosine", warmup_steps=1, steps=3) for step in range(3)]
    assert [r["lr"] for r in records] == lrs
    assert all(r["grad_norm"] > 0 for r in records)
    # the sample: greedy, so the same on every rank; one corpus character per token
    assert len(on[0]["sample"]) == 6
    assert set(on[0]["sample"]) <= set(VOCAB)
    assert on[1]["sample"] == on[0]["sample"] == on[0]["summary"]["sample"]
    # evaluation and sampling leave training as it was
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in records] == [r[key] for r in off[0]["records"]], key
    assert off[0]["sample"] == ""
    assert off[0]["eval_loss"] is None
    assert all("eval_loss" not in r for r in off[0]["records"])


@pytest.mark.slow  # two aot_eager compiles of the train model and one of its no-grad forward
def test_compiled_eval_adds_one_graph_and_leaves_the_training_step_compiled(ranks2, tmp_path):
    on = ranks2.run(_eval_ranks.run, str(tmp_path / "on"), backend="aot_eager", eval_every=1, sample_tokens=3, steps=3)
    off = ranks2.run(_eval_ranks.run, str(tmp_path / "off"), backend="aot_eager", sample_tokens=0, steps=3)
    assert [r["loss"] for r in on[0]["records"]] == [r["loss"] for r in off[0]["records"]]
    assert on[0]["graphs"] == 2 * off[0]["graphs"], "the no-grad forward's graphs, once, beside the training step's"


def _checkpoint(directory, step: int) -> None:
    """What `--resume` reads of a checkpoint to find its step: a complete directory's train state."""
    path = directory / f"step_{step:09d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    state = {"step": step, "world_size": 2, "extra": {}, "optimizer": {}, "rng": {}}
    (path / "train_state.json").write_text(json.dumps(state))


def test_resume_past_the_steps_says_so_and_exits_0(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt", 150)
    assert simplefsdp_main(["train", "--resume", "--steps", "120", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    err = capsys.readouterr().err
    assert err == (
        f"simplefsdp train: nothing to train: the newest checkpoint ({tmp_path / 'ckpt' / 'step_000000150'}) "
        "is at step 150, --steps is 120\n"
    )
