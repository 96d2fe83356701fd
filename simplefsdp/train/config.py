"""`TrainConfig`: every setting of `simplefsdp train`, from defaults, an optional TOML file and flags.

    config = parse_args(["--config", "run.toml", "--steps", "50"])   # flags override the file

The TOML file is flat: one key per field, named as the field (`n_layers = 8`, `strategy =
"HYBRID_SHARD"`); `simplefsdp train --help` lists them. Every problem -- an unknown flag or key,
a value of the wrong type, a file that cannot be read or parsed, a combination that cannot run --
raises `ConfigError` whose message names the flag, key or file; the CLI prints it and exits 2.

Invariant: a `TrainConfig` that constructs is runnable as far as can be known before the world
size is (`check_world` finishes the job once it is).

This module imports no torch: `simplefsdp train --help` and a bad flag answer before torch loads
([Note: lazy package exports] in `simplefsdp/_lazy.py`); the checks that need it import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from simplefsdp.settings import (
    DEFAULT_GATHER_BLOCK,
    DTYPES,
    GATHER_BLOCKS,
    QUANTIZED_GATHER_DTYPES,
    TIERS,
    check_gather_block,
    dtype_name,
    parse_memory_budget,
)
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.train.schedule import COSINE_FLOOR, SCHEDULES

if TYPE_CHECKING:
    from simplefsdp.inspect.shapes import ModelShape  # torch: imported where a shape is named

__all__ = [
    "SHAPE_SIZES",
    "ConfigError",
    "TrainConfig",
    "check_world",
    "load_accelerate",
    "load_toml",
    "parse_args",
    "shape_of",
    "shape_sizes",
    "to_toml",
]

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad flag, config file or value; the message says which."""


