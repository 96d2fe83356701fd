"""Hugging Face causal LMs for `simplefsdp train --model`: built from a config, never downloaded.

    model = build(spec)                    # spec: a directory holding config.json, or "module:function"
    ids = corpus_ids(spec, model)          # the embedded corpus in this model's tokens
    load_weights(model, "ckpt/")           # --init-from: rank 0 reads, each rank gets its shards

[Note: --init-from builds no full parameter]
With `--init-from` the fresh weights would be overwritten, so the model is built with its
parameters on the meta device and its buffers real (`parameters_on_meta`: Accelerate's
`init_empty_weights(include_buffers=False)`; a buffer that is not in a checkpoint, such as a rotary
table, is computed as usual), wrapped, given empty shards (`allocate_shards`, which keeps the
buffers' values) and loaded. So a rank holds its shards and never the full model: with rank 0 alone
reading the file, what Accelerate's `fsdp_cpu_ram_efficient_loading` + `fsdp_sync_module_states`
give. Every parameter must then come from the checkpoint: `check_weights` refuses one that lacks any.

[Note: nothing is downloaded]
A directory is read with `local_files_only=True` (config and tokenizer), and a model is built from
its config with fresh weights; weights come only from `--init-from`, a local safetensors checkpoint
in the Hugging Face layout (`model.safetensors`, or shards + `model.safetensors.index.json`), read
by `simplefsdp.checkpoint.import_full_state_dict`. Every missing file or misfit is a `ConfigError`
of one line naming it.

[Note: which tokens]
With tokenizer files in the directory (`tokenizer.json`, `tokenizer_config.json`,
`tokenizer.model`, `vocab.json`) the corpus is that tokenizer's ids; without, its characters
(`data.VOCAB`), which needs a vocabulary at least that large. A `module:function` model gets
characters.

A tied parameter (an output head sharing the embedding) is saved once by `save_pretrained`, under
one of its names: the other names missing from a checkpoint are not a misfit.

[Note: checkpoint keys of non-persistent buffers]
A buffer registered with `persistent=False` is not in the model's state dict, but a checkpoint saved
by another version of the model may hold it: Llama's rotary table `inv_freq` was once saved with
every attention module (`model.layers.N.self_attn.rotary_emb.inv_freq`), and is now one
non-persistent buffer of the model (`model.rotary_emb.inv_freq`). `from_pretrained` ignores such keys
(transformers 5.24: a key of a non-persistent buffer, or one ending as the model's rotary table or
position ids do), and so does `check_weights`: a key naming a non-persistent buffer of the model, or
ending in the same module and buffer name as one (`rotary_emb.inv_freq`), is skipped, not loaded
(the buffer is computed as usual). Any other key the model lacks is still refused.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from simplefsdp import checkpoint
from simplefsdp.checkpoint.full_source import FullStateSource
from simplefsdp.class_swap import user_class
from simplefsdp.offload import move_offloaded_to_host
from simplefsdp.train.config import ConfigError
from simplefsdp.train.data import CORPUS, VOCAB, encode

__all__ = [
    "TOKENIZER_FILES",
    "allocate_shards",
    "build",
    "check_weights",
    "corpus_ids",
    "load_weights",
    "parameters_on_meta",
    "retie",
    "save_config",
    "tokenizer_of",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("--model needs transformers: pip install 'simplefsdp[hf]'") from None
    return transformers


def _causal_lm_classes() -> dict[str, str]:
    """model_type -> class name of transformers' causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def directory_of(spec: str) -> Path | None:
    """The model directory `spec` names, or None for `module:function`."""
    return None if ":" in spec and not Path(spec).exists() else Path(spec)


def _from_directory(path: Path) -> nn.Module:
    transformers = _transformers()
    if not path.is_dir():
        raise ConfigError(f"--model {path}: no such directory (nor module:function)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path}: no config.json there (nothing is downloaded)")
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError) as err:
        raise ConfigError(f"--model {path}/config.json: {str(err).splitlines()[0]}") from None
    if config.model_type not in _causal_lm_classes():
        raise ConfigError(
            f"--model {path}: {type(config).__name__} (model_type {config.model_type!r}) is not a causal LM"
        )
    return transformers.AutoModelForCausalLM.from_config(config)


def _from_function(spec: str) -> nn.Module:
    module_name, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--model {spec}: {err}") from None
    model = function()
    causal = set(_causal_lm_classes().values())
    if not isinstance(model, nn.Module) or not (
        user_class(model).__name__ in causal or getattr(model, "can_generate", lambda: False)()
    ):
        raise ConfigError(f"--model {spec} returned a {type(model).__name__}, not a causal LM")
    return model


