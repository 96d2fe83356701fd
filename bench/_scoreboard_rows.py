"""The scoreboard's rows: each row's setup by key, the sets `--set` selects, and what a row's setup
means for the libraries -- mixed precision, simplefsdp's passes, inductor's options.

Rows (`--set fp32`: fp32, AdamW, the same Llama-style model from the same seed):
  DDP                               `DistributedDataParallel`, eager
  FSDP2 eager                       `fully_shard` per block and at the root (its recommended use)
  FSDP2 + compile per block         each block `torch.compile`d, then `fully_shard` per block and root (as
                                    torchtitan and the FSDP2 docs do: hooks stay eager, blocks compile)
  simplefsdp eager                  `simplefsdp.wrap`, no compile
  simplefsdp compiled, no passes    `wrap(passes=None)` + `torch.compile`: one collective per parameter
  simplefsdp compiled, our passes   `wrap()` + `torch.compile`: simplefsdp's bucketing and reordering
  ..., no peak growth               the same with `ReorderConfig(max_peak_growth_bytes=0)`: overlap only
                                    where the graph's live bytes leave room (no graph's peak grows)
  ... (auto plan)                   the same with the cost-model ("auto") plan on this machine's profile
  simplefsdp compiled, torch's      `wrap(passes=None)` + inductor's FX bucketing and overlap reordering
  the same, SHARD_GRAD_OP           FSDP2 eager and + compile per block with `reshard_after_forward=False`,
                                    simplefsdp with `strategy="SHARD_GRAD_OP"` (ours and torch's passes):
                                    like for like, every one keeps the gathered weights for backward
  auto plan, budget F               the auto plan with `memory_budget=F` (a fraction of each graph's peak),
                                    for each F of `--frontier`: the step time / memory trade it finds

Rows of `--set bf16`, like for like under one mixed precision (bf16 parameters gathered and used in
compute, fp32 masters and fp32 gradient reductions: FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` and simplefsdp's of the same name and fields): FSDP2 eager, FSDP2 + compile per
block, simplefsdp compiled with our passes (default and auto plan). Rows of `--set quant`: simplefsdp
compiled with our passes under that policy with `gather_dtype="int8"` and `"float8_e4m3fn"` (block
128): the parameters travel the all-gather as block-scaled codes. The loss is computed in fp32 in
every row.
"""

from __future__ import annotations

import dataclasses

import torch
from _harness import TORCH_BUILTIN_OPTIONS
from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

import simplefsdp

