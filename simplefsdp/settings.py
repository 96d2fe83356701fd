"""The values settings take, importable without torch: the command lines parse and check their
flags with these before torch is imported ([Note: lazy package exports] in `_lazy.py`).

    torch_dtype("bf16")              # torch.bfloat16, the dtype a --param-dtype bf16 means
    check_gather_block(128)          # None; a ValueError for a block a quantized gather cannot use
    parse_memory_budget("512MiB")    # 536870912, what --memory-budget 512MiB means
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

__all__ = [
    "AC_POLICIES",
    "DEFAULT_GATHER_BLOCK",
    "DTYPES",
    "GATHER_BLOCKS",
    "QUANTIZED_GATHER_DTYPES",
    "TIERS",
    "check_gather_block",
    "dtype_name",
    "parse_memory_budget",
    "profile_names",
    "torch_dtype",
]

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # a flag's dtype name -> torch's name

# what `MixedPrecisionPolicy.gather_dtype` accepts (`--gather-dtype` adds "none"): the code type each
# sharded element travels the all-gather as
QUANTIZED_GATHER_DTYPES = ("int8", "float8_e4m3fn")

GATHER_BLOCKS = (8, 8192)  # the smallest and largest quantization block (a power of two), in elements
DEFAULT_GATHER_BLOCK = 128  # elements per scale unless a policy or flag says otherwise

TIERS = ("none", "optimizer", "all")  # offload tiers: `OffloadPolicy.of_tier`, `--offload`

AC_POLICIES = ("none", "full", "selective")  # activation checkpointing of every block: `inspect --ac`

_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a flag's dtype name (a key of `DTYPES`)."""
    import torch  # here, not above: a command parses its flags before torch loads

    return getattr(torch, DTYPES[name])


def dtype_name(dtype: torch.dtype) -> str:
    """The flag's name of a torch dtype ("bf16"); torch's own name ("float64") for one not in `DTYPES`."""
    torch_name = str(dtype).removeprefix("torch.")
    return next((name for name, known in DTYPES.items() if known == torch_name), torch_name)


def check_gather_block(block: object) -> None:
    """`ValueError` unless `block` is a quantization block a quantized gather can use: an int, a power
    of two from `GATHER_BLOCKS[0]` to `GATHER_BLOCKS[1]` (the message names the value, the caller the
    setting)."""
    low, high = GATHER_BLOCKS
    if isinstance(block, bool) or not isinstance(block, int) or not low <= block <= high or block & (block - 1):
        raise ValueError(f"must be a power of two from {low} to {high}, got {block!r}")


def parse_memory_budget(text: str) -> int | float:
    """`BucketConfig.memory_budget` from a command line: "0.25" (a fraction of each graph's peak) or
    bytes with a unit ("512MiB", "2GiB", "4096B")."""
    for unit, scale in _UNITS.items():
        if text.endswith(unit):
            number = text.removesuffix(unit).strip()
            try:
                return int(float(number) * scale)
            except ValueError:
                break
    else:
        try:
            return float(text)
        except ValueError:
            pass
    raise ValueError(f"memory budget {text!r}: expected a fraction such as 0.25 or bytes such as 512MiB")


def profile_names() -> list[str]:
    """The named device profiles, sorted: the tables of the cost model's `profiles.toml`, read without
    importing the cost model (`simplefsdp.passes.cost.PROFILES` holds the profiles themselves)."""
    passes = importlib.util.find_spec("simplefsdp.passes")  # finds the package without running it
    with open(Path(passes.submodule_search_locations[0]) / "profiles.toml", "rb") as file:
        return sorted(tomllib.load(file))
