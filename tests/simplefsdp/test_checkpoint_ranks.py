"""Sharded checkpoints on 2 gloo ranks, a small model: the ranks decide together, and optimizer
state comes back as it was saved.

- One rank's stale directory listing does not change the manifest (before: the ranks split the
  hashing by their own listings, which then disagreed: a file went unhashed or unlisted), and a
  file one rank cannot hash fails the save on every rank (before: the others hung).
- A file of the newest checkpoint that one rank alone cannot read makes every rank fall back to
  the same older checkpoint, with the same reason (before: the ranks loaded different checkpoints
  or hung in mismatched collectives).
- Every optimizer state entry keeps its type, placements, dtype, shape, device and value (before:
  AdamW's plain `step` of a 0-dim parameter came back a DTensor).

The rank functions are in `_ckpt_ranks.py`; a hang fails within `ranks2`'s lowered timeout.
"""

from __future__ import annotations

import re

import pytest

from tests.simplefsdp import _ckpt_ranks as ckpt_ranks


@pytest.mark.parametrize(("name", "rank"), [("train_state.json", 1), ("__1_0.distcp", 0)])
def test_the_manifest_lists_what_is_on_disk_whatever_one_rank_sees(ranks2, tmp_path, name, rank):
    """On `rank`, the listing of the unfinished checkpoint lacks `name`, a file the other rank
    wrote: the manifest still lists every file on disk, and the checkpoint loads verified."""
    results = ranks2.run(ckpt_ranks.save_with_stale_listing, str(tmp_path), name=name, rank=rank)
    listed, on_disk, step = results[0]
    assert results[1] == results[0]
    assert listed == on_disk
    assert step == 1


def test_a_file_one_rank_cannot_hash_fails_the_save_on_every_rank(ranks2, tmp_path):
    """Rank 1 hashes __0_0.distcp for the manifest (rank 0 wrote it) and cannot open it: every rank
    raises `CheckpointError` naming the file and the rank, and the checkpoint is never committed."""
    results = ranks2.run(ckpt_ranks.save_with_unreadable_file, str(tmp_path), name="__0_0.distcp", rank=1)
    assert results[0] == results[1]
    message, listed = results[0]
    assert message.startswith(f"cannot write the manifest of {tmp_path / 'step_000000002.tmp'}"), message
    assert re.search(r"__0_0\.distcp: unreadable .*Permission denied.*\(seen by rank 1\)", message), message
    assert listed == ["step_000000001"]


# Who reads what, 2 ranks: each rank reads .metadata and train_state.json to load; the hashing
# verification splits the sorted file names (.metadata, __0_0.distcp, __1_0.distcp,
# train_state.json) between the ranks, so rank 1 alone hashes __0_0.distcp and train_state.json.
@pytest.mark.parametrize(
    ("name", "rank"),
    [
        (".metadata", 1),  # read by every rank, hashed by rank 0: rank 1 fails reading it
        ("train_state.json", 0),  # read by every rank, hashed by rank 1: rank 0 fails reading it
        ("__0_0.distcp", 1),  # hashed by rank 1 only: rank 1 fails hashing it
    ],
)
def test_a_file_one_rank_cannot_read_makes_every_rank_fall_back(ranks2, tmp_path, name, rank):
    results = ranks2.run(ckpt_ranks.load_with_unreadable_file, str(tmp_path), name=name, rank=rank)
    assert results[0] == results[1], "the ranks loaded different checkpoints or skipped for different reasons"
    step, skipped, params_of_step_1 = results[0]
    assert (step, params_of_step_1) == (1, True)
    assert len(skipped) == 1
    assert skipped[0].startswith(str(tmp_path / "step_000000002"))
    assert re.search(rf"{re.escape(name)}: .*Permission denied.*\(seen by rank {rank}\)", skipped[0]), skipped[0]


@pytest.mark.parametrize("optimizer", sorted(ckpt_ranks.OPTIMIZERS))
def test_optimizer_state_comes_back_as_it_was_saved(ranks2, tmp_path, optimizer):
    """Type, placements, dtype, shape, device and value of every state entry, on every rank. The
    0-dim `gain` has a plain 0-dim `step` and 0-dim DTensor state of the same shape."""
    for before, after, differ in ranks2.run(ckpt_ranks.optimizer_state_roundtrip, str(tmp_path), optimizer=optimizer):
        assert before["gain.step"][0] == "Tensor"
        assert {v[0] for k, v in before.items() if k.startswith("gain.")} == {"Tensor", "DTensor"}
        assert after == before
        assert differ == []


def test_dtensor_state_laid_out_unlike_its_parameter_is_refused_at_save(ranks2, tmp_path):
    for message in ranks2.run(ckpt_ranks.save_state_unlike_parameter, str(tmp_path)):
        assert re.search(r"optimizer state optim\.linear\.weight\.replicated is a DTensor \(6, 4\)", message), message
        assert "laid out like its parameter only" in message
