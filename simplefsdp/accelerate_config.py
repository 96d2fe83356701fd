"""`from_accelerate()`: Accelerate's FSDP settings read as simplefsdp's `wrap()` arguments.

    settings = simplefsdp.from_accelerate("fsdp.yaml", model=model)   # or the same as a dict
    simplefsdp.wrap(model, **settings.wrap_kwargs())
    if settings.activation_checkpointing:
        simplefsdp.checkpoint_blocks(model, blocks=settings.checkpoint_blocks)
    scaler = settings.grad_scaler(model)        # mixed_precision: fp16 only; None otherwise

`mixed_precision: fp16` gathers, computes and reduces in float16, whose gradients underflow unless
the loss is scaled, as Accelerate's own fp16 training does with its GradScaler: then
`scaler.scale(loss).backward()`, `scaler.unscale_(optimizer)` before clipping, `scaler.step(optimizer)`,
`scaler.update()` ([Note: float16 needs loss scaling] in `loss_scaling.py`). `settings.loss_scaling`
says whether it is needed, and `from_accelerate` logs it with the notes.

Accepted input: the YAML file `accelerate config` writes (top-level keys such as `mixed_precision`
and `distributed_type: FSDP`, the FSDP keys under `fsdp_config:`), that document as a dict, or the
FSDP section alone (`{"fsdp_sharding_strategy": 1, ...}`, the keys with or without their `fsdp_`
prefix, as `TrainingArguments(fsdp_config=...)` takes them).

[Note: every key is mapped, noted or refused]
A setting read and then dropped would train something other than what its author configured, and
nobody would know. So each key falls in one of three groups, and nothing else is accepted:
- mapped: it changes the result (`_STRATEGIES`, the wrap policy, prefetch, state dict type,
  activation checkpointing, mixed precision);
- noted: simplefsdp always does what it asks, or it does not apply to a compiled, per-parameter
  wrapper (`fsdp_sync_module_states`, `fsdp_use_orig_params`, ...); the result's `notes` says why,
  one line per key, and `from_accelerate` logs them;
- refused: a value simplefsdp cannot honour (`LOCAL_STATE_DICT`, `mixed_precision: fp8`) or a key
  it does not know: a `ValueError` naming the key and its value.
The launcher's keys of the document (`num_processes`, `main_process_ip`, ...) are for whatever
starts the ranks (torchrun, `simplefsdp train`); they are listed in `launcher_keys`, not used.

Invariant: the result depends only on the configuration and the model's module names and classes,
which are the same on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from simplefsdp import loss_scaling
from simplefsdp.class_swap import user_class
from simplefsdp.mixed_precision import MixedPrecisionPolicy
from simplefsdp.offload import OffloadPolicy
from simplefsdp.passes.fsdp_pass import BucketConfig, PassConfig
from simplefsdp.passes.reorder import ReorderConfig
from simplefsdp.strategy import ShardingStrategy

__all__ = ["AccelerateSettings", "blocks_of_classes", "from_accelerate"]

logger = logging.getLogger(__name__)

# FSDP1's enum values, which Accelerate's files use as numbers
_STRATEGIES = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "HYBRID_SHARD_ZERO2"}
_ZERO2 = {"FULL_SHARD": "SHARD_GRAD_OP", "HYBRID_SHARD": "HYBRID_SHARD_ZERO2"}  # reshard_after_forward: false
_MIXED_PRECISION = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_STATE_DICTS = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
_DEFAULT_MIN_NUM_PARAMS = 100_000_000  # Accelerate's default for SIZE_BASED_WRAP

_NOTED = {
    "fsdp_version": "simplefsdp has one wrapper; FSDP1 and FSDP2 settings map alike",
    "fsdp_sync_module_states": "wrap() always starts every rank from rank 0's values (parameters and buffers)",
    "fsdp_cpu_ram_efficient_loading": (
        "rank 0 reads, each rank gets its shards: simplefsdp.checkpoint.import_full_state_dict; "
        "simplefsdp train --init-from also builds the parameters on the meta device first"
    ),
    "fsdp_use_orig_params": "wrap() always keeps the original parameters and their names (no flat parameters)",
}
_LAUNCHER_KEYS = frozenset(
    (
        "compute_environment",
        "debug",
        "downcast_bf16",
        "dynamo_config",
        "enable_cpu_affinity",
        "gpu_ids",
        "machine_rank",
        "main_process_ip",
        "main_process_port",
        "main_training_function",
        "num_machines",
        "num_processes",
        "rdzv_backend",
        "same_network",
        "tpu_env",
        "tpu_use_cluster",
        "tpu_use_sudo",
        "use_cpu",
    )
)
_FP16_NOTE = (
    "mixed_precision: fp16: float16 gradients underflow without loss scaling; scaler = settings.grad_scaler(model), "
    "then scaler.scale(loss).backward(), scaler.unscale_(optimizer) before clipping, scaler.step(optimizer), "
    "scaler.update()"
)
# sections of the document for other engines: refused unless empty
_OTHER_ENGINES = ("deepspeed_config", "megatron_lm_config", "fp8_config", "parallelism_config", "mpirun_config")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AccelerateSettings:
    """What an Accelerate FSDP configuration asks of simplefsdp.

    `blocks`: the FQNs of the modules of `layer_classes` (innermost first, so a nested match keeps
    its own bucket), or None while unresolved (`from_accelerate` without a model). `state_dict`:
    "full" (`checkpoint.export_full_state_dict`, safetensors) or "sharded" (`checkpoint.save_checkpoint`).
    `notes`: one line per key honoured by what simplefsdp always does or mapped approximately.
    """

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    mp_policy: MixedPrecisionPolicy | None = None
    bucket: BucketConfig = BucketConfig()
    reorder: ReorderConfig = ReorderConfig()
    layer_classes: tuple[str, ...] = ()
    blocks: tuple[str, ...] | None = None
    activation_checkpointing: bool = False
    offload: OffloadPolicy | None = None  # `fsdp_offload_params: true`: everything in host memory
    state_dict: Literal["full", "sharded"] = "full"
    notes: tuple[str, ...] = ()
    launcher_keys: tuple[str, ...] = ()

    def wrap_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `simplefsdp.wrap(model, mesh, **...)`."""
        if self.layer_classes and self.blocks is None:
            raise ValueError(
                f"fsdp_transformer_layer_cls_to_wrap {list(self.layer_classes)} names classes: "
                "call from_accelerate(config, model=model) to find them in the model"
            )
        bucket = self.bucket
        if self.blocks:
            bucket = dataclasses.replace(bucket, blocks=self.blocks)
        return {
            "strategy": self.strategy,
            "mp_policy": self.mp_policy,
            "passes": PassConfig(bucket=bucket, reorder=self.reorder),
            "offload": self.offload,
        }

    @property
    def loss_scaling(self) -> bool:
        """Whether training under these settings needs a loss scaler: `mixed_precision: fp16`."""
        policy = self.mp_policy
        return policy is not None and torch.float16 in (policy.param_dtype, policy.reduce_dtype)

    def grad_scaler(self, model: nn.Module) -> torch.amp.GradScaler | None:
        """The loss scaler for `model`, wrapped with `wrap_kwargs()`, when `loss_scaling` (a
        `torch.amp.GradScaler`: `simplefsdp.grad_scaler`); None otherwise. `ValueError` if the
        settings ask for fp16 and `model` was wrapped without it."""
        if not self.loss_scaling:
            return None
        scaler = loss_scaling.grad_scaler(model)
        if scaler is None:
            raise ValueError(
                "mixed_precision: fp16, but the model gathers and reduces in no float16: "
                "wrap it with simplefsdp.wrap(model, **settings.wrap_kwargs())"
            )
        return scaler

    @property
    def checkpoint_blocks(self) -> list[str] | None:
        """`blocks=` for `simplefsdp.checkpoint_blocks`: the layer classes' modules, None for every repeated block."""
        return list(self.blocks) if self.blocks else None


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - the hf extra installs it
        raise ValueError(f"reading {path} needs PyYAML: pip install 'simplefsdp[hf]'") from None
    try:
        with open(path) as file:
            document = yaml.safe_load(file)
    except OSError as err:
        raise ValueError(f"cannot read Accelerate config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"Accelerate config {path} is not valid YAML: {err}") from None
    if not isinstance(document, dict):
        raise ValueError(f"Accelerate config {path} holds a {type(document).__name__}, not a mapping of settings")
    return document


def _split(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level keys, FSDP keys named `fsdp_<name>`) of a document or of an FSDP section alone."""
    if "fsdp_config" in config or "distributed_type" in config:
        top = {k: v for k, v in config.items() if k != "fsdp_config"}
        section = config.get("fsdp_config") or {}
    else:
        top = {k: v for k, v in config.items() if k == "mixed_precision"}
        section = {k: v for k, v in config.items() if k != "mixed_precision"}
    if not isinstance(section, Mapping):
        raise ValueError(f"fsdp_config must be a mapping of settings, got {type(section).__name__}")
    fsdp = {key if key.startswith("fsdp_") else f"fsdp_{key}": value for key, value in section.items()}
    return top, fsdp


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    raise ValueError(f"{key} must be true or false, got {value!r}")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.upper() in choices:
        return value.upper()
    raise ValueError(f"{key}: {value!r} is not one of {', '.join(choices)}")


def _strategy(key: str, value: Any) -> str:
    """A strategy given as FSDP1's number (1-5), its name, or a name / number as a string."""
    if isinstance(value, int) and not isinstance(value, bool) and value in _STRATEGIES:
        return _STRATEGIES[value]
    if isinstance(value, str) and value.isdigit() and int(value) in _STRATEGIES:
        return _STRATEGIES[int(value)]
    if isinstance(value, str) and value.upper() in _STRATEGIES.values():
        return value.upper()
    raise ValueError(f"{key}: {value!r} is not a sharding strategy (1-5 or {', '.join(_STRATEGIES.values())})")


def _top_level(top: Mapping[str, Any]) -> tuple[MixedPrecisionPolicy | None, tuple[str, ...]]:
    """The mixed-precision policy and the launcher keys of the document's top level; refuses the rest."""
    distributed = top.get("distributed_type", "FSDP")
    if str(distributed).upper() != "FSDP":
        raise ValueError(f"distributed_type: {distributed!r}; simplefsdp reads FSDP configurations only")
    for key in _OTHER_ENGINES:
        if top.get(key):
            raise ValueError(f"{key}: simplefsdp cannot honour another engine's settings ({top[key]!r})")
    known = {"distributed_type", "mixed_precision", *_LAUNCHER_KEYS, *_OTHER_ENGINES}
    unknown = sorted(set(top) - known)
    if unknown:
        raise ValueError(f"unknown Accelerate settings {unknown}")
    precision = str(top.get("mixed_precision") or "no").lower()
    if precision not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision: {precision!r} cannot be honoured (simplefsdp has bf16, fp16 and no)")
    dtype = _MIXED_PRECISION[precision]
    # Accelerate's FSDP policy for bf16 / fp16: gather, compute and reduce in that dtype
    policy = None if dtype is None else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    return policy, tuple(sorted(k for k in top if k in _LAUNCHER_KEYS))


def _bucket(fsdp: Mapping[str, Any], notes: list[str]) -> tuple[BucketConfig, tuple[str, ...]]:
    """The bucket plan and the layer class names of the wrap policy."""
    policy = fsdp.get("fsdp_auto_wrap_policy")
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [name.strip() for name in classes.split(",") if name.strip()]
    names = tuple(classes or ())
    policy = _choice("fsdp_auto_wrap_policy", policy, _WRAP_POLICIES) if policy is not None else None
    if names and policy not in (None, "TRANSFORMER_BASED_WRAP"):
        raise ValueError(f"fsdp_transformer_layer_cls_to_wrap goes with TRANSFORMER_BASED_WRAP, not {policy}")
    if "fsdp_min_num_params" in fsdp and policy != "SIZE_BASED_WRAP":
        raise ValueError(f"fsdp_min_num_params goes with SIZE_BASED_WRAP, not {policy}")
    if policy == "SIZE_BASED_WRAP":
        count = fsdp.get("fsdp_min_num_params", _DEFAULT_MIN_NUM_PARAMS)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"fsdp_min_num_params must be a positive int, got {count!r}")
        notes.append(
            f"SIZE_BASED_WRAP: buckets of at most {count} fp32 parameters' bytes in graph order (the 'cap' plan), "
            "where FSDP wraps modules of at least that many parameters"
        )
        return BucketConfig(plan="cap", cap_bytes=4 * count), ()
    if policy == "NO_WRAP":
        return BucketConfig(plan="cap", cap_bytes=2**62), ()  # one unit: every parameter in one bucket per dtype
    return BucketConfig(), names


