"""Tied parameters (one parameter object in several modules): gathered once per forward, reduced once.

[Note: why tied parameters are gathered once]
A tied parameter -- an embedding shared with the output head, say -- is accessed by each module
that holds it, and each access would gather it again. Every gather's backward is a reduction, so
two uses would cost two all-gathers and two reduce-scatters of the same tensor, whose sum is the
gradient. Instead, the root module's forward opens a scope (a dict, one per forward call on a
stack, so a nested or re-entrant call gets its own) and the first access of a tied parameter
stores its gathered tensor there; later accesses in the same forward reuse it. Autograd then sums
the uses' gradients before the one reduction. Cost: the gathered tensor lives from its first use
to its last in the forward (as it would in FSDP2, which gathers a tied weight with the root).

Invariant: only parameters marked tied at `wrap()` time are cached, and only between the root's
forward pre-hook and its forward hook (which also runs when the forward raises). Outside a root
forward -- a submodule called directly -- every access gathers, which is correct and just
reduces once per use.

Dynamo traces the hooks and the dict like any Python code, so the same holds compiled.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["gathered", "install_scope", "remember"]

_SCOPES: list[dict[str, torch.Tensor]] = []  # one per root forward in progress, innermost last
_INSTALLED = "_simplefsdp_tied_scope_hooks"


def gathered(key: str) -> torch.Tensor | None:
    """The full value of the tied parameter `key` names, if this root forward gathered it already."""
    return _SCOPES[-1].get(key) if _SCOPES else None


def remember(key: str, full: torch.Tensor) -> None:
    """Keep `full` as the tied parameter's value for the rest of this root forward (a no-op outside one)."""
    if _SCOPES:
        _SCOPES[-1][key] = full


def _open(module: nn.Module, args: tuple) -> None:
    _SCOPES.append({})


def _close(module: nn.Module, args: tuple, output: object) -> None:
    _SCOPES.pop()


def install_scope(root: nn.Module) -> None:
    """Make every forward of `root` a scope in which tied parameters are gathered once."""
    if getattr(root, _INSTALLED, None) is None:
        hooks = (root.register_forward_pre_hook(_open), root.register_forward_hook(_close, always_call=True))
        setattr(root, _INSTALLED, hooks)