def _field(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": text, "choices": choices})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Sizes are per data-parallel rank unless they say otherwise. Training never
    reads the corpus's held-out tail (`data.split`), whatever `eval_every` says."""

    # model: a Hugging Face causal LM (--model), or a Llama-style decoder (simplefsdp.models.Transformer)
    # sized by a named shape (--shape, its vocabulary and key / value heads) and the next five settings
    # (without a shape: the vocabulary the corpus's characters)
    model: str = _field("", "a transformers causal LM: a directory holding config.json, or module:function")
    shape: str = _field(
        "",
        "a named model shape of `simplefsdp inspect` (tiny, llama3-8b, ...), built on the meta device and "
        "materialized sharded; its dim, n_layers, n_heads and ffn_dim are the defaults of those settings",
    )
    init_from: str = _field("", "initial weights: a safetensors checkpoint in the Hugging Face layout")
    layer_classes: str = _field("", "comma-separated module class names: one bucket (and checkpoint) per module")
    dim: int = _field(128, "model width")
    n_layers: int = _field(4, "transformer blocks")
    n_heads: int = _field(4, "attention heads")
    ffn_dim: int = _field(344, "MLP hidden width")
    seq_len: int = _field(64, "tokens per sequence")
    # training
    steps: int = _field(100, "total optimizer steps (a resumed run continues up to this count); 0: load, export")
    batch_per_rank: int = _field(8, "sequences per data-parallel rank per step")
    lr: float = _field(3e-3, "AdamW learning rate (the peak, under a warmup or a schedule)")
    lr_schedule: str = _field(
        "constant", f"after the warmup: constant lr, or cosine decay to {COSINE_FLOOR:g} x lr at --steps", SCHEDULES
    )
    warmup_steps: int = _field(0, "linear warmup: step k (from 1) of the first N uses lr x k / N; at most steps")
    grad_clip: float = _field(0.0, "clip the global gradient L2 norm to this (after unscaling); 0: off")
    seed: int = _field(0, "seed of the initialisation and of the batch order")
    # parallelism and compilation
    nproc: int = _field(0, "ranks to spawn when not under torchrun; 0: 2 on CPU, one per GPU")
    device: str = _field("auto", "auto: cuda (nccl) if available, else cpu (gloo)", ("auto", "cpu", "cuda"))
    strategy: str = _field("FULL_SHARD", "sharding strategy", tuple(ShardingStrategy.__members__))
    shard_size: int = _field(0, "HYBRID_*: ranks per shard group; 0: half the data-parallel ranks")
    tp: int = _field(1, "tensor-parallel degree (ranks per tp group)")
    param_dtype: str = _field("fp32", "all-gather / compute dtype", tuple(DTYPES))
    reduce_dtype: str = _field("auto", "gradient reduction dtype; auto: param_dtype", ("auto", *DTYPES))
    gather_dtype: str = _field(
        "none",
        "parameters travel the compiled step's all-gathers as block-scaled codes of this type, dequantized "
        "into param_dtype (lossy: about half of bf16's bytes; gradients, masters and checkpoints stay full "
        "precision); none: in param_dtype",
        ("none", *QUANTIZED_GATHER_DTYPES),
    )
    gather_block: int = _field(
        DEFAULT_GATHER_BLOCK,
        f"gather_dtype: elements per quantization block (one fp32 scale each), a power of two from "
        f"{GATHER_BLOCKS[0]} to {GATHER_BLOCKS[1]}",
    )
    backend: str = _field("inductor", "torch.compile backend; eager: no compile", ("inductor", "aot_eager", "eager"))
    compile_cache: str = _field(
        "",
        "where the job's compile artifacts live: DIR/simplefsdp-<key>/ with a manifest of what they were "
        "compiled for (a `simplefsdp precompile` directory); default: torch's inductor cache directory",
    )
    precompile: bool = _field(
        False,
        "without a matching compile-cache entry, one process per machine compiles the job first (as "
        "`simplefsdp precompile`) while the ranks wait; then every rank loads it",
    )
    bucket_plan: str = _field("blocks", "simplefsdp bucket plan; none: passes off", ("blocks", "auto", "cap", "none"))
    bucket_cap_mib: float = _field(64.0, "cap / auto plans: MiB per bucket")
    memory_budget: str = _field("", "auto plan: bytes the pass may add to a graph's peak, 0.25 (a fraction) or 512MiB")
    prefetch_depth: int = _field(1, "all-gathers launched ahead of the one in use")
    profile: str = _field(
        "auto",
        "cost-model device profile: a name or a `simplefsdp calibrate` file (auto plan, comm line); auto: by device",
    )
    activation_checkpoint: str = _field("none", "checkpoint every block", ("none", "full", "selective"))
    offload: str = _field(
        "none",
        "host memory holds the optimizer state, masters and gradients (optimizer), and the parameters (all); "
        "auto: a tier per block, as little as meets device_memory_limit",
        (*TIERS, "auto"),
    )
    device_memory_limit: str = _field(
        "",
        "offload auto: device memory per rank a step may use, e.g. 70GiB; default: nine tenths of the "
        "profile's capacity",
    )
    # checkpoints and output
    checkpoint_dir: str = _field("simplefsdp-checkpoints", "where sharded checkpoints go")
    checkpoint_every: int = _field(50, "save every N steps (and at the end); 0: only at the end")
    keep_last: int = _field(2, "checkpoints kept")
    resume: bool = _field(False, "continue from the newest checkpoint in checkpoint_dir (if any)")
    export_dir: str = _field("", "at the end, write the full weights here as safetensors (a model directory)")
    run_dir: str = _field(
        "",
        "the run folder: config.toml, metrics.jsonl, loss.png (and tensorboard/); default: checkpoint_dir/run",
    )
    metrics_file: str = _field("", "also append the run folder's per-step JSON lines to this file")
    plot_every: int = _field(50, "rewrite the run folder's loss.png every N steps (and at the end); 0: at the end")
    tensorboard: bool = _field(False, "also write TensorBoard event files to the run folder (needs tensorboard)")
    eval_every: int = _field(0, "every N steps and at the end, the loss on the held-out tail of the corpus; 0: off")
    sample_tokens: int = _field(64, "at the end, rank 0 prints this many greedily sampled tokens; 0: no sample")
    progress: bool = _field(True, "progress bar on rank 0 (else one log line per 10 steps)")
    verbose: bool = _field(False, "every rank's warnings, and torch's warnings known benign for this model")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise ConfigError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}; got {value!r}")
        positive = ("dim", "n_layers", "n_heads", "ffn_dim", "seq_len", "batch_per_rank", "tp", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in (
            "steps",
            "nproc",
            "shard_size",
            "checkpoint_every",
            "prefetch_depth",
            "plot_every",
            "warmup_steps",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0; got {getattr(self, name)}")
        for name in ("eval_every", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: off); got {getattr(self, name)}")
        if not self.grad_clip >= 0 or math.isinf(self.grad_clip):  # `not >=`: a nan fails too
            raise ConfigError(f"grad_clip must be a finite number >= 0 (0: off); got {self.grad_clip}")
        if self.warmup_steps > self.steps > 0:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be at most steps ({self.steps})")
        if not (self.lr > 0 and self.bucket_cap_mib > 0):  # nan too: it compares false
            raise ConfigError(f"lr and bucket_cap_mib must be positive; got {self.lr} and {self.bucket_cap_mib}")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ConfigError(f"dim ({self.dim}) must be n_heads ({self.n_heads}) times an even head dim")
        if self.steps == 0 and not self.export_dir:
            raise ConfigError("steps 0 (load, then export) needs export_dir")
        if self.shape:
            self._check_shape()
        if self.model and self.tp > 1:
            raise ConfigError(f"tp ({self.tp}) is for the built-in model; --model trains with data parallelism only")
        if self.n_heads % self.tp or self.ffn_dim % self.tp:
            raise ConfigError(f"tp ({self.tp}) must divide n_heads ({self.n_heads}) and ffn_dim ({self.ffn_dim})")
        if self.memory_budget:
            if self.bucket_plan != "auto":
                raise ConfigError(f"memory_budget is for bucket_plan auto; got bucket_plan {self.bucket_plan!r}")
            try:
                parse_memory_budget(self.memory_budget)
            except ValueError as error:
                raise ConfigError(str(error)) from None
        self._check_gather()
        if self.backend == "eager" and (self.compile_cache or self.precompile):
            raise ConfigError("compile_cache and precompile are for a compiled step; backend eager compiles none")
        if self.device_memory_limit and self.offload != "auto":
            raise ConfigError(f"device_memory_limit is for offload auto; got offload {self.offload!r}")
        if self.profile != "auto":
            from simplefsdp.passes import cost

            try:
                cost.profile(self.profile)
            except ValueError as error:
                raise ConfigError(f"profile: {error}") from None

    def _check_gather(self) -> None:
        try:
            check_gather_block(self.gather_block)
        except ValueError as error:
            raise ConfigError(f"gather_block {error}") from None
        if self.gather_dtype == "none":
            if self.gather_block != DEFAULT_GATHER_BLOCK:
                raise ConfigError(f"gather_block ({self.gather_block}) is for a quantized gather_dtype; got none")
        elif self.strategy == "NO_SHARD":
            raise ConfigError(
                f"gather_dtype {self.gather_dtype} quantizes the parameter all-gathers; strategy NO_SHARD has none"
            )
        elif self.backend == "eager":
            raise ConfigError(
                f"gather_dtype {self.gather_dtype} quantizes the compiled step's all-gathers; backend eager "
                "compiles none (use inductor or aot_eager)"
            )

    def _check_shape(self) -> None:
        from simplefsdp.train.data import VOCAB

        if self.model:
            raise ConfigError(f"shape ({self.shape!r}) and model ({self.model!r}) each name the model: give one")
        args = shape_of(self).args
        if args.vocab_size < len(VOCAB):
            raise ConfigError(
                f"shape {self.shape!r}: its vocabulary ({args.vocab_size}) is smaller than the corpus's "
                f"{len(VOCAB)} tokens"
            )
        if args.tie_embeddings and self.tp > 1:
            raise ConfigError(
                f"tp ({self.tp}): shape {self.shape!r} ties its output head to the embedding, and the "
                "tensor-parallel plan shards the two apart (they would train untied); use tp 1"
            )
        from simplefsdp.inspect.shapes import model_shape  # torch: only once a shape is named

        kv_heads = model_shape(self.shape).n_kv_heads
        if kv_heads is not None and kv_heads % self.tp:
            raise ConfigError(f"tp ({self.tp}) must divide shape {self.shape!r}'s key / value heads ({kv_heads})")

    @property
    def sharding(self) -> ShardingStrategy:
        return ShardingStrategy.parse(self.strategy)

    @property
    def run_path(self) -> Path:
        """The run folder: `run_dir`, or `run` in the checkpoint directory."""
        return Path(self.run_dir) if self.run_dir else Path(self.checkpoint_dir) / "run"

    def device_type(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


SHAPE_SIZES = ("dim", "n_layers", "n_heads", "ffn_dim")  # what a shape sets and its flags override


def shape_sizes(name: str) -> dict[str, int]:
    """The settings a named shape gives its model (the defaults `--dim` etc. override); ConfigError
    naming the known shapes for an unknown one."""
    from simplefsdp.inspect.shapes import model_shape  # torch: only once a shape is named

    try:
        args = model_shape(name).args
    except ValueError as err:
        raise ConfigError(f"shape: {err}") from None
    return {size: getattr(args, size) for size in SHAPE_SIZES}


def shape_of(config: TrainConfig) -> ModelShape:
    """The model `config.shape` names, sized by `config` (its sizes, and the sequence as its longest)."""
    from simplefsdp.inspect.shapes import model_shape

    try:
        return model_shape(config.shape).resized(
            **{size: getattr(config, size) for size in SHAPE_SIZES}, max_seq_len=config.seq_len
        )
    except ValueError as err:
        raise ConfigError(f"shape: {err}") from None


def check_world(config: TrainConfig, world_size: int) -> None:
    """The checks that need the world size: the mesh `(replicate,) (shard | dp) (tp)` must tile it."""
    if world_size % config.tp:
        raise ConfigError(f"tp ({config.tp}) must divide the world size ({world_size})")
    dp = world_size // config.tp
    if config.sharding.is_hybrid:
        shard = config.shard_size or dp // 2
        if shard < 1 or dp % shard:
            raise ConfigError(f"shard_size ({shard}) must divide the data-parallel size ({dp}) for {config.strategy}")


def _check_type(name: str, value: Any, kind: type, where: str) -> Any:
    """`value` as a `kind` (an int is a float too); a ConfigError naming `where` otherwise."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: {name} must be {kind.__name__}, got {type(value).__name__} {value!r}")


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def load_toml(path: str | Path) -> dict[str, Any]:
    """The settings in a flat TOML file, type-checked against `TrainConfig`'s fields."""
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    fields = _fields()
    unknown = sorted(set(document) - set(fields))
    if unknown:
        raise ConfigError(f"config file {path}: unknown keys {unknown}; known: {', '.join(fields)}")
    return {k: _check_type(k, v, _TYPES[fields[k].type], f"config file {path}") for k, v in document.items()}


def _toml_string(text: str) -> str:
    """`text` as a TOML basic string: quotes, backslashes and control characters escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    out = (escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return _toml_string(value)
    return repr(value)  # int, or float: Python's repr (1e-05, inf, nan) is TOML's syntax too


def to_toml(config: TrainConfig) -> str:
    """Every setting of `config` as a flat TOML file that `parse_args(["--config", path])` reads back
    into an equal `TrainConfig`."""
    lines = [f"{name} = {_toml_value(getattr(config, name))}" for name in _fields()]
    return "\n".join(lines) + "\n"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so the caller decides the exit code."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="simplefsdp train",
        description="Train a Llama-style model with simplefsdp + torch.compile (see simplefsdp/train/).",
        argument_default=argparse.SUPPRESS,  # absent flags leave the file's / default values alone
    )
    parser.add_argument(
        "--config",
        help="a TOML file of these settings (flat, snake_case keys) or an Accelerate FSDP config (.yaml); "
        "flags override it",
    )
    for name, f in _fields().items():
        flag, kind = "--" + name.replace("_", "-"), _TYPES[f.type]
        text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(
                flag,
                dest=name,
                type=kind,
                choices=f.metadata["choices"],
                metavar=kind.__name__.upper() if not f.metadata["choices"] else None,
                help=text,
            )
    return parser


def load_accelerate(path: str | Path) -> dict[str, Any]:
    """The settings an Accelerate config file asks for (`simplefsdp.from_accelerate`), as fields."""
    from simplefsdp.accelerate_config import from_accelerate

    try:
        accel = from_accelerate(path)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"Accelerate config {path}: {err}") from None
    settings: dict[str, Any] = {"strategy": accel.strategy.value, "prefetch_depth": accel.reorder.prefetch_depth}
    if accel.mp_policy is not None:
        settings.update(
            param_dtype=dtype_name(accel.mp_policy.param_dtype), reduce_dtype=dtype_name(accel.mp_policy.reduce_dtype)
        )
    if accel.bucket.plan == "cap":
        settings.update(bucket_plan="cap", bucket_cap_mib=accel.bucket.cap_bytes / 2**20)
    if accel.layer_classes:
        settings["layer_classes"] = ",".join(accel.layer_classes)
    if accel.activation_checkpointing:
        settings["activation_checkpoint"] = "full"
    if accel.offload is not None:
        settings["offload"] = "all"
    if accel.state_dict == "full":
        logger.info(
            "%s: FULL_STATE_DICT: checkpoints stay sharded (for --resume); --export-dir writes full weights", path
        )
    return settings


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """Defaults, then a `shape`'s sizes, then the `--config` file (TOML, or an Accelerate YAML
    file), then the flags: a size given in the file or as a flag overrides the shape's."""
    values = vars(build_parser().parse_args(list(argv)))
    path = values.pop("config", None)
    settings = {} if not path else load_accelerate(path) if str(path).endswith((".yaml", ".yml")) else load_toml(path)
    settings.update(values)
    if settings.get("shape"):
        settings = {**shape_sizes(settings["shape"]), **settings}
    try:
        return TrainConfig(**settings)
    except ConfigError as err:
        raise ConfigError(f"{err}{f' (flags and {path})' if path else ''}") from None