def _reorder(fsdp: Mapping[str, Any], notes: list[str]) -> ReorderConfig:
    backward = fsdp.get("fsdp_backward_prefetch")
    backward = _choice("fsdp_backward_prefetch", backward, _PREFETCH) if backward is not None else "BACKWARD_PRE"
    forward = _bool("fsdp_forward_prefetch", fsdp.get("fsdp_forward_prefetch", False))
    if backward == "NO_PREFETCH" and not forward:
        return ReorderConfig(prefetch_depth=0)
    given = "fsdp_backward_prefetch" in fsdp or "fsdp_forward_prefetch" in fsdp
    if given and (backward == "NO_PREFETCH" or not forward or backward == "BACKWARD_POST"):
        notes.append(
            f"fsdp_backward_prefetch {backward} with fsdp_forward_prefetch {forward}: simplefsdp prefetches "
            "one bucket ahead in forward and backward alike (one depth for both)"
        )
    return ReorderConfig(prefetch_depth=1)


def _fsdp_section(fsdp: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """The settings the FSDP keys ask for (see [Note: every key is mapped, noted or refused])."""
    mapped = {
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_offload_params",
        "fsdp_auto_wrap_policy",
        "fsdp_transformer_layer_cls_to_wrap",
        "fsdp_min_num_params",
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_state_dict_type",
        "fsdp_activation_checkpointing",
    }
    unknown = sorted(set(fsdp) - mapped - set(_NOTED))
    if unknown:
        raise ValueError(f"unknown Accelerate FSDP settings {unknown}")
    # FSDP's CPUOffload(offload_params=True) / FSDP2's CPUOffloadPolicy: parameters, gradients and
    # optimizer state in host memory, the optimizer stepping there
    offload = OffloadPolicy() if _bool("fsdp_offload_params", fsdp.get("fsdp_offload_params", False)) else None
    strategy = _strategy("fsdp_sharding_strategy", fsdp.get("fsdp_sharding_strategy", 1))
    reshard = fsdp.get("fsdp_reshard_after_forward")
    if isinstance(reshard, bool) or (isinstance(reshard, str) and reshard.lower() in ("true", "false")):
        if not _bool("fsdp_reshard_after_forward", reshard):  # FSDP2's form: ZeRO-2
            strategy = _ZERO2.get(strategy, strategy)
    elif reshard is not None:  # FSDP1's form: a strategy
        named = _strategy("fsdp_reshard_after_forward", reshard)
        if "fsdp_sharding_strategy" in fsdp and named != strategy:
            raise ValueError(f"fsdp_sharding_strategy {strategy} and fsdp_reshard_after_forward {named} disagree")
        strategy = named
    state_dict = _choice(
        "fsdp_state_dict_type", fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT"), (*_STATE_DICTS, "LOCAL_STATE_DICT")
    )
    if state_dict not in _STATE_DICTS:
        raise ValueError(
            f"fsdp_state_dict_type: {state_dict} cannot be honoured (FULL_STATE_DICT or SHARDED_STATE_DICT)"
        )
    bucket, classes = _bucket(fsdp, notes)
    notes.extend(f"{key}: {why}" for key, why in _NOTED.items() if key in fsdp)
    return {
        "strategy": ShardingStrategy.parse(strategy),
        "bucket": bucket,
        "reorder": _reorder(fsdp, notes),
        "layer_classes": classes,
        "activation_checkpointing": _bool(
            "fsdp_activation_checkpointing", fsdp.get("fsdp_activation_checkpointing", False)
        ),
        "state_dict": _STATE_DICTS[state_dict],
        "offload": offload,
    }


def blocks_of_classes(model: nn.Module, classes: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """FQNs of `model`'s modules whose class is named in `classes`, innermost first (model order
    within a depth): a parameter joins the first listed block containing it, so a nested match keeps
    its own bucket, as FSDP wraps it. `ValueError` naming every class no module has."""
    found: dict[str, list[str]] = {name: [] for name in classes}
    for fqn, module in model.named_modules():
        name = user_class(module).__name__
        if name in found and fqn:
            found[name].append(fqn)
    missing = [name for name, fqns in found.items() if not fqns]
    if missing:
        present = sorted({user_class(m).__name__ for m in model.modules()})
        raise ValueError(
            f"no module of class {', '.join(missing)} in "
            f"{user_class(model).__name__} (its classes: {', '.join(present)})"
        )
    return tuple(sorted((f for fqns in found.values() for f in fqns), key=lambda fqn: -fqn.count(".")))


def _resolve(settings: AccelerateSettings, model: nn.Module) -> AccelerateSettings:
    """`settings` with the layer classes found in `model`."""
    if settings.layer_classes:
        try:
            blocks = blocks_of_classes(model, settings.layer_classes)
        except ValueError as err:
            raise ValueError(f"fsdp_transformer_layer_cls_to_wrap: {err}") from None
        return dataclasses.replace(settings, blocks=blocks)
    names = getattr(model, "_no_split_modules", None) or ()  # what Accelerate wraps when none are named
    present = {user_class(m).__name__ for m in model.modules()}
    names = tuple(n for n in names if isinstance(n, str) and n in present)
    if settings.bucket.plan != "blocks" or not names:
        return dataclasses.replace(settings, blocks=())
    return dataclasses.replace(settings, layer_classes=names, blocks=blocks_of_classes(model, names))


def from_accelerate(
    config: str | os.PathLike | Mapping[str, Any], *, model: nn.Module | None = None
) -> AccelerateSettings:
    """Read an Accelerate FSDP configuration (a YAML path or a dict; see the module docstring).

    With `model`, the transformer layer classes are looked up in it (an unknown class name is an
    error naming it; with none named, the model's `_no_split_modules`, as Accelerate does, else
    its repeated blocks). Every key is mapped, noted or refused: [Note: every key is mapped,
    noted or refused]. Raises `ValueError` naming the key at fault.
    """
    document = _read_yaml(config) if isinstance(config, (str, os.PathLike)) else config
    if not isinstance(document, Mapping):
        raise TypeError(f"from_accelerate takes a YAML path or a mapping, got {type(document).__name__}")
    top, fsdp = _split(document)
    mp_policy, launcher_keys = _top_level(top)
    notes: list[str] = []
    settings = AccelerateSettings(mp_policy=mp_policy, launcher_keys=launcher_keys, **_fsdp_section(fsdp, notes))
    if settings.loss_scaling:
        notes.append(_FP16_NOTE)
    settings = dataclasses.replace(settings, notes=tuple(notes))
    if model is not None:
        settings = _resolve(settings, model)
    for line in settings.notes:
        logger.info("from_accelerate: %s", line)
    return settings
