"""`simplefsdp.from_accelerate`: each Accelerate FSDP key's mapping, and each refusal naming its key.

Pure configuration: no process group, no compile. The layer-class lookups use a tiny Hugging Face
Llama built from a config (no download) and simplefsdp's own reference model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import simplefsdp
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.strategy import ShardingStrategy
from tests.hf._tiny import llama_config

S = ShardingStrategy


def _llama() -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM(llama_config())


@pytest.mark.parametrize(
    ("settings", "strategy"),
    [
        ({}, S.FULL_SHARD),
        *[({"fsdp_sharding_strategy": n}, s) for n, s in enumerate(S, start=1)],
        *[({"fsdp_sharding_strategy": s.value.lower()}, s) for s in S],
        ({"fsdp_sharding_strategy": "2"}, S.SHARD_GRAD_OP),
        ({"fsdp_reshard_after_forward": "HYBRID_SHARD"}, S.HYBRID_SHARD),  # FSDP1's form
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, S.SHARD_GRAD_OP),  # FSDP2's form
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": True}, S.FULL_SHARD),
        ({"fsdp_sharding_strategy": 4, "fsdp_reshard_after_forward": False}, S.HYBRID_SHARD_ZERO2),
        ({"sharding_strategy": 3}, S.NO_SHARD),  # TrainingArguments' fsdp_config drops the prefix
    ],
)
def test_sharding_strategy(settings, strategy):
    result = simplefsdp.from_accelerate(settings)
    assert result.strategy is strategy
    assert result.wrap_kwargs()["strategy"] is strategy


def test_transformer_layer_classes_become_the_block_plan_and_checkpointed_blocks():
    model = _llama()
    config = {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_activation_checkpointing": True,
    }
    result = simplefsdp.from_accelerate(config, model=model)
    assert result.blocks == ("model.layers.0", "model.layers.1")
    passes = result.wrap_kwargs()["passes"]
    assert (passes.bucket.plan, passes.bucket.blocks) == ("blocks", ("model.layers.0", "model.layers.1"))
    assert result.activation_checkpointing
    assert result.checkpoint_blocks == ["model.layers.0", "model.layers.1"]


def test_nested_layer_classes_list_the_inner_modules_first():
    """FSDP wraps a nested class as its own unit inside the outer one: the inner block must come
    first, since a parameter joins the first listed block that contains it."""
    model = _llama()
    config = {"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "LlamaMLP"]}
    blocks = simplefsdp.from_accelerate(config, model=model).blocks
    assert blocks == ("model.layers.0.mlp", "model.layers.1.mlp", "model.layers.0", "model.layers.1")


def test_without_named_classes_the_model_no_split_modules_are_used():
    result = simplefsdp.from_accelerate({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, model=_llama())
    assert result.layer_classes == ("LlamaDecoderLayer",)
    assert result.blocks == ("model.layers.0", "model.layers.1")
    # a model without them keeps the default plan: wrap() finds its repeated blocks
    plain = simplefsdp.from_accelerate({}, model=Transformer(TransformerArgs(n_layers=2, dim=16, n_heads=2)))
    assert (plain.blocks, plain.wrap_kwargs()["passes"].bucket.blocks) == ((), ())


def test_an_unknown_layer_class_is_named():
    config = {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,GPT2Block"}
    with pytest.raises(ValueError, match=r"no module of class GPT2Block in LlamaForCausalLM \(its classes: .*LlamaMLP"):
        simplefsdp.from_accelerate(config, model=_llama())


def test_layer_classes_without_a_model_cannot_make_wrap_arguments():
    result = simplefsdp.from_accelerate({"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"})
    assert result.layer_classes == ("LlamaDecoderLayer",)
    with pytest.raises(ValueError, match=r"fsdp_transformer_layer_cls_to_wrap .* model=model"):
        result.wrap_kwargs()


@pytest.mark.parametrize(
    ("settings", "plan", "cap"),
    [
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000}, "cap", 4000),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, "cap", 4 * 10**8),
        ({"fsdp_auto_wrap_policy": "NO_WRAP"}, "cap", 2**62),
    ],
)
def test_size_based_and_no_wrap_policies(settings, plan, cap):
    bucket = simplefsdp.from_accelerate(settings).wrap_kwargs()["passes"].bucket
    assert (bucket.plan, bucket.cap_bytes) == (plan, cap)


@pytest.mark.parametrize(
    ("settings", "depth", "noted"),
    [
        ({}, 1, False),
        ({"fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_forward_prefetch": True}, 1, False),
        ({"fsdp_backward_prefetch": "BACKWARD_PRE"}, 1, True),  # forward prefetch off: one depth for both
        ({"fsdp_backward_prefetch": "BACKWARD_POST", "fsdp_forward_prefetch": True}, 1, True),
        ({"fsdp_backward_prefetch": "NO_PREFETCH", "fsdp_forward_prefetch": True}, 1, True),
        ({"fsdp_backward_prefetch": "NO_PREFETCH", "fsdp_forward_prefetch": False}, 0, False),
    ],
)
def test_prefetch_settings_become_the_reorder_depth(settings, depth, noted):
    result = simplefsdp.from_accelerate(settings)
    assert result.wrap_kwargs()["passes"].reorder.prefetch_depth == depth
    assert any("one depth for both" in note for note in result.notes) == noted


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", None), (None, None)]
)
def test_mixed_precision(precision, dtype):
    document = {"distributed_type": "FSDP", "mixed_precision": precision, "fsdp_config": {}}
    policy = simplefsdp.from_accelerate(document).wrap_kwargs()["mp_policy"]
    if dtype is None:
        assert policy is None
    else:
        assert policy == simplefsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


@pytest.mark.parametrize(("value", "choice"), [("FULL_STATE_DICT", "full"), ("SHARDED_STATE_DICT", "sharded")])
def test_state_dict_type(value, choice):
    assert simplefsdp.from_accelerate({"fsdp_state_dict_type": value}).state_dict == choice


@pytest.mark.parametrize(
    "key", ["fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading", "fsdp_use_orig_params", "fsdp_version"]
)
def test_keys_simplefsdp_always_honours_are_noted(key):
    result = simplefsdp.from_accelerate({key: True if key != "fsdp_version" else 1})
    assert [note for note in result.notes if note.startswith(f"{key}: ")], result.notes
    assert result.wrap_kwargs() == simplefsdp.from_accelerate({}).wrap_kwargs()


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_state_dict_type: LOCAL_STATE_DICT"),
        ({"mixed_precision": "fp8"}, "mixed_precision: 'fp8'"),
        ({"fsdp_sharding_strategy": 6}, "fsdp_sharding_strategy: 6"),
        ({"fsdp_backward_prefetch": "SOMETIMES"}, "fsdp_backward_prefetch: 'SOMETIMES'"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "X"}, "goes with"),
        ({"fsdp_min_num_params": 10}, "fsdp_min_num_params goes with SIZE_BASED_WRAP"),
        ({"fsdp_sharding_strategy": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, "disagree"),
        ({"fsdp_activation_checkpointing": "maybe"}, "fsdp_activation_checkpointing must be true or false"),
        ({"fsdp_limit_all_gathers": True}, r"unknown Accelerate FSDP settings \['fsdp_limit_all_gathers'\]"),
        ({"distributed_type": "FSDP", "fsdp_config": {}, "colour": 1}, r"unknown Accelerate settings \['colour'\]"),
        ({"distributed_type": "DEEPSPEED"}, "distributed_type: 'DEEPSPEED'"),
        ({"distributed_type": "FSDP", "deepspeed_config": {"zero_stage": 3}}, "deepspeed_config"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(document, named):
    with pytest.raises(ValueError, match=named):
        simplefsdp.from_accelerate(document)


def test_the_yaml_accelerate_config_writes(tmp_path):
    """A file as `accelerate config` writes it (FSDP1, bf16, layer classes), launcher keys listed."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "debug: false\n"
        "distributed_type: FSDP\n"
        "downcast_bf16: 'no'\n"
        "fsdp_config:\n"
        "  fsdp_activation_checkpointing: false\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_backward_prefetch: BACKWARD_PRE\n"
        "  fsdp_cpu_ram_efficient_loading: true\n"
        "  fsdp_forward_prefetch: false\n"
        "  fsdp_offload_params: false\n"
        "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n"
        "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
        "  fsdp_sync_module_states: true\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
        "  fsdp_use_orig_params: true\n"
        "  fsdp_version: 1\n"
        "machine_rank: 0\n"
        "main_training_function: main\n"
        "mixed_precision: bf16\n"
        "num_machines: 1\n"
        "num_processes: 2\n"
        "rdzv_backend: static\n"
        "same_network: true\n"
        "tpu_env: []\n"
        "tpu_use_cluster: false\n"
        "tpu_use_sudo: false\n"
        "use_cpu: false\n"
    )
    result = simplefsdp.from_accelerate(path, model=_llama())
    assert isinstance(result, simplefsdp.AccelerateSettings)
    assert result.strategy is S.SHARD_GRAD_OP
    assert result.mp_policy.param_dtype is torch.bfloat16
    assert result.blocks == ("model.layers.0", "model.layers.1")
    assert result.state_dict == "sharded"
    assert not result.activation_checkpointing
    assert "num_processes" in result.launcher_keys
    assert len(result.notes) == 5  # prefetch (one depth), sync, ram-efficient loading, orig params, version
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.strategy = S.NO_SHARD


def test_an_unreadable_or_invalid_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read Accelerate config .*missing\.yaml"):
        simplefsdp.from_accelerate(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("fsdp_config: [1, 2\n")
    with pytest.raises(ValueError, match=r"bad\.yaml is not valid YAML"):
        simplefsdp.from_accelerate(tmp_path / "bad.yaml")
