"""A tiny Hugging Face Llama built from a config (no download), shared by the tests of the HF integration."""

from __future__ import annotations

import transformers

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def llama_config(**overrides: object) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**SIZES, **overrides})


def llama() -> transformers.LlamaForCausalLM:
    """`simplefsdp train --model tests.hf._tiny:llama`."""
    return transformers.LlamaForCausalLM(llama_config())


def encoder() -> transformers.BertModel:
    """A model that is not a causal LM."""
    return transformers.BertModel(
        transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
