"""Models nobody here wrote, built from a config (no download): Hugging Face Llama and ResNet.

torchvision / timm: the torchvision wheels that install beside the CPU build of torch 2.13 fail to
load on it, and timm imports torchvision, so the vision model is
transformers' own ResNet.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # the dev extra

import simplefsdp
from simplefsdp.inspect.dryrun import dry_run


def _hf_llama():
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config), {"input_ids": torch.zeros(2, 16, dtype=torch.long)}


def _hf_resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], num_labels=10)
    return transformers.ResNetForImageClassification(config), {"pixel_values": torch.zeros(2, 3, 32, 32)}


@pytest.mark.parametrize(
    ("factory", "blocks", "mp_policy"),
    [
        (_hf_llama, [f"model.layers.{i}" for i in range(3)], None),
        # fp32: simplefsdp's bf16 gather meets BatchNorm's fp32 running stats ("expected BFloat16")
        (_hf_resnet, [f"resnet.encoder.stages.{i}" for i in range(2)], simplefsdp.MixedPrecisionPolicy()),
    ],
)
@pytest.mark.slow
def test_foreign_model_buckets_and_schedule(factory, blocks, mp_policy):
    result = dry_run(factory, world_size=8, device="h100", mp_policy=mp_policy)
    report = result.report
    n_params = sum(1 for _ in report.capture.model.parameters())
    forward = [row for row in report.buckets if row.phase == "forward"]
    assert [row.modules for row in forward if len(row.modules) == 1 and row.modules[0] in blocks] == [
        (block,) for block in blocks
    ], "one all-gather per repeated block, in order"
    assert len(forward) == len(blocks) + 2, "plus the rest: a run before the blocks, one after"
    assert sum(len(row.parameters) for row in forward) == n_params, "every parameter gathered once"
    reductions = [row for row in report.buckets if row.collective == "reduce_scatter"]
    assert sum(len(row.parameters) for row in reductions) == n_params
    assert len(report.schedule.comm) == len(report.buckets)
    assert result.step_s > 0
    assert result.peak_bytes > result.persistent.params_bytes