__all__ = [
    "CONFIGS",
    "FRONTIER",
    "GATHER_BLOCK",
    "ROW_SETS",
    "TWIN",
    "Config",
    "compile_options",
    "config_of",
    "fsdp2_policy",
    "passes_of",
    "rows_of_sets",
    "simplefsdp_policy",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """One row's setup."""

    label: str
    family: str  # "ddp", "fsdp2" or "simplefsdp"
    strategy: str = "FULL_SHARD"
    compiled: bool = True
    passes: str = "ours"  # simplefsdp: "ours", "auto", "none" or "torch" (inductor's own FX bucketing)
    budget: float | None = None  # the auto plan's memory_budget
    peak_growth: int | None = None  # ReorderConfig.max_peak_growth_bytes of our passes
    buffer_reuse: bool | None = None  # inductor's allow_buffer_reuse; None: the run's setting
    precision: str = "fp32"  # "fp32", or "bf16": parameters gathered and used in bf16, fp32 masters and reductions
    gather: str | None = None  # simplefsdp's MixedPrecisionPolicy.gather_dtype (quantized parameter gathers)


FP32_CONFIGS = {  # key (for --rows and the JSON) -> setup, the rows of `--set fp32` (with the frontier)
    "ddp": Config("DDP", "ddp", compiled=False),
    "fsdp2": Config("FSDP2 eager", "fsdp2", compiled=False),
    "fsdp2-compile": Config("FSDP2 + compile per block", "fsdp2"),
    "simplefsdp-eager": Config("simplefsdp eager", "simplefsdp", compiled=False),
    "no-passes": Config("simplefsdp compiled, no passes", "simplefsdp", passes="none"),
    "ours": Config("simplefsdp compiled, our passes", "simplefsdp"),
    "ours-no-growth": Config("simplefsdp compiled, our passes, no peak growth", "simplefsdp", peak_growth=0),
    "ours-auto": Config("simplefsdp compiled, our passes (auto plan)", "simplefsdp", passes="auto"),
    "torch-passes": Config("simplefsdp compiled, torch's passes", "simplefsdp", passes="torch"),
    "fsdp2-zero2": Config("FSDP2 eager, SHARD_GRAD_OP", "fsdp2", strategy="SHARD_GRAD_OP", compiled=False),
    "fsdp2-compile-zero2": Config("FSDP2 + compile per block, SHARD_GRAD_OP", "fsdp2", strategy="SHARD_GRAD_OP"),
    "ours-zero2": Config("simplefsdp SHARD_GRAD_OP, our passes", "simplefsdp", strategy="SHARD_GRAD_OP"),
    "ours-zero2-auto": Config(
        "simplefsdp SHARD_GRAD_OP, our passes (auto plan)", "simplefsdp", strategy="SHARD_GRAD_OP", passes="auto"
    ),
    "torch-passes-zero2": Config(
        "simplefsdp SHARD_GRAD_OP, torch's passes", "simplefsdp", strategy="SHARD_GRAD_OP", passes="torch"
    ),
}
BF16_CONFIGS = {  # like for like under one mixed precision: bf16 parameters in compute, fp32 reductions
    "fsdp2-bf16": Config("FSDP2 eager, bf16", "fsdp2", compiled=False, precision="bf16"),
    "fsdp2-compile-bf16": Config("FSDP2 + compile per block, bf16", "fsdp2", precision="bf16"),
    "ours-bf16": Config("simplefsdp compiled, our passes, bf16", "simplefsdp", precision="bf16"),
    "ours-auto-bf16": Config(
        "simplefsdp compiled, our passes (auto plan), bf16", "simplefsdp", passes="auto", precision="bf16"
    ),
}
QUANT_CONFIGS = {  # the bf16 policy with block-scaled quantized parameter gathers (block 128)
    "ours-int8": Config(
        "simplefsdp compiled, our passes, bf16, int8 gathers", "simplefsdp", precision="bf16", gather="int8"
    ),
    "ours-fp8": Config(
        "simplefsdp compiled, our passes, bf16, fp8 gathers", "simplefsdp", precision="bf16", gather="float8_e4m3fn"
    ),
}
CONFIGS = FP32_CONFIGS | BF16_CONFIGS | QUANT_CONFIGS
ROW_SETS = {"fp32": FP32_CONFIGS, "bf16": BF16_CONFIGS, "quant": QUANT_CONFIGS}  # --set; "all": every one
GATHER_BLOCK = 128  # elements per quantization scale of the quantized rows (the policy's default)
FRONTIER = "auto@"  # + a budget fraction: the auto plan under that memory budget
TWIN = "~reuse-"  # + "on" / "off": a compiled row with inductor's buffer reuse forced that way


def rows_of_sets(sets: str, frontier: str) -> list[str]:
    """The rows of the comma-separated `--set` value `sets`, in `ROW_SETS` order; the fp32 set ends
    with the auto plan at each budget of the comma-separated `frontier`."""
    names = {name.strip() for name in sets.split(",") if name.strip()}
    if "all" in names:
        names = set(ROW_SETS)
    if not names or names - set(ROW_SETS):
        raise ValueError(f"--set {sets!r}: a comma-separated list of {', '.join(ROW_SETS)}, or all")
    rows = []
    for name, configs in ROW_SETS.items():
        if name in names:
            rows += configs
            if name == "fp32":
                rows += [f"{FRONTIER}{f.strip()}" for f in frontier.split(",") if f.strip()]
    return rows


def config_of(key: str) -> Config:
    """The setup of row `key`: one of `CONFIGS`, or `auto@F` for the auto plan with budget fraction F;
    either with `~reuse-on` / `~reuse-off` for a compiled row with inductor's buffer reuse forced."""
    if TWIN in key:
        base, setting = key.split(TWIN, 1)
        config = config_of(base)
        if setting not in ("on", "off") or not config.compiled:
            raise ValueError(f"row {key!r}: {TWIN}on / {TWIN}off follows a compiled row")
        label = f"{config.label} [buffer reuse {setting}]"
        return dataclasses.replace(config, label=label, buffer_reuse=setting == "on")
    if key in CONFIGS:
        return CONFIGS[key]
    if key.startswith(FRONTIER):
        budget = float(key.removeprefix(FRONTIER))
        return Config(f"simplefsdp compiled, auto plan, budget {budget:g}", "simplefsdp", passes="auto", budget=budget)
    raise ValueError(f"unknown row {key!r}; known: {', '.join(CONFIGS)}, or {FRONTIER}<fraction>")


def simplefsdp_policy(config: Config) -> simplefsdp.MixedPrecisionPolicy:
    """simplefsdp's mixed precision of a row: none (fp32), or bf16 parameters with fp32 reductions,
    quantized gathers where the row has them."""
    if config.precision == "fp32":
        return simplefsdp.MixedPrecisionPolicy()
    return simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, gather_dtype=config.gather, gather_block=GATHER_BLOCK
    )


def fsdp2_policy(config: Config) -> FSDP2Policy:
    """FSDP2's mixed precision of a row: the same dtypes as `simplefsdp_policy` (FSDP2 has no
    quantized gathers)."""
    if config.precision == "fp32":
        return FSDP2Policy()
    return FSDP2Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def passes_of(config: Config, profile: str) -> simplefsdp.PassConfig | None:
    """The simplefsdp passes of a row (None: off, for no passes and for torch's own)."""
    if config.passes in ("none", "torch"):
        return None
    if config.passes == "auto":
        bucket = simplefsdp.BucketConfig(plan="auto", device=profile, memory_budget=config.budget)
        return simplefsdp.PassConfig(bucket=bucket)
    if config.peak_growth is not None:
        return simplefsdp.PassConfig(reorder=simplefsdp.ReorderConfig(max_peak_growth_bytes=config.peak_growth))
    return simplefsdp.PassConfig()


def compile_options(config: Config, buffer_reuse: bool) -> dict[str, object]:
    """The inductor options a compiled row compiles with ([Note: one inductor setting for every
    compiled row] in scoreboard.py): `buffer_reuse` is the run's setting, which a twin row overrides."""
    reuse = buffer_reuse if config.buffer_reuse is None else config.buffer_reuse
    return {**(TORCH_BUILTIN_OPTIONS if config.passes == "torch" else {}), "allow_buffer_reuse": reuse}
