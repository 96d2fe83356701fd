"""A job's compile cache (`simplefsdp/compile_cache.py`, `simplefsdp/train/job_cache.py`,
`simplefsdp precompile`): the key and manifest, a stale or foreign entry refused in one line, the
flags; a warm restart and a resumed run hit every stage's cache and train bitwise as the cold run;
a job precompiled in one process serves both ranks of the job.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from simplefsdp.compile_cache import MANIFEST, CacheEntry, StageCounts, first_difference, job_key, job_manifest
from simplefsdp.train.config import ConfigError, TrainConfig, parse_args, to_toml
from simplefsdp.train.output import RunOutput
from tests.train import _compile_cache_ranks

MESH = (("dp", 2),)


def _entry(tmp_path, **settings) -> CacheEntry:
    manifest = job_manifest(TrainConfig(**settings), device_type="cpu", mesh=MESH)
    return CacheEntry.for_job(manifest=manifest, directory=str(tmp_path))


def test_the_key_follows_what_shapes_the_graphs_and_nothing_else():
    base = job_manifest(TrainConfig(), device_type="cpu", mesh=MESH)
    assert job_key(base) == job_key(job_manifest(TrainConfig(), device_type="cpu", mesh=MESH))
    same = TrainConfig(steps=7, lr=1e-4, seed=3, checkpoint_dir="x", resume=True, compile_cache="y", precompile=True)
    assert job_key(job_manifest(same, device_type="cpu", mesh=MESH)) == job_key(base)
    for other in (
        job_manifest(TrainConfig(dim=64), device_type="cpu", mesh=MESH),
        job_manifest(TrainConfig(param_dtype="bf16"), device_type="cpu", mesh=MESH),
        job_manifest(TrainConfig(backend="aot_eager"), device_type="cpu", mesh=MESH),
        job_manifest(TrainConfig(), device_type="cpu", mesh=(("dp", 4),)),
        job_manifest(TrainConfig(), device_type="cuda", mesh=MESH),
    ):
        assert job_key(other) != job_key(base)
    assert (bool(base["torch"]), bool(base["simplefsdp_pass"]), base["mesh"]) == (True, True, "dp=2")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("torch", "2.12.0", "torch: '2.12.0' there"),
        ("simplefsdp_pass", "0.1-old", "simplefsdp_pass: '0.1-old' there"),
        ("mesh", "dp=4", "mesh: 'dp=4' there, 'dp=2' in this job"),
        ("gather_dtype", "int8", "gather_dtype: 'int8' there, 'none' in this job"),
    ],
)
def test_a_foreign_entry_is_refused_in_one_line_and_emptied(tmp_path, caplog, field, value, reason):
    entry = _entry(tmp_path)
    entry.path.mkdir(parents=True)
    (entry.path / "fxgraph").mkdir()
    (entry.path / MANIFEST).write_text(json.dumps({**entry.manifest, field: value}))
    with caplog.at_level(logging.WARNING, logger="simplefsdp.compile_cache"):
        assert entry.open() is False
    (line,) = caplog.messages
    assert [reason in line, "refused" in line, "compiling afresh" in line, "\n" in line] == [True, True, True, False]
    assert not entry.path.exists(), "a refused entry is never served: emptied before the compile"


def test_a_sealed_entry_is_warm_and_a_named_directory_says_why_none_fits(tmp_path, caplog):
    entry = _entry(tmp_path)
    assert entry.open() is False
    with entry.active():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(entry.path)
    entry.seal()
    assert entry.open() is True
    assert json.loads((entry.path / MANIFEST).read_text())["mesh"] == "dp=2"
    other = _entry(tmp_path, n_layers=8)
    with caplog.at_level(logging.WARNING, logger="simplefsdp.compile_cache"):
        assert other.open() is False
    (line,) = caplog.messages
    assert f"no entry for this job ({entry.path.name}: n_layers: 4 there, 8 in this job)" in line


def test_first_difference_and_counts():
    assert first_difference({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    assert first_difference({"a": 1, "b": 3}, {"a": 1, "b": 2}) == "b: 3 there, 2 in this job"
    assert first_difference({"a": 1, "z": 0}, {"a": 1}) == "z: 0 there, absent in this job"
    now = StageCounts(fxgraph_hits=5, autograd_hits=2, dynamo_frames=1, dynamo_s=2.5, backend_s=4.0)
    counts = now.since(StageCounts(fxgraph_hits=3, dynamo_s=1.0, backend_s=1.0))
    assert counts.line() == (
        "inductor fxgraph 2 hits / 0 misses, aot_autograd 2 hits / 0 misses (3.0 s in the backend); "
        "dynamo traced 1 graphs (1.5 s)"
    )


def test_flags_and_config_file_round_trip(tmp_path):
    config = parse_args(["--compile-cache", "ship", "--precompile"])
    assert (config.compile_cache, config.precompile) == ("ship", True)
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    assert parse_args(["--config", str(path)]) == config
    with pytest.raises(ConfigError, match="backend eager compiles none"):
        parse_args(["--backend", "eager", "--precompile"])


@pytest.mark.parametrize("label", ["compile (cold)", "compile (warm)"])
def test_the_compiling_step_says_cold_or_warm(tmp_path, caplog, label):
    out = RunOutput(TrainConfig(progress=False, run_dir=str(tmp_path)), start=0, enabled=True, compiling=label)
    with caplog.at_level(logging.INFO, logger="simplefsdp.train.output"):
        out.step({"step": 1, "loss": 4.0, "seconds": 9.0, "tokens_per_s": 7.0}, compiling=True)
    out.close()
    assert caplog.messages == [f"step 1: loss 4.0000, {label} (9.00s)"]


def test_precompile_help_and_eager_refusal(capsys):
    from simplefsdp.cli import main

    assert main(["precompile", "--help"]) == 0
    assert "simplefsdp precompile" in capsys.readouterr().out
    assert main(["precompile", "--backend", "eager"]) == 2
    assert "backend eager compiles nothing" in capsys.readouterr().err


def _hit_everything(record: dict) -> None:
    hits = (
        record["fxgraph_hits"] > 0,
        record["autograd_hits"] > 0,
        record["fxgraph_misses"],
        record["autograd_misses"],
    )
    assert hits == (True, True, 0, 0), record


@pytest.mark.slow
def test_a_warm_restart_and_a_resumed_run_hit_every_cache_and_train_bitwise(ranks2, tmp_path):
    cache = str(tmp_path / "cache")
    cold = ranks2.run(_compile_cache_ranks.train_job, str(tmp_path / "cold"), cache)
    warm = ranks2.run(_compile_cache_ranks.train_job, str(tmp_path / "warm"), cache)
    for record in (r["cache"] for r in cold):
        assert (record["warm"], record["fxgraph_misses"] > 0, record["autograd_misses"] > 0) == (False, True, True)
    for rank in warm:
        assert (rank["cache"]["warm"], rank["cache"]["key"]) == (True, cold[0]["cache"]["key"])
        _hit_everything(rank["cache"])
    assert warm[0]["losses"] == cold[0]["losses"], "the warm step's loss is bitwise the cold one's"
    assert list(warm[0]["digests"].values()) == list(cold[0]["digests"].values()), "bitwise the same parameters"
    resumed = ranks2.run(_compile_cache_ranks.train_job, str(tmp_path / "warm"), cache, steps=2, resume=True)
    for rank in resumed:
        _hit_everything(rank["cache"])
    summary = json.loads((tmp_path / "warm/ckpt/run/metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert (summary["compile_cache"]["key"], summary["collectives"] > 0) == (cold[0]["cache"]["key"], True)


@pytest.mark.slow
def test_a_job_precompiled_in_one_process_serves_both_ranks(ranks2, tmp_path):
    """`--precompile`: local rank 0 runs `simplefsdp precompile` for the job (one process, the fake
    group) into an empty directory while rank 1 waits; then both ranks load it: one compile per job."""
    cache = str(tmp_path / "shipped")
    ranks = ranks2.run(_compile_cache_ranks.train_job, str(tmp_path / "run"), cache, precompile=True)
    assert [(rank["cache"]["warm"], rank["cache"]["precompiled"]) for rank in ranks] == [(False, True)] * 2
    _hit_everything(ranks[0]["cache"])
    _hit_everything(ranks[1]["cache"])
