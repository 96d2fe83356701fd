"""Model structure: a model's repeated blocks, and module-FQN patterns that name groups of modules.

The default bucket plan, activation checkpointing and the inspection views all group parameters
by block: the children of a container whose children share one class (a transformer's layers, a
ResNet stage's blocks). A bucket plan by patterns names groups itself, e.g.
`("tok_embeddings", "layers.*", "norm+output")`.

Invariant: everything here reads module names and classes only, which are the same on every rank.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from simplefsdp.class_swap import user_class

__all__ = ["block_of", "find_repeated_blocks", "match_pattern", "validate_patterns"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_repeated_blocks(model: nn.Module) -> list[str]:
    """FQNs of the children of every `ModuleList`, `Sequential` or `ModuleDict` with at least two
    children, all of one class: `layers.0` (a Llama's ModuleList), `layer1.0` (a ResNet stage's
    Sequential), `layers.3` (a ModuleDict keyed by layer id). Outer containers come first, as in
    `named_modules()`, so a plan that takes the first block owning a parameter takes the outer one."""
    blocks = []
    for fqn, module in model.named_modules():
        children = list(module.named_children())
        same_class = len({type(child) for _, child in children}) == 1
        if isinstance(module, _CONTAINERS) and len(children) > 1 and same_class:
            prefix = f"{fqn}." if fqn else ""
            blocks.extend(prefix + name for name, _ in children)
    return blocks


def block_of(fqn: str, blocks: Sequence[str]) -> str | None:
    """The first of `blocks` that is `fqn` or contains it (`layers.0` contains `layers.0.wq.weight`)."""
    return next((b for b in blocks if fqn == b or fqn.startswith(b + ".")), None)


def match_pattern(fqn: str, patterns: Sequence[str]) -> tuple[int, str] | None:
    """(pattern index, group name) of the first pattern matching `fqn` or one of its prefixes, else None.

    A pattern is `+`-joined alternatives, each an `fnmatch` pattern over one FQN prefix. A wildcard
    alternative (`layers.*`) names a group per matched prefix (`layers.0`, `layers.1`, ...); a plain
    entry (`norm+output`) is one group, named by the whole pattern."""
    parts = fqn.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for i, pattern in enumerate(patterns):
        for alternative in pattern.split("+"):
            for prefix in prefixes:
                if fnmatch.fnmatchcase(prefix, alternative.strip()):
                    return (i, prefix if "*" in alternative else pattern)
    return None


def validate_patterns(patterns: Sequence[str], model: nn.Module) -> None:
    """`ValueError` naming every pattern that matches no parameter of `model` (a typo would silently unbucket)."""
    fqns = [fqn for fqn, _ in model.named_parameters()]
    unused = [p for p in patterns if not any(match_pattern(fqn, [p]) for fqn in fqns)]
    if unused:
        raise ValueError(
            f"bucket patterns {unused} match no parameter of {user_class(model).__name__}; e.g. {fqns[:4]}"
        )
