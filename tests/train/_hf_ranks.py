"""Rank functions for tests/train/test_hf_model.py (module level, so a RankPool can run them)."""

from __future__ import annotations

import torch
import transformers

import simplefsdp
from simplefsdp.train import hf_model
from simplefsdp.train.config import parse_args
from simplefsdp.train.loop import build_model
from tests.hf._tiny import llama_config


def load_saved_pretrained(directory: str, shard_size: str | None) -> dict[str, torch.Tensor]:
    """Rank 0 saves a tied-embedding Llama with `save_pretrained` (one file, or shards + index when
    `shard_size` is set); every rank then loads it with `hf_model.load_weights` into a wrapped model
    built with its parameters on meta (`parameters_on_meta`, `allocate_shards`). Returns the full
    state and every buffer (under 'buffer.') after loading, and the saved model's under 'saved.'."""
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True))
    if torch.distributed.get_rank() == 0:
        saved.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    torch.distributed.barrier()
    torch.manual_seed(2)
    with hf_model.parameters_on_meta():  # as `simplefsdp train --init-from` builds it
        model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True))
    hf_model.retie(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.is_meta for p in model.parameters()), "no full parameter is built"
    assert not any(b.is_meta for b in model.buffers()), "buffers (the rotary table) are computed"
    simplefsdp.wrap(model)
    hf_model.allocate_shards(model, torch.device("cpu"))
    hf_model.load_weights(model, directory)
    loaded = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
    buffers = {f"buffer.{k}": v.clone() for k, v in model.named_buffers()}  # incl. non-persistent ones
    saved_buffers = {f"saved.buffer.{k}": v for k, v in saved.named_buffers()}
    return {**loaded, **buffers, **{f"saved.{k}": v for k, v in saved.state_dict().items()}, **saved_buffers}


def build_from_bf16(directory: str) -> dict[str, torch.Tensor]:
    """Rank 0 saves a Llama whose config and weights are bf16; every rank builds it as `simplefsdp
    train --model DIR --init-from DIR --param-dtype bf16` does (`loop.build_model`). Returns the
    loaded full state (under its names) and the saved one (under 'saved.')."""
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(llama_config(dtype="bfloat16")).to(torch.bfloat16)
    if torch.distributed.get_rank() == 0:
        saved.save_pretrained(directory)
    torch.distributed.barrier()
    config = parse_args(["--model", directory, "--init-from", directory, "--param-dtype", "bf16", "--backend", "eager"])
    model = build_model(config, torch.device("cpu")).model
    loaded = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
    return {**loaded, **{f"saved.{k}": v for k, v in saved.state_dict().items()}}
