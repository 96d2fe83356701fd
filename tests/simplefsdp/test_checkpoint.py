"""Sharded checkpoints (simplefsdp.checkpoint): bitwise resume, resharding, atomic writes, bad input.

Multi-rank tests run the resumable job of `_ckpt.py` on gloo rank pools (2 ranks; 4 to save
before resharding, and as a 2x2 mesh for HYBRID_SHARD). The file-format tests (interrupted
saves, corruption, mismatches, pickles) need no process group: the checkpoint functions run in
one plain process too, on a plain model.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from simplefsdp import checkpoint
from simplefsdp.checkpoint import manifest, optim_state, sharded
from simplefsdp.checkpoint.safe_reader import METADATA_NAME, SafeFileSystemReader, read_metadata
from tests.simplefsdp import _ckpt as ckpt

STEPS, STOP = 5, 3  # resume: STOP steps, save, fresh processes, load, STEPS - STOP steps
ONE_D = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
# every strategy on 2 ranks: HYBRID_* on a (replicate 2, shard 1) and a (replicate 1, shard 2) mesh
RESUMED = {s: {"strategy": s} for s in ONE_D} | {
    "HYBRID_SHARD": {"strategy": "HYBRID_SHARD", "shape": (2, 1)},
    "HYBRID_SHARD_ZERO2": {"strategy": "HYBRID_SHARD_ZERO2", "shape": (1, 2)},
}


def _assert_same_state(actual: ckpt.Run, expected: ckpt.Run) -> None:
    assert actual.params.keys() == expected.params.keys()
    assert actual.optim.keys() == expected.optim.keys()
    for name, value in [*expected.params.items(), *expected.optim.items()]:
        got = actual.params.get(name, actual.optim.get(name))
        assert torch.equal(got, value), f"{name} differs"


@pytest.mark.slow
def test_resume_is_bitwise_for_every_strategy(ranks2, tmp_path):
    """STEPS uninterrupted == STOP steps, save, new processes, load, the rest: bitwise in fp32.

    Negative control: resuming without restoring the RNG states (the token masks then differ)
    must not match, so the comparison can fail."""
    roots = {name: str(tmp_path / name) for name in RESUMED}
    ranks2.run(ckpt.train_many, [(roots[n], {**kw, "steps": STEPS, "stop_at": STOP}) for n, kw in RESUMED.items()])
    shutil.copytree(roots["FULL_SHARD"], tmp_path / "no-rng")
    ranks2.close()  # fresh processes: nothing survives but the files

    jobs = [(roots[name], {**kwargs, "steps": STEPS}) for name, kwargs in RESUMED.items()]
    jobs += [(None, {**kwargs, "steps": STEPS}) for kwargs in RESUMED.values()]  # uninterrupted
    jobs.append((str(tmp_path / "no-rng"), {"strategy": "FULL_SHARD", "steps": STEPS, "restore_rng": False}))
    runs = ranks2.run(ckpt.train_many, jobs)[0]
    resumed, uninterrupted, no_rng = runs[: len(RESUMED)], runs[len(RESUMED) : 2 * len(RESUMED)], runs[-1]
    for name, got, expected in zip(RESUMED, resumed, uninterrupted, strict=True):
        assert got.start_step == STOP, name
        assert got.losses == expected.losses[STOP:], name
        assert got.data_offset == expected.data_offset, name
        _assert_same_state(got, expected)
    assert no_rng.params["tok_embeddings.weight"].ne(uninterrupted[0].params["tok_embeddings.weight"]).any()


@pytest.mark.slow
def test_load_reshards(ranks2, ranks4, tmp_path):
    """Saved on 4 ranks FULL_SHARD; loaded on 2 ranks (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), on
    4 ranks as HYBRID_SHARD (2x2) and as FULL_SHARD over dp 2 x tensor parallel 2: the full
    parameters and optimizer state are the saved ones, bitwise."""
    root = str(tmp_path)
    saved = ranks4.run(ckpt.train, root, strategy="FULL_SHARD", steps=2)[0]
    loaded = ranks2.run(ckpt.train_many, [(root, {"strategy": s, "steps": 2}) for s in ONE_D])[0]
    loaded.append(ranks4.run(ckpt.train, root, strategy="HYBRID_SHARD", steps=2)[0])
    loaded.append(ranks4.run(ckpt.train, root, strategy="FULL_SHARD", steps=2, tp=2)[0])
    for run in loaded:
        assert (run.start_step, run.data_offset) == (2, saved.data_offset)
        _assert_same_state(run, saved)


# ---- one process, plain model: the file format ----


def _plain_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, **kwargs) -> Path:
    model, optimizer = _plain_model()
    with torch.no_grad():
        model[0].weight.fill_(step)  # tell checkpoints apart by their values
    return checkpoint.save_checkpoint(root, step=step, model=model, optimizer=optimizer, **kwargs)


def _loaded_step(path: Path, **kwargs) -> checkpoint.LoadedCheckpoint:
    model, optimizer = _plain_model()
    result = checkpoint.load_checkpoint(path, model=model, optimizer=optimizer, **kwargs)
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, result.step))
    return result


def test_roundtrip_restores_optimizer_extra_and_rng(tmp_path):
    model, optimizer = _plain_model()
    torch.manual_seed(123)
    checkpoint.save_checkpoint(tmp_path, step=7, model=model, optimizer=optimizer, extra={"data_offset": 96})
    expected_draw = torch.rand(3)
    fresh, fresh_optimizer = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), None
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)  # state empty, other lr
    result = checkpoint.load_checkpoint(tmp_path, model=fresh, optimizer=fresh_optimizer)
    assert (result.step, result.extra, result.saved_world_size) == (7, {"data_offset": 96}, 1)
    assert torch.equal(torch.rand(3), expected_draw)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert restored["param_groups"] == saved["param_groups"]  # lr 0.1 came back, betas a tuple again
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(restored["state"][index][key], value), (index, key)


def test_interrupted_save_leaves_previous_loadable_and_is_cleaned_up(tmp_path):
    _save(tmp_path, 1)
    with (
        mock.patch.object(sharded, "write_manifest", side_effect=RuntimeError("simulated crash")),
        pytest.raises(RuntimeError, match="simulated crash"),
    ):
        _save(tmp_path, 2)
    assert (tmp_path / "step_000000002.tmp").is_dir(), "the interrupted save's data was written"
    assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step_000000001"]
    assert _loaded_step(tmp_path).step == 1
    _save(tmp_path, 3)
    assert not (tmp_path / "step_000000002.tmp").exists(), "the next save removes the leftover"


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_000000004", "step_000000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005"]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _number_as_entry(path: Path) -> None:
    document = json.loads(path.read_text())
    document["files"]["train_state.json"] = 5
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("damage", "target", "expected"),
    [
        (_truncate, "__0_0.distcp", r"__0_0\.distcp: \d+ bytes, the manifest says \d+ \(truncated"),
        (_flip_byte, "__0_0.distcp", r"__0_0\.distcp: SHA-256 differs"),
        (_flip_byte, METADATA_NAME, r"\.metadata: SHA-256 differs"),
        (Path.unlink, "train_state.json", r"train_state\.json: missing"),
        (lambda p: p.write_text("{not json"), "manifest.json", r"manifest\.json: unreadable"),
        (_number_as_entry, "manifest.json", r"manifest\.json: not a simplefsdp-checkpoint manifest"),
    ],
)
def test_corrupt_checkpoint_is_detected_with_optional_fallback(tmp_path, damage, target, expected):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    damage(newest / target)
    with pytest.raises(checkpoint.CheckpointCorruptError, match=expected):
        _loaded_step(tmp_path, fallback=False)
    result = _loaded_step(tmp_path)  # fallback=True: the previous checkpoint
    assert result.step == 1
    assert len(result.skipped) == 1
    assert result.skipped[0].startswith(str(newest))


def test_missing_checkpoint(tmp_path):
    model, optimizer = _plain_model()
    assert checkpoint.load_checkpoint(tmp_path, model=model, missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.load_checkpoint(tmp_path, model=model, optimizer=optimizer)


def test_mismatch_lists_keys_and_shapes(tmp_path):
    _save(tmp_path, 1)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2), nn.Linear(2, 2))
    with pytest.raises(checkpoint.StateDictMismatchError) as info:
        checkpoint.load_checkpoint(tmp_path, model=other)
    message = str(info.value)
    for line in [
        "model.3.weight: model (2, 2) torch.float32",  # missing from the checkpoint
        "model.0.weight: checkpoint (3, 4) torch.float32, model (5, 4) torch.float32",
        "model.0.bias: checkpoint (3,) torch.float32, model (5,) torch.float32",
        "model.2.weight: checkpoint (2, 3) torch.float32, model (2, 5) torch.float32",
    ]:
        assert line in message
    assert info.value.missing == [
        "model.3.weight: model (2, 2) torch.float32",
        "model.3.bias: model (2,) torch.float32",
    ]

    smaller = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(checkpoint.StateDictMismatchError, match=r"model\.2\.weight: checkpoint \(2, 3\)"):
        checkpoint.load_checkpoint(tmp_path, model=smaller)
    checkpoint.load_checkpoint(tmp_path, model=smaller, strict=False)  # unexpected keys skipped
    assert torch.equal(smaller[0].weight, torch.ones(3, 4))


def test_extra_must_be_json(tmp_path):
    model, _ = _plain_model()
    with pytest.raises(TypeError, match=r"extra\.sampler is a object"):
        checkpoint.save_checkpoint(tmp_path, step=1, model=model, extra={"sampler": object()})


class _Payload:
    """Unpickling this writes a marker file: proof that pickled code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_metadata_is_never_unpickled_freely(tmp_path):
    """A `.metadata` naming a callable outside DCP's metadata classes is refused, even when the
    manifest was rewritten to match it (checksums catch corruption, the allow-list forgery)."""
    path = _save(tmp_path, 1)
    marker = tmp_path / "marker"
    (path / METADATA_NAME).write_bytes(pickle.dumps(_Payload(marker)))
    manifest.write_manifest(path, step=1)
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"builtins\.exec"):
        _loaded_step(path, fallback=False)
    assert not marker.exists()