def build(spec: str) -> nn.Module:
    """The causal LM `spec` names, with fresh weights, on the current default device."""
    path = directory_of(spec)
    model = _from_directory(path) if path is not None else _from_function(spec)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # training: no key / value cache in the outputs
    return model


def vocab_size(model: nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


def tokenizer_of(spec: str) -> Any | None:
    """The tokenizer in the model directory `spec` names, or None (no tokenizer files, or
    `module:function`): the model then reads the corpus's characters ([Note: which tokens])."""
    path = directory_of(spec)
    if path is None or not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return _transformers().AutoTokenizer.from_pretrained(path, local_files_only=True)


def corpus_ids(spec: str, model: nn.Module) -> torch.Tensor:
    """The embedded corpus as token ids for `model` (see [Note: which tokens])."""
    size = vocab_size(model)
    tokenizer = tokenizer_of(spec)
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(CORPUS, add_special_tokens=False)["input_ids"])
        if int(ids.max()) >= size:
            raise ConfigError(f"--model {spec}: the tokenizer's ids reach {int(ids.max())}, the vocabulary has {size}")
        return ids
    if size < len(VOCAB):
        raise ConfigError(
            f"--model {spec}: a vocabulary of {size} is smaller than the corpus's {len(VOCAB)} characters "
            f"and there are no tokenizer files ({', '.join(TOKENIZER_FILES)})"
        )
    return encode(CORPUS)


def _one_line(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_weights(model: nn.Module, path: str) -> None:
    """ConfigError (one line) unless the checkpoint at `path` has every tensor of `model` in its shape.

    Reads headers only. Names missing because they alias a tied parameter the file has are fine."""
    try:
        source = FullStateSource(path)
        shapes = {key: source.shape(key) for key in source.names()}
    except (checkpoint.CheckpointError, FileNotFoundError) as err:
        raise ConfigError(f"--init-from {path}: {str(err).splitlines()[0]}") from None
    state = model.state_dict()
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    present = set(shapes)
    tied_ok = {n for names in aliases.values() if present & set(names) for n in names}
    missing = [key for key in state if key not in present and key not in tied_ok]
    buffers = _non_persistent_buffers(model, state)
    unexpected = [key for key in shapes if key not in state and not _names_a_buffer(key, buffers)]
    mismatched = [
        f"{key} {shapes[key]} vs {tuple(v.shape)}"
        for key, v in state.items()
        if key in shapes and shapes[key] != tuple(v.shape)
    ]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", mismatched)):
        if names:
            raise ConfigError(f"--init-from {path}: {len(names)} tensors {what} for the model: {_one_line(names)}")


def _non_persistent_buffers(model: nn.Module, state: dict[str, torch.Tensor]) -> set[str]:
    """The names of `model`'s buffers that its state dict leaves out."""
    return {name for name, _ in model.named_buffers(remove_duplicate=False) if name not in state}


def _names_a_buffer(key: str, buffers: set[str]) -> bool:
    """Whether checkpoint `key` is one of the non-persistent `buffers` by name, or by its module's and
    its own name ([Note: checkpoint keys of non-persistent buffers])."""
    return key in buffers or any(key.split(".")[-2:] == name.split(".")[-2:] for name in buffers)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers real (see the note).
    Re-tie a Hugging Face model's weights after (`retie`)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def retie(model: nn.Module) -> None:
    """`parameters_on_meta` re-registers every parameter as a new meta one, which unties an output
    head assigned the embedding's parameter; a Hugging Face model ties them again itself."""
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()


def allocate_shards(model: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for the wrapped `model`'s meta shards (offloaded ones in host
    memory); buffers keep their values."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    move_offloaded_to_host(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def load_weights(model: nn.Module, path: str) -> None:
    """Collective: `--init-from` into the wrapped `model` (rank 0 reads, each rank gets its shards)."""
    check_weights(model, path)
    checkpoint.import_full_state_dict(model, path, strict=False)  # strict: checked above, tied names allowed


def save_config(model: nn.Module, spec: str, directory: str) -> None:
    """Beside an export: the model's config and the tokenizer files, so `directory` is a model directory."""
    if getattr(model, "config", None) is None:
        return
    model.config.architectures = [user_class(model).__name__]
    model.config.save_pretrained(directory)
    source = directory_of(spec)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "merges.txt"):
        if source is not None and (source / name).is_file():
            (Path(directory) / name).write_bytes((source / name).read_bytes())
