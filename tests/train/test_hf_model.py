"""`simplefsdp train --model` / `--init-from` / `--config accelerate.yaml`: Hugging Face causal LMs
built from a config directory, weights from a local safetensors checkpoint, Accelerate's settings.

Fast: every bad input is one line naming it, found before any rank is spawned (the model is built
on the meta device); the tokens (characters, or the directory's tokenizer); Accelerate settings as
flags; `--init-from` on 2 gloo ranks from `save_pretrained`'s layouts (one file, shards + index, tied
embeddings saved once). Slow: the command end to end on a config directory with an Accelerate file,
then the export -> `--init-from` round trip (bitwise).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from simplefsdp.cli import main as simplefsdp_main
from simplefsdp.train import hf_model
from simplefsdp.train.config import TrainConfig, parse_args
from simplefsdp.train.data import CORPUS, VOCAB, encode, split
from simplefsdp.train.evaluate import HeldOut
from tests.hf._tiny import llama_config
from tests.train import _hf_ranks

ACCELERATE_YAML = """\
distributed_type: FSDP
mixed_precision: 'no'
num_processes: 2
fsdp_config:
  fsdp_sharding_strategy: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_forward_prefetch: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_activation_checkpointing: true
"""


@pytest.fixture
def llama_dir(tmp_path):
    llama_config(max_position_embeddings=32).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _error(capsys, *argv: str) -> str:
    assert simplefsdp_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("simplefsdp train: error:")
    assert err.count("\n") == 1, f"one line: {err!r}"
    return err


def test_bad_models_and_checkpoints_are_one_line_naming_them(tmp_path, llama_dir, capsys):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert "no module of class GPT2Block in LlamaForCausalLM" in _error(
        capsys, "--model", str(llama_dir), "--layer-classes", "GPT2Block", *ckpt
    )
    transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1]).save_pretrained(tmp_path / "resnet")
    assert "ResNetConfig (model_type 'resnet') is not a causal LM" in _error(
        capsys, "--model", str(tmp_path / "resnet"), *ckpt
    )
    (tmp_path / "empty").mkdir()
    assert "no config.json there (nothing is downloaded)" in _error(capsys, "--model", str(tmp_path / "empty"), *ckpt)
    assert "No module named 'no_such_module'" in _error(capsys, "--model", "no_such_module:build", *ckpt)
    llama_config(vocab_size=len(VOCAB) - 1).save_pretrained(tmp_path / "small")
    assert f"a vocabulary of {len(VOCAB) - 1} is smaller than the corpus's {len(VOCAB)} characters" in _error(
        capsys, "--model", str(tmp_path / "small"), *ckpt
    )
    # a checkpoint lacking two of the model's tensors, and one with a tensor of another shape
    state = transformers.LlamaForCausalLM(llama_config()).state_dict()
    (tmp_path / "partial").mkdir()
    save_file(
        {k: v for k, v in state.items() if k not in ("lm_head.weight", "model.norm.weight")},
        tmp_path / "partial" / "model.safetensors",
    )
    assert "2 tensors missing for the model: model.norm.weight, lm_head.weight" in _error(
        capsys, "--model", str(llama_dir), "--init-from", str(tmp_path / "partial"), *ckpt
    )
    (tmp_path / "other").mkdir()
    save_file({**state, "model.norm.weight": torch.ones(7)}, tmp_path / "other" / "model.safetensors")
    assert "1 tensors of another shape for the model: model.norm.weight (7,) vs (32,)" in _error(
        capsys, "--model", str(llama_dir), "--init-from", str(tmp_path / "other"), *ckpt
    )
    assert "--init-from nowhere: no full state dict at nowhere" in _error(
        capsys, "--model", str(llama_dir), "--init-from", "nowhere", *ckpt
    )
    assert "tp (2) is for the built-in model" in _error(capsys, "--model", str(llama_dir), "--tp", "2", *ckpt)


def test_init_from_skips_keys_of_non_persistent_buffers_as_from_pretrained_does(tmp_path, llama_dir, capsys):
    """[Note: checkpoint keys of non-persistent buffers]: an older Llama save holds the rotary table of
    every attention module; `from_pretrained` loads it without an unexpected key, so does `--init-from`
    (the check, on the meta-device model). A key the model lacks otherwise is still refused."""
    model = transformers.LlamaForCausalLM(llama_config())
    inv_freq = model.model.rotary_emb.inv_freq
    older = {
        **model.state_dict(),
        "model.rotary_emb.inv_freq": inv_freq.clone(),
        **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(len(model.model.layers))},
    }
    (tmp_path / "older").mkdir()
    model.config.save_pretrained(tmp_path / "older")
    save_file(older, tmp_path / "older" / "model.safetensors")
    _, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "older", output_loading_info=True)
    assert not info["unexpected_keys"], "transformers ignores them"
    capsys.readouterr()  # its progress bar
    with torch.device("meta"):
        built = hf_model.build(str(llama_dir))
    hf_model.check_weights(built, str(tmp_path / "older"))
    (tmp_path / "bogus").mkdir()
    bogus = "model.layers.0.self_attn.bogus.inv_freq"  # the buffer's name, in another module
    save_file({**older, bogus: inv_freq.clone()}, tmp_path / "bogus" / "model.safetensors")
    argv = ["--model", str(llama_dir), "--init-from", str(tmp_path / "bogus"), "--checkpoint-dir", str(tmp_path / "c")]
    assert f"1 tensors unexpected for the model: {bogus}" in _error(capsys, *argv)


def test_tokens_are_characters_or_the_directory_tokenizer(llama_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = hf_model.build(str(llama_dir))
    assert model.config.use_cache is False
    assert torch.equal(hf_model.corpus_ids(str(llama_dir), model), encode(CORPUS))
    words = sorted(set(CORPUS.split()))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(llama_dir)
    ids = hf_model.corpus_ids(str(llama_dir), transformers.LlamaForCausalLM(llama_config(vocab_size=len(words) + 1)))
    assert ids.tolist() == [1 + words.index(w) for w in CORPUS.split()]
    # the end-of-run sample decodes with the same tokenizer, from any of the model's tokens
    held = HeldOut.of(TrainConfig(model=str(llama_dir), seq_len=8, batch_per_rank=1), ids, dp_rank=0, dp_size=1)
    assert held.limit is None
    assert held.decode(ids[:3].tolist()) == " ".join(CORPUS.split()[:3])
    head, _ = split(ids, seq_len=8)
    assert held.decode(held.prompt.tolist()) == " ".join(CORPUS.split()[len(head) :][:8]), "the tail's first words"


def test_a_module_function_builds_the_model(capsys):
    model = hf_model.build("tests.hf._tiny:llama")
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert torch.equal(hf_model.corpus_ids("tests.hf._tiny:llama", model), encode(CORPUS))
    assert "--model tests.hf._tiny:encoder returned a BertModel, not a causal LM" in _error(
        capsys, "--model", "tests.hf._tiny:encoder"
    )


def test_an_accelerate_file_sets_the_flags_flags_override_it(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_YAML)
    config = parse_args(["--config", str(path), "--steps", "3"])
    assert (config.strategy, config.layer_classes, config.prefetch_depth, config.steps) == (
        "SHARD_GRAD_OP",
        "LlamaDecoderLayer",
        1,
        3,
    )
    path.write_text(ACCELERATE_YAML.replace("fsdp_sync_module_states: true", "fsdp_offload_params: true"))
    assert parse_args(["--config", str(path)]).offload == "all"
    assert parse_args(["--config", str(path), "--offload", "none"]).offload == "none"


@pytest.mark.parametrize("shard_size", [None, "20KB"])
def test_init_from_reads_the_hugging_face_layouts(ranks2, tmp_path, shard_size):
    directory = tmp_path / "saved"
    results = ranks2.run(_hf_ranks.load_saved_pretrained, str(directory), shard_size)
    assert (directory / "model.safetensors.index.json").is_file() == (shard_size is not None)
    assert "lm_head.weight" not in load_file(next(directory.glob("*.safetensors"))), "tied: saved once"
    for rank_state in results:
        names = [k for k in rank_state if not k.startswith("saved.")]
        assert names
        for name in names:
            assert torch.equal(rank_state[name], rank_state[f"saved.{name}"]), name


def test_init_from_a_bf16_checkpoint_gives_fp32_masters(ranks2, tmp_path):
    """A bf16 config and checkpoint under `--param-dtype bf16`: the model is built in bf16 (the
    config's dtype) and its sharded masters are fp32, holding the checkpoint's values exactly."""
    state = ranks2.run(_hf_ranks.build_from_bf16, str(tmp_path / "saved"))[0]
    names = [k for k in state if not k.startswith("saved.")]
    assert names
    for name in names:
        assert state[f"saved.{name}"].dtype == torch.bfloat16, name
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], state[f"saved.{name}"].float()), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_config_directory_trains_and_its_export_round_trips(tmp_path, llama_dir):
    accelerate = tmp_path / "accelerate.yaml"
    accelerate.write_text(ACCELERATE_YAML)
    common = [
        sys.executable,
        "-m",
        "simplefsdp.cli",
        "train",
        "--seq-len",
        "16",
        "--batch-per-rank",
        "4",
        "--no-progress",
    ]
    first = subprocess.run(
        [*common, "--model", str(llama_dir), "--config", str(accelerate), "--steps", "3",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--export-dir", str(tmp_path / "export")],
        cwd=tmp_path, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    assert "trained steps 1-3" in first.stderr
    # SHARD_GRAD_OP from the file: per LlamaDecoderLayer (2) and per run of the rest (the embedding
    # before the layers, the norm + lm_head after them) one all-gather and one reduce-scatter (8), no
    # re-gather for backward; activation checkpointing from the file recomputes inside each layer's
    # nested region (simplefsdp/regions.py), which reads the gathered weights SHARD_GRAD_OP keeps
    assert "comm: 8 collectives/step" in first.stderr
    assert (tmp_path / "ckpt" / "step_000000003").is_dir()
    exported = load_file(tmp_path / "export" / "model.safetensors")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export")  # a model directory
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in exported.items())
    fresh = transformers.LlamaForCausalLM(llama_config()).state_dict()
    assert not torch.equal(exported["lm_head.weight"], fresh["lm_head.weight"])

    again = subprocess.run(
        [*common, "--model", str(tmp_path / "export"), "--init-from", str(tmp_path / "export"), "--steps", "0",
         "--checkpoint-dir", str(tmp_path / "ckpt2"), "--export-dir", str(tmp_path / "again")],
        cwd=tmp_path, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert "no steps to train" in again.stderr
    round_trip = load_file(tmp_path / "again" / "model.safetensors")
    assert round_trip.keys() == exported.keys()
    for name, value in exported.items():
        assert torch.equal(round_trip[name], value), name
