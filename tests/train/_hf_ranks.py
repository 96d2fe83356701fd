"""Rank functions for tests/train/test_hf_model.py (module level, so a RankPool can run them)."""

from __future__ import annotations

import torch
import transformers

import simplefsdp
from simplefsdp.train import hf_model
from tests.hf._tiny import llama_config


def load_saved_pretrained(directory: str, shard_size: str | None) -> dict[str, torch.Tensor]:
    """Rank 0 saves a tied-embedding Llama with `save_pretrained` (one file, or shards + index when
    `shard_size` is set); every rank then loads it into a differently initialised wrapped model with
    `hf_model.load_weights`. Returns the full state after loading, and the saved model's under 'saved.'."""
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True))
    if torch.distributed.get_rank() == 0:
        saved.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    torch.distributed.barrier()
    torch.manual_seed(2)
    model = simplefsdp.wrap(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)))
    hf_model.load_weights(model, directory)
    loaded = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
    return {**loaded, **{f"saved.{k}": v for k, v in saved.state_dict().items()}}
