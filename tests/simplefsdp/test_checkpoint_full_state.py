"""Full state dicts: export to safetensors for the plain model, import by scattering from rank 0.

2 gloo ranks. The transformer's vocabulary (67) shards unevenly;
the tied variant shares the embedding with the output head. Peak memory is measured in fresh
processes by `_ckpt_memory.py`.
"""

from __future__ import annotations

import json
import pickle

import pytest
import safetensors.torch
import torch

from simplefsdp import checkpoint
from simplefsdp.models import Transformer
from tests.simplefsdp import _ckpt_full as ckpt_full
from tests.simplefsdp import _ckpt_memory as ckpt_memory
from tests.simplefsdp import _training as training


def _plain(tied: bool = False, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ckpt_full.TIED if tied else training.ARGS)


@pytest.mark.parametrize(
    ("strategy", "tied", "max_shard_bytes"),
    [("FULL_SHARD", False, 2**30), ("FULL_SHARD", True, 8 * 2**10), ("NO_SHARD", False, 2**30)],
)
def test_export_loads_into_the_plain_model(ranks2, tmp_path, strategy, tied, max_shard_bytes):
    gathered = ranks2.run(
        ckpt_full.export, str(tmp_path), strategy=strategy, max_shard_bytes=max_shard_bytes, tied=tied
    )[0]
    plain = _plain(tied)
    assert set(gathered) == set(plain.state_dict()), "the unwrapped model's names"
    if max_shard_bytes < 2**30:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert len(files) > 1
        assert {p.name for p in tmp_path.glob("*.safetensors")} == files
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
        assert safetensors.torch.load_file(tmp_path / "model.safetensors").keys() == plain.state_dict().keys()
    plain.load_state_dict(checkpoint.load_full_state_dict(tmp_path), strict=True)
    for fqn, value in plain.state_dict().items():
        assert torch.equal(value, gathered[fqn]), fqn
    assert not torch.equal(plain.state_dict()["norm.weight"], _plain(tied).state_dict()["norm.weight"]), "trained"


@pytest.mark.parametrize("file_format", ["safetensors", "torch"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_import_scatters_into_a_meta_built_model(ranks2, tmp_path, strategy, file_format):
    """HYBRID_SHARD on 2 ranks is a (replicate 2, shard 1) mesh: both replicas receive the full chunk."""
    expected = _plain(seed=5).state_dict()
    path = tmp_path / ("model.safetensors" if file_format == "safetensors" else "model.pt")
    if file_format == "safetensors":
        safetensors.torch.save_file(expected, path)
    else:
        torch.save(expected, path)
    for rank_state in ranks2.run(ckpt_full.import_, str(path), strategy=strategy):
        assert rank_state.keys() == expected.keys()
        for fqn, value in expected.items():
            assert torch.equal(rank_state[fqn], value), fqn


def test_import_reports_shapes_and_keys_on_every_rank(ranks2, tmp_path):
    state = _plain().state_dict()
    state["output.weight"] = torch.zeros(66, training.ARGS.dim)
    del state["norm.weight"]
    state["extra.weight"] = torch.zeros(2)
    safetensors.torch.save_file(state, tmp_path / "model.safetensors")
    errors = ranks2.run(ckpt_full.import_, str(tmp_path), strategy="FULL_SHARD")
    for error in errors:
        assert error.startswith("StateDictMismatchError")
        assert "output.weight: file (66, 32), model (67, 32)" in error
        assert "norm.weight: model (32,)" in error
        assert "extra.weight: file (2,)" in error


class _Payload:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_torch_files_are_loaded_with_weights_only(tmp_path):
    """One process, no process group: a torch file carrying a pickled payload is refused, unexecuted."""
    marker = tmp_path / "marker"
    torch.save({"weight": torch.zeros(2), "evil": _Payload(marker)}, tmp_path / "model.pt")
    with pytest.raises(checkpoint.CheckpointError, match="weights_only"):
        checkpoint.load_full_state_dict(tmp_path / "model.pt")
    assert not marker.exists()
    torch.load(tmp_path / "model.pt", weights_only=False)  # the control: full unpickling runs it
    assert marker.read_text() == "ran"
    (tmp_path / "bad.safetensors").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(checkpoint.CheckpointCorruptError, match="not a readable safetensors file"):
        checkpoint.load_full_state_dict(tmp_path / "bad.safetensors")


@pytest.mark.slow
def test_peak_memory_is_bounded(tmp_path):
    """Peak memory growth per rank (fresh processes, see `_ckpt_memory.py`) against the full model
    (72 MiB, largest parameter 4 MiB, 8 MiB files). Gathering the model on rank 0, or reading the file
    on every rank, would grow by >= the full model. Measured: import 0 / 2 MiB (rank 0 / 1: rank 0's
    reads are file-backed pages), export 31 / 18 MiB (the 8 MiB file, gather buffers, and freed heap
    memory glibc keeps). Bounds: a quarter of the model to import on rank 1 (its chunks), three
    quarters to export (left room for allocator noise, still below the full model)."""
    rows = ckpt_memory.measure(tmp_path, ckpt_memory.SMALL, world_size=2)
    full = rows[0].full_bytes
    assert rows[1].import_growth < 0.25 * full, rows
    assert rows[0].import_growth < 0.5 * full, rows
    for row in rows:
        assert row.export_growth < 0.75 * full, rows
