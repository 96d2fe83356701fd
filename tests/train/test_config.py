"""`simplefsdp train`'s settings and data, in this process (nothing is spawned): precedence of
defaults / TOML / flags, every kind of bad input exiting 2 with a message that names it, and the
batch iterator's determinism and resumability."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from simplefsdp.cli import main as simplefsdp_main
from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.train.config import ConfigError, TrainConfig, check_world, parse_args
from simplefsdp.train.data import TokenBatches, split


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nstrategy = "SHARD_GRAD_OP"\nlr = 1\nprogress = false\n')
    config = parse_args(["--config", str(path), "--steps", "9", "--tp", "2"])
    assert (config.steps, config.strategy, config.tp, config.lr, config.progress) == (9, "SHARD_GRAD_OP", 2, 1.0, False)
    assert config.n_layers == TrainConfig().n_layers
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 3


def _write(tmp_path, text: str | None) -> str:
    path = tmp_path / "bad.toml"
    if text is not None:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stepz", "3"], "unrecognized arguments: --stepz"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--strategy", "ZERO9"], "argument --strategy: invalid choice: 'ZERO9'"),
        (["--steps", "0"], "steps 0 (load, then export) needs export_dir"),
        (["--dim", "30"], "dim (30) must be n_heads (4) times an even head dim"),
        (["--tp", "3"], "tp (3) must divide n_heads"),
        (["--profile", "tpu9"], "profile: unknown device profile 'tpu9'"),
        (["--lr-schedule", "linear"], "argument --lr-schedule: invalid choice: 'linear'"),
        (["--lr", "nan"], "lr and bucket_cap_mib must be positive; got nan and 64.0"),
        (["--warmup-steps", "-1"], "warmup_steps must be >= 0; got -1"),
        (["--warmup-steps", "101"], "warmup_steps (101) must be at most steps (100)"),
        (["--grad-clip", "-1"], "grad_clip must be a finite number >= 0 (0: off); got -1.0"),
        (["--grad-clip", "nan"], "grad_clip must be a finite number >= 0 (0: off); got nan"),
        (["--eval-every", "-1"], "eval_every must be >= 0 (0: off); got -1"),
        (["--gather-dtype", "int4"], "argument --gather-dtype: invalid choice: 'int4'"),
        (
            ["--gather-dtype", "int8", "--gather-block", "100"],
            "gather_block must be a power of two from 8 to 8192, got 100",
        ),
        (["--gather-dtype", "int8", "--gather-block", "16384"], "gather_block must be a power of two from 8 to 8192"),
        (
            ["--gather-dtype", "int8", "--gather-block", "4"],
            "gather_block must be a power of two from 8 to 8192, got 4",
        ),
        (["--gather-block", "64"], "gather_block (64) is for a quantized gather_dtype; got none"),
        (
            ["--gather-dtype", "int8", "--strategy", "NO_SHARD"],
            "gather_dtype int8 quantizes the parameter all-gathers; strategy NO_SHARD has none",
        ),
        (
            ["--gather-dtype", "float8_e4m3fn", "--backend", "eager"],
            "gather_dtype float8_e4m3fn quantizes the compiled step's all-gathers; backend eager compiles none",
        ),
        (["--sample-tokens", "-2"], "sample_tokens must be >= 0 (0: off); got -2"),
        (["--seq-len", "700"], "seq_len (700) must be shorter than the corpus's training part (49 of 750 tokens; 701"),
        (["--config", "{missing}"], "cannot read config file {missing}: No such file or directory"),
        (["--config", "{directory}"], "cannot read config file {directory}"),
        (["--config", "{file}"], "is not valid TOML"),
        (["--export-dir", "{file}/export"], "export_dir {file}/export: {file} is a file, not a directory"),
        (["--checkpoint-dir", "{file}/ckpt"], "checkpoint_dir {file}/ckpt: {file} is a file, not a directory"),
        (["--metrics-file", "{missing}/m.jsonl"], "metrics_file {missing}/m.jsonl: directory {missing} does not exist"),
    ],
)
def test_bad_input_exits_2_naming_it(tmp_path, capsys, argv, expected):
    names = {"missing": str(tmp_path / "nope.toml"), "directory": str(tmp_path), "file": _write(tmp_path, "steps =\n")}
    argv = [a.format(**names) for a in argv]
    assert simplefsdp_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert expected.format(**names) in err
    assert "Traceback" not in err
    assert err.startswith("simplefsdp train: error:")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('steps = "ten"\n', "steps must be int, got str 'ten'"),
        ("progress = 1\n", "progress must be bool, got int 1"),
        ("n_layer = 3\n", "unknown keys ['n_layer']"),
        ("[optim]\nlr = 0.1\n", "unknown keys ['optim']"),
        ("[model]\ndim = 64\n", "model must be str, got dict {'dim': 64}"),
        ("n_heads = 5\n", "dim (128) must be n_heads (5) times an even head dim"),
        ('gather_dtype = "fp8"\n', "gather_dtype must be one of none, int8, float8_e4m3fn; got 'fp8'"),
        ('gather_dtype = "int8"\ngather_block = 96\n', "gather_block must be a power of two from 8 to 8192, got 96"),
    ],
)
def test_bad_config_file_names_the_file_and_key(tmp_path, capsys, text, expected):
    path = _write(tmp_path, text)
    assert simplefsdp_main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert path in err
    assert "Traceback" not in err


@pytest.mark.parametrize("gather", ["int8", "float8_e4m3fn"])
def test_gather_flags_build_the_quantized_policy(tmp_path, gather):
    from simplefsdp.train.loop import mp_policy

    config = parse_args(["--param-dtype", "bf16", "--reduce-dtype", "fp32", "--gather-dtype", gather])
    assert mp_policy(config) == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, gather_dtype=gather, gather_block=128
    )
    path = tmp_path / "run.toml"
    path.write_text(f'gather_dtype = "{gather}"\ngather_block = 64\n')
    assert mp_policy(parse_args(["--config", str(path)])).gather_block == 64
    assert mp_policy(TrainConfig()).gather_dtype is None  # none: the gather runs in param_dtype


def test_world_checks():
    check_world(TrainConfig(tp=2), 4)
    with pytest.raises(ConfigError, match=r"tp \(2\) must divide the world size \(3\)"):
        check_world(TrainConfig(tp=2), 3)
    with pytest.raises(ConfigError, match=r"shard_size \(3\) must divide the data-parallel size \(4\)"):
        check_world(TrainConfig(strategy="HYBRID_SHARD", shard_size=3), 4)


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    """A second run into the same checkpoint directory would mix two runs' checkpoints: refused before spawning."""
    step = tmp_path / "step_000000003"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    assert simplefsdp_main(["train", "--checkpoint-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints (newest: step_000000003)" in err
    assert "--resume" in err


def _batches(dp_rank: int, dp_size: int, batch_per_rank: int) -> TokenBatches:
    return TokenBatches(seq_len=16, batch_per_rank=batch_per_rank, dp_rank=dp_rank, dp_size=dp_size, seed=5)


def test_global_batch_independent_of_world_size():
    whole = next(_batches(0, 1, 8))
    for world in (2, 4):
        parts = [next(_batches(rank, world, 8 // world)) for rank in range(world)]
        assert torch.equal(torch.cat(parts), whole)
    assert whole.shape == (8, 17)


def test_resumed_batches_continue_the_sequence():
    straight = _batches(1, 2, 4)
    expected = [next(straight) for _ in range(5)]
    first = _batches(1, 2, 4)
    for _ in range(3):
        next(first)
    resumed = _batches(1, 2, 4)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(next(resumed), e) for e in expected[3:])
    other = TokenBatches(seq_len=16, batch_per_rank=4, dp_rank=1, dp_size=2, seed=6)
    with pytest.raises(ValueError, match="data order"):
        other.load_state_dict(first.state_dict())


def test_training_batches_draw_from_the_head_only():
    """[Note: the held-out tail]: the last tenth (at least one window) is never drawn for training."""
    ids = torch.arange(750)  # each token its position
    head, tail = split(ids, seq_len=16)
    assert torch.equal(tail, ids[675:])
    assert len(split(ids, seq_len=99)[1]) == 100, "one window of seq_len + 1 when a tenth is less"
    drawn = torch.cat(
        [next(TokenBatches(seq_len=16, batch_per_rank=64, dp_rank=0, dp_size=1, seed=s, ids=ids)) for s in range(20)]
    )
    assert int(drawn.max()) == len(head) - 1, "up to the head's last token, not into the tail"
    assert int(drawn.min()) == 0


def test_help_exits_0(capsys):
    assert simplefsdp_main(["train", "--help"]) == 0
    assert "--checkpoint-every" in capsys.readouterr().out