def test_pickled_objects_are_refused_by_the_reader(tmp_path):
    """DCP stores non-tensor values as pickles and its default planner unpickles them with
    weights_only=False. Our reader refuses them; torch's own runs the payload (the control)."""
    marker = tmp_path / "marker"
    dcp.save({"obj": _Payload(marker)}, checkpoint_id=tmp_path / "raw", no_dist=True)
    with pytest.raises(dcp.CheckpointException, match=r"stores \['obj'\] as pickled objects"):
        dcp.load({"obj": None}, storage_reader=SafeFileSystemReader(tmp_path / "raw"), no_dist=True)
    assert not marker.exists()
    dcp.load({"obj": None}, checkpoint_id=tmp_path / "raw", no_dist=True)  # torch's FileSystemReader
    assert marker.read_text() == "ran"


def _without_layouts(path: Path) -> None:
    """Make `path` look saved before optimizer state layouts were recorded (manifest rewritten)."""
    state = json.loads((path / "train_state.json").read_text())
    del state["optimizer"]["layouts"]
    (path / "train_state.json").write_text(json.dumps(state))
    manifest.write_manifest(path, step=1)


def test_checkpoint_without_recorded_layouts_still_loads(tmp_path):
    model, optimizer = _plain_model()
    _without_layouts(checkpoint.save_checkpoint(tmp_path, step=1, model=model, optimizer=optimizer))
    fresh, fresh_optimizer = _plain_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_optimizer.state.clear()
    checkpoint.load_checkpoint(tmp_path, model=fresh, optimizer=fresh_optimizer)
    saved, restored = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for index, state in saved.items():
        for key, value in state.items():
            assert torch.equal(restored[index][key], value), (index, key)


def test_plain_state_is_allocated_on_the_cpu_or_its_parameters_device(tmp_path):
    """Adam's `step` lives on the CPU whatever its parameter's device (unless capturable or fused),
    other state with its parameter. With parameters on the meta device (a device other than the
    CPU on a machine without an accelerator), the load targets follow the recorded layouts."""
    path = _save(tmp_path, 1)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    metadata = read_metadata(path)
    layouts = {key: "cpu" if key.endswith(".step") else "device" for key in metadata.state_dict_metadata}
    targets, unexpected = optim_state.allocate_targets(model, optimizer, metadata, layouts=layouts, source=path)
    assert unexpected == []
    assert {key: t.device.type for key, t in targets.items()} == {
        key: "cpu" if key.endswith(".step") else "meta" for key in layouts if key.startswith("optim.")
    }
