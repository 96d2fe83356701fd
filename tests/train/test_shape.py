"""`simplefsdp train --shape`: a named shape's sizes as defaults that flags and files override, the
bad combinations, the fit check before any rank starts, and (slow) a shape trained on 2 ranks,
materialized sharded with the values one process would draw."""

from __future__ import annotations

import importlib

import pytest
import torch

from simplefsdp.cli import main as simplefsdp_main
from simplefsdp.inspect.shapes import model_shape
from simplefsdp.train import fit
from simplefsdp.train.config import ConfigError, parse_args, shape_of

GIB = 2**30
HERE = {"world_size": 2, "device_type": "cpu", "ranks_here": 2}
launch = importlib.import_module("simplefsdp.train.launch")  # the package's `launch` is the function


def test_a_shape_sets_the_sizes_and_flags_and_the_file_override_them(tmp_path):
    config = parse_args(["--shape", "llama3-8b", "--n-layers", "2"])
    assert (config.dim, config.n_layers, config.n_heads, config.ffn_dim) == (4096, 2, 32, 14336)
    shape = shape_of(config)
    assert (shape.args.vocab_size, shape.n_kv_heads, shape.args.max_seq_len) == (128256, 8, config.seq_len)
    path = tmp_path / "run.toml"
    path.write_text('shape = "llama3-8b"\nffn_dim = 1024\n')
    from_file = parse_args(["--config", str(path), "--dim", "512"])
    assert (from_file.dim, from_file.n_layers, from_file.n_heads, from_file.ffn_dim) == (512, 32, 32, 1024)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--shape", "llama9"], "shape: unknown model shape 'llama9'; known:"),
        (["--shape", "tiny", "--model", "x:y"], "shape ('tiny') and model ('x:y') each name the model"),
        (["--shape", "llama3-8b", "--tp", "16"], "tp (16) must divide shape 'llama3-8b''s key / value heads (8)"),
        (["--shape", "llama3-8b", "--n-heads", "12", "--dim", "4608"], "must be a multiple of its key / value heads"),
        (["--shape", "llama3.2-1b", "--tp", "2"], "ties its output head to the embedding"),
    ],
)
def test_bad_shape_settings_exit_2_naming_them(capsys, argv, expected):
    assert simplefsdp_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert err.count("\n") == 1


def test_the_fit_check_counts_shards_gradients_adamw_state_and_a_gathered_block():
    """llama3-8b (4 of its blocks) at world 2, FULL_SHARD in fp32: 16 bytes per parameter over 2
    ranks, plus the largest block gathered; SHARD_GRAD_OP keeps every block gathered."""
    argv = ["--shape", "llama3-8b", "--n-layers", "4"]
    config = parse_args(argv)
    model = model_shape("llama3-8b").build(n_layers=4)
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.layers[0].parameters())
    needed = fit.needed_bytes(config, world_size=2, device_type="cpu")
    assert needed == pytest.approx(16 * params / 2 + 4 * block, rel=1e-4)
    kept = fit.needed_bytes(parse_args([*argv, "--strategy", "SHARD_GRAD_OP"]), world_size=2, device_type="cpu")
    assert kept == pytest.approx(needed + 3 * 4 * block, rel=1e-4)
    assert fit.needed_bytes(config, world_size=4, device_type="cpu") < needed


def test_a_shape_too_large_is_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path):
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run_on_ranks", no_ranks)
    monkeypatch.setattr(fit, "available_bytes", lambda **kwargs: 11 * GIB)  # 22 GiB for the 2 ranks
    argv = ["train", "--shape", "llama3-8b", "--device", "cpu", "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert simplefsdp_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("simplefsdp train: error: shape llama3-8b needs at least 60.6 GiB per rank at world 2 ")
    assert "this machine has 22.0 GiB available for 2 CPU ranks (11.0 GiB each)" in err
    monkeypatch.undo()
    # this machine's own memory: 8 blocks of llama3-405b need over 200 GiB per rank at world 2
    with pytest.raises(ConfigError, match=r"needs at least 2\d\d\.\d GiB per rank .* this machine has"):
        fit.check_fits(parse_args(["--shape", "llama3-405b", "--n-layers", "8"]), **HERE)
    fit.check_fits(parse_args(["--shape", "tiny"]), **HERE)  # fits


def _trained_shards(argv: list[str]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """On a pool rank: the shape's model as `train` builds it; the loop's steps; this rank's shards."""
    import torch.distributed as dist

    from simplefsdp.train.loop import build_model, train

    config = parse_args(argv)
    setup = build_model(config, torch.device("cpu"))
    shards = [(name, p.to_local().detach().clone()) for name, p in setup.model.named_parameters()]
    outcome = train(config, device=torch.device("cpu"))
    return dist.get_rank(), shards, outcome.end_step


@pytest.mark.slow
def test_a_shape_trains_from_shards_that_are_the_single_process_init(ranks2, tmp_path):
    """`--shape tiny` on 2 ranks: each rank holds half of each parameter (rows), the shards together
    are the values `Transformer(args)` draws in one process with the same seed, and the run trains."""
    argv = ["--shape", "tiny", "--seq-len", "16", "--steps", "2", "--backend", "eager", "--no-progress"]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    results = ranks2.run(_trained_shards, argv)
    torch.manual_seed(0)
    reference = dict(shape_of(parse_args(argv)).build(device="cpu").named_parameters())
    for name, full in reference.items():
        parts = [dict(shards)[name] for _, shards, _ in sorted(results, key=lambda r: r[0])]
        assert parts[0].shape[0] == -(-full.shape[0] // 2), name
        torch.testing.assert_close(torch.cat(parts), full, rtol=0, atol=0)
    assert all(steps == 2 for _, _, steps in results)
