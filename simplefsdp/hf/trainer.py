"""`transformers.Trainer` training a model that `simplefsdp.wrap()` sharded.

    trainer = simplefsdp.hf.Trainer(model=model, args=args, train_dataset=data)
    class MyTrainer(simplefsdp.hf.SimpleFSDPTrainerMixin, SomeTrainerSubclass): ...   # any Trainer subclass

[Note: how the Trainer is kept from wrapping the model in DDP]
The Trainer (transformers 5.24) does not wrap a model for data parallelism itself: it hands the
model to `Accelerator.prepare`, whose `prepare_model` wraps it in `DistributedDataParallel` whenever
the job is distributed (on CPU ranks, `MULTI_CPU`: unconditionally; on GPUs it refuses a model with
DTensor parameters). DDP over sharded parameters would reduce every gradient a second time. The
ways around it, read in both sources:
- a subclass overriding the Trainer's `_prepare_for_training`: a long private method, to be copied;
- `is_distributed_loading_by_transformers` on the model: the Trainer's flag for models it sharded
  itself; it also switches on their FSDP2-specific gradient deferral and refuses to save optimizer
  state (so no resume);
- `model._is_accelerate_prepared = True`: Accelerate's own mark of a model it already prepared;
  `prepare_model` then returns the model as it is, and everything else Accelerate does (the data
  loader split over ranks, the optimizer wrapper, gradient clipping, `no_sync` as a no-op for a
  module that is not DDP) still happens.
We take the last: one attribute on the model, no Trainer code copied. What `prepare_model` would also
have done is then ours to do or to refuse, by name, at construction: `torch_compile` (the mixin
compiles the model in place, `model.compile()`, with the arguments' backend and mode), `bf16` / `fp16`
autocast (refused: `wrap(mp_policy=...)` casts the gathers instead), and the Trainer's own `fsdp`,
`deepspeed` and `gradient_checkpointing` / `activation_checkpointing` (refused: the model is sharded already; use
`simplefsdp.checkpoint_blocks`), and `load_best_model_at_end` (its loading runs on rank 0 alone).
Gradient accumulation needs nothing: `Accelerator.no_sync` (accelerate 1.15) is a no-op for a model
without a `no_sync` method, so each micro-batch's gradients are reduced and summed, as DDP's
synchronized sum would be (tested: two micro-batches a step match one process).

[Note: what a Trainer checkpoint holds]
The Trainer saves and loads on rank 0 only, which cannot gather sharded parameters (the others
would not join the collectives). The mixin replaces the four places that touch model or optimizer
state, all collective:
- `save_model` (through `_save`): `simplefsdp.checkpoint.export_full_state_dict` -- every rank
  gathers one parameter at a time, rank 0 writes `model.safetensors` (or shards + index), loadable
  by `from_pretrained`; rank 0 adds `config.json`, the generation config, the tokenizer and the
  training arguments;
- `_save_optimizer_and_scheduler`: the sharded model and optimizer state through
  `simplefsdp.checkpoint.save_checkpoint` under `<checkpoint>/simplefsdp/` (resumable on any
  world size), and the scheduler as the Trainer writes it;
- `_load_from_checkpoint`: `import_full_state_dict` (rank 0 reads, each rank gets its shards);
- `_load_optimizer_and_scheduler`: `load_checkpoint` of the sharded state (model and optimizer,
  exact), then the scheduler. The Trainer's own RNG and trainer-state files are per rank and kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from simplefsdp import checkpoint
from simplefsdp._compat import compiled_in_place, unwrap_compiled
from simplefsdp.class_swap import user_class
from simplefsdp.wrap import is_wrapped_root

__all__ = ["SHARDED_DIR", "SimpleFSDPTrainerMixin", "Trainer"]

SHARDED_DIR = "simplefsdp"  # under a Trainer checkpoint: the sharded model + optimizer state

# TrainingArguments that would make the Trainer or Accelerate do to the model what simplefsdp does
_REFUSED = {
    "bf16": "autocast is not applied to a simplefsdp model: wrap(mp_policy=MixedPrecisionPolicy(param_dtype=...))",
    "fp16": "autocast is not applied to a simplefsdp model: wrap(mp_policy=MixedPrecisionPolicy(param_dtype=...))",
    "fsdp": "the model is sharded by simplefsdp already (simplefsdp.from_accelerate reads FSDP settings)",
    "deepspeed": "the model is sharded by simplefsdp already",
    "gradient_checkpointing": "use simplefsdp.checkpoint_blocks(model) before compiling",
    "activation_checkpointing": "use simplefsdp.checkpoint_blocks(model) before compiling",
    "load_best_model_at_end": "the Trainer's best-model loading is not collective; not supported yet",
}


def _check(model: Any, args: transformers.TrainingArguments | None) -> nn.Module:
    if isinstance(model, nn.Module) and unwrap_compiled(model) is not model:
        raise TypeError("pass the wrapped model compiled in place (model.compile()), not torch.compile(model)")
    if not isinstance(model, nn.Module) or not is_wrapped_root(model):
        raise TypeError(f"simplefsdp.hf.Trainer trains a model simplefsdp.wrap() sharded; got {type(model).__name__}")
    for name, why in _REFUSED.items():
        if args is not None and getattr(args, name, None):
            raise ValueError(f"TrainingArguments.{name}={getattr(args, name)!r} cannot be used: {why}")
    return model


class SimpleFSDPTrainerMixin:
    """Put before a `transformers.Trainer` (sub)class; see [Note: how the Trainer is kept from wrapping
    the model in DDP] and [Note: what a Trainer checkpoint holds]. Every rank constructs it."""

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None, **kwargs):
        _check(model, args)
        if args is not None and args.torch_compile and not compiled_in_place(model):
            model.compile(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
        model._is_accelerate_prepared = True  # Accelerate: already prepared, do not wrap in DDP
        super().__init__(model=model, args=args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            raise ValueError("simplefsdp.hf.Trainer saves the model's own (gathered) state; state_dict must be None")
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        checkpoint.export_full_state_dict(self.model, output_dir)  # collective; rank 0 writes
        if not self.args.should_save:
            return
        model = self.model
        if getattr(model, "config", None) is not None:
            model.config.architectures = [user_class(model).__name__]
            model.config.save_pretrained(output_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save_checkpoint(
            Path(output_dir) / SHARDED_DIR,
            step=self.state.global_step,
            model=self.model,
            optimizer=_unwrapped(self.optimizer),
            keep_last=None,
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        checkpoint.import_full_state_dict(model if model is not None else self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        sharded = Path(checkpoint_dir) / SHARDED_DIR
        checkpoint.load_checkpoint(sharded, model=self.model, optimizer=_unwrapped(self.optimizer), restore_rng=False)
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer`."""
    return getattr(optimizer, "optimizer", optimizer)


class Trainer(SimpleFSDPTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` for a simplefsdp model: a drop-in replacement (see the module docstring)."""
