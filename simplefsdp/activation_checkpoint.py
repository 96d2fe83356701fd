"""Activation checkpointing per block, composed with simplefsdp's resharding.

    simplefsdp.checkpoint_blocks(model)                        # every repeated block, full recompute
    simplefsdp.checkpoint_blocks(model, policy="selective")    # save matmul / attention outputs
    simplefsdp.checkpoint_blocks(model, blocks=["layers.0"], policy=my_sac_policy)

Each chosen block's `forward` runs under `torch.utils.checkpoint.checkpoint` (non-reentrant) with
a selective-checkpoint policy. A block's parameters are gathered inside the checkpointed region,
so in backward the recomputation re-gathers them: with FULL_SHARD that re-gather is the one the
backward needs anyway (under torch.compile the partitioner sees a single recomputed gather; the
graph tests count one re-gather per block), and nothing gathered is kept between forward and
backward. The block keeps its class (a subclass, `Checkpointed[<class>]`, is swapped in, as `wrap()`
does), its name and its parameters' names, so state dicts and optimizers do not change.

[Note: why "full" saves random ops]
With torch 2.13, compiling a checkpointed region that recomputes an op tagged
`nondeterministic_seeded` (scaled-dot-product attention is tagged so, also with dropout 0) fails
when the graph also saves a DeviceMesh for backward -- which every graph with DTensor parameters
does: the partitioner appends the replayed RNG states after the saved opaque objects, and
AOTAutograd's runtime then finds the mesh among the saved tensors ("expected all
tensors_saved_with_vc_check to be Tensors"). So the "full" policy recomputes every op except
those, whose outputs it saves (for attention: its output and log-sum-exp, [B, H, S, Dh] and
[B, H, S]); "selective" also saves matmul outputs. A user policy that recomputes attention
works in eager mode and hits that error under torch.compile.

[Note: side effects in a checkpointed block run once when compiled]
Eager non-reentrant checkpointing runs a block's forward again in backward, Python side effects
included. Dynamo cannot replay those in a compiled backward, so by default it refuses to trace a
checkpointed region whose forward mutates Python state outside it, and breaks the graph there --
at every checkpointed block. Hugging Face models with the `kernels` package installed (a
dependency of transformers from 5.25) do that in every layer: the wrapper that routes kernelized
functions sets a module-level variable on entering a forward and resets it on leaving. A graph
break per block splits each block's collectives over several graphs, which the passes cannot
bucket together. So while a wrapped root that has checkpointed blocks compiles (its
`simplefsdp.compile_scope`), Dynamo is told to run such side effects once, in the forward, and not
again in the recomputation (`_compat.checkpoint_side_effects_once`). A set-and-reset like that one
leaves the same state either way; a block whose forward must repeat a side effect in backward
(a call counter, a Python-side RNG) should not rely on it under torch.compile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.class_swap import subclass, user_class

__all__ = ["checkpoint_blocks", "has_checkpointed_blocks"]

Policy = Callable[..., CheckpointPolicy]
_POLICY_ATTR = "_simplefsdp_checkpoint_policy"
_ORIGINAL_ATTR = "_simplefsdp_uncheckpointed_class"
_HAS_ATTR = "_simplefsdp_has_checkpointed_blocks"  # on the module checkpoint_blocks() was given

_aten = torch.ops.aten
# outputs worth keeping under "selective": the matmuls and attention (compute-bound to recompute)
_SELECTIVE_SAVE = frozenset(
    (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
)


def _seeded(op: object) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def full_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Recompute everything except random ops (see [Note: why "full" saves random ops])."""
    return CheckpointPolicy.MUST_SAVE if _seeded(op) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Save matmul and attention outputs (and random ops'), recompute the cheap pointwise rest."""
    if op in _SELECTIVE_SAVE or _seeded(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_PRESETS: dict[str, Policy] = {"full": full_policy, "selective": selective_policy}


def _checkpointed_forward(self: nn.Module, *args: object, **kwargs: object) -> object:
    policy = getattr(self, _POLICY_ATTR)
    original = getattr(type(self), _ORIGINAL_ATTR)  # also right when wrap() subclassed this class again
    return checkpoint(
        original.forward,
        self,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        **kwargs,
    )


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    attrs = {"forward": _checkpointed_forward, _ORIGINAL_ATTR: cls, "__module__": __name__}
    return subclass(cls, adds="Checkpointed", attrs=attrs)


def checkpoint_blocks(
    model: nn.Module,
    *,
    blocks: Sequence[str] | None = None,
    policy: Literal["full", "selective"] | Policy = "full",
) -> list[str]:
    """Checkpoint each block of `model` (in place); returns the FQNs of the checkpointed blocks.

    Args:
        blocks: module FQNs; `None` takes every repeated block (the children of a `ModuleList` of
            one class: the same blocks the default bucket plan uses).
        policy: `"full"` (recompute all but random ops), `"selective"` (also keep matmul and
            attention outputs), or a selective-checkpoint policy
            `(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy`.

    Works before or after `simplefsdp.wrap()`; a block is checkpointed once (a second call on it
    is an error, as is an unknown FQN or policy name).
    """
    if isinstance(policy, str):
        if policy not in _PRESETS:
            raise ValueError(f"unknown checkpoint policy {policy!r}; expected one of {sorted(_PRESETS)} or a callable")
        policy = _PRESETS[policy]
    elif not callable(policy):
        raise TypeError(f"policy must be 'full', 'selective' or a callable, got {type(policy).__name__}")
    names = list(find_repeated_blocks(model) if blocks is None else blocks)
    if not names:
        raise ValueError(
            f"{user_class(model).__name__} has no repeated blocks (children of a ModuleList of one class); "
            "name the modules to checkpoint with blocks=[...]"
        )
    modules = dict(model.named_modules())
    unknown = [name for name in names if name not in modules]
    if unknown:
        raise ValueError(f"no submodules named {unknown} in {user_class(model).__name__}")
    again = [name for name in names if hasattr(type(modules[name]), _ORIGINAL_ATTR)]
    if again:
        raise ValueError(f"blocks {again} are already checkpointed")
    for name in names:
        module = modules[name]
        setattr(module, _POLICY_ATTR, policy)
        module.__class__ = _checkpointed_class(type(module))
    setattr(model, _HAS_ATTR, True)
    return names


def has_checkpointed_blocks(model: nn.Module) -> bool:
    """Whether `checkpoint_blocks(model)` checkpointed blocks of `model` (read on every call of a
    wrapped root, so a flag rather than a walk over its modules)."""
    return getattr(model, _HAS_ATTR, False)
