"""`transformers.Trainer` training a model that `simplefsdp.wrap()` sharded.

    trainer = simplefsdp.hf.Trainer(model=model, args=args, train_dataset=data)
    class MyTrainer(simplefsdp.hf.SimpleFSDPTrainerMixin, SomeTrainerSubclass): ...   # any Trainer subclass

[Note: how the Trainer is kept from wrapping the model in DDP]
The Trainer does not wrap a model for data parallelism itself: it hands the model to
`Accelerator.prepare`, whose `prepare_model` wraps it in `DistributedDataParallel` whenever the job
is distributed (on CPU ranks, `MULTI_CPU`: unconditionally; on GPUs it refuses a model with DTensor
parameters). DDP over sharded parameters would reduce every gradient a second time. The ways around
it, read in both sources:
- a subclass overriding the Trainer's `_prepare_for_training`: a long private method, to be copied;
- `is_distributed_loading_by_transformers` on the model: the Trainer's flag (transformers 5) for
  models it sharded itself; it also switches on their FSDP2-specific gradient deferral and refuses
  to save optimizer state (so no resume);
- `model._is_accelerate_prepared = True`: Accelerate's own mark of a model it already prepared;
  `prepare_model` then returns the model as it is (accelerate 1.14 on), and everything else
  Accelerate does (the data loader split over ranks, the optimizer wrapper, gradient clipping,
  `no_sync` as a no-op for a module that is not DDP) still happens.
We take the last: one attribute on the model, no Trainer code copied (`_compat.py`, [Note: the
Trainer and Accelerate internals simplefsdp.hf relies on], with the versions it was checked on).
What `prepare_model` would also have done is then ours to do or to refuse, by name, at
construction: `torch_compile` (the mixin compiles the model in place, `model.compile()`, with the
arguments' backend and mode), `bf16` autocast (refused: `wrap(mp_policy=...)` casts the gathers
instead), and the Trainer's own `fsdp`, `deepspeed` and `gradient_checkpointing` /
`activation_checkpointing` (refused: the model is sharded already; use
`simplefsdp.checkpoint_blocks`), and `load_best_model_at_end` (its loading runs on rank 0 alone).
Gradient accumulation needs nothing: `Accelerator.no_sync` is a no-op for a model without a
`no_sync` method, so each micro-batch's gradients are reduced and summed, as DDP's synchronized sum
would be (tested: two micro-batches a step match one process).

[Note: fp16 in the Trainer]
`TrainingArguments(fp16=True)` asks Accelerate for autocast and a loss scaler. Autocast is not
applied to a simplefsdp model (the model is marked prepared, and `wrap(mp_policy=...)` casts the
gathers instead), so float16 compute is the model's policy, and fp16=True is the loss scaling: the
mixin hands Accelerate `simplefsdp.grad_scaler(model)` (torch's `ShardedGradScaler`, whose skip
decision is the same on every rank: [Note: the skip decision is reduced over every rank] in
`loss_scaling.py`), which Accelerate uses as its own -- `backward` scales the loss, clipping
unscales first, the optimizer step goes through the scaler (skipped on every rank on an inf or nan)
-- also on CPU, where Accelerate makes no scaler for fp16. Each without the other is refused at
construction: fp16=True with a model that computes and reduces in float32 or bfloat16 (nothing to
scale: wrap with `MixedPrecisionPolicy(param_dtype=torch.float16)`), and a model that gathers or
reduces in float16 without fp16=True (its gradients would underflow). The scaler's state goes into
the sharded checkpoint, so resuming continues with the same scale.

[Note: what a Trainer checkpoint holds]
The Trainer saves and loads on rank 0 only, which cannot gather sharded parameters (the others
would not join the collectives). The mixin replaces the four places that touch model or optimizer
state, all collective:
- `save_model` (public; it calls the private `_save`, on every rank in transformers 5, on the
  saving rank alone in transformers 4, so the mixin replaces `save_model` and leaves `_save`
  unused): `simplefsdp.checkpoint.export_full_state_dict` -- every rank gathers one parameter at a
  time, rank 0 writes `model.safetensors` (or shards + index), loadable by `from_pretrained`; rank 0
  adds `config.json`, the generation config, the tokenizer and the training arguments;
- `_save_optimizer_and_scheduler`: the sharded model and optimizer state (and the fp16 loss
  scaler's) through `simplefsdp.checkpoint.save_checkpoint` under `<checkpoint>/simplefsdp/`
  (resumable on any world size), and the scheduler as the Trainer writes it;
- `_load_from_checkpoint`: `import_full_state_dict` (rank 0 reads, each rank gets its shards);
- `_load_optimizer_and_scheduler`: `load_checkpoint` of the sharded state (model and optimizer,
  exact; the loss scaler's), then the scheduler. The Trainer's own RNG and trainer-state files are
  per rank and kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from simplefsdp import checkpoint
from simplefsdp._compat import (
    check_trainer_internals,
    compiled_in_place,
    mark_prepared_for_accelerate,
    trainer_file_names,
    unwrap_compiled,
    use_grad_scaler,
)
from simplefsdp.class_swap import user_class
from simplefsdp.loss_scaling import CHECKPOINT_KEY, grad_scaler, needs_loss_scaling
from simplefsdp.wrap import is_wrapped_root

__all__ = ["SHARDED_DIR", "SimpleFSDPTrainerMixin", "Trainer"]

SHARDED_DIR = "simplefsdp"  # under a Trainer checkpoint: the sharded model + optimizer state

# TrainingArguments that would make the Trainer or Accelerate do to the model what simplefsdp does
_REFUSED = {
    "bf16": "autocast is not applied to a simplefsdp model: wrap(mp_policy=MixedPrecisionPolicy(param_dtype=...))",
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
    fp16, scaled = bool(args is not None and args.fp16), needs_loss_scaling(model)
    if fp16 and not scaled:
        raise ValueError(
            "TrainingArguments.fp16=True cannot be used: the model computes in no float16 and autocast is not applied "
            "to a simplefsdp model: wrap(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)) and keep "
            "fp16=True for the loss scaling"
        )
    if scaled and not fp16:
        raise ValueError(
            "the model gathers or reduces in float16 (its mp_policy): set TrainingArguments.fp16=True, which scales "
            "the loss (float16 gradients underflow without it)"
        )
    return model


class SimpleFSDPTrainerMixin:
    """Put before a `transformers.Trainer` (sub)class; see [Note: how the Trainer is kept from wrapping
    the model in DDP], [Note: fp16 in the Trainer] and [Note: what a Trainer checkpoint holds]. Every
    rank constructs it, and every rank calls `save_model` (the Trainer's own saving does)."""

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None, **kwargs):
        check_trainer_internals()
        _check(model, args)
        if args is not None and args.torch_compile and not compiled_in_place(model):
            model.compile(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
        mark_prepared_for_accelerate(model)  # Accelerate: already prepared, do not wrap in DDP
        super().__init__(model=model, args=args, **kwargs)
        self.grad_scaler = grad_scaler(model) if self.args.fp16 else None
        if self.grad_scaler is not None:
            use_grad_scaler(self.accelerator, self.grad_scaler)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: the model's full weights and what `from_pretrained` needs with them (see [Note:
        what a Trainer checkpoint holds]); then the Trainer's push to the Hub when it asks for one."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        checkpoint.export_full_state_dict(self.model, output_dir)  # collective; rank 0 writes
        if self.args.should_save:
            self._write_model_files(output_dir)
        if self.args.push_to_hub and not _internal_call:
            revision = getattr(self.args, "hub_revision", None)  # transformers 5 has the argument
            self.push_to_hub(commit_message="Model save", **({"revision": revision} if revision else {}))

    def _write_model_files(self, output_dir: str) -> None:
        """The saving rank: the config (its architecture the user's class), generation config,
        tokenizer or processor and training arguments beside the weights."""
        model = self.model
        if getattr(model, "config", None) is not None:
            model.config.architectures = [user_class(model).__name__]
            model.config.save_pretrained(output_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(output_dir)
        # the tokenizer or processor: `processing_class` from transformers 4.46, `tokenizer` before
        processor = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, trainer_file_names()[1]))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save_checkpoint(
            Path(output_dir) / SHARDED_DIR,
            step=self.state.global_step,
            model=self.model,
            optimizer=_unwrapped(self.optimizer),
            extra={} if self.grad_scaler is None else {CHECKPOINT_KEY: self.grad_scaler.state_dict()},
            keep_last=None,
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, trainer_file_names()[0]))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        checkpoint.import_full_state_dict(model if model is not None else self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        sharded = Path(checkpoint_dir) / SHARDED_DIR
        loaded = checkpoint.load_checkpoint(
            sharded, model=self.model, optimizer=_unwrapped(self.optimizer), restore_rng=False
        )
        if self.grad_scaler is not None and CHECKPOINT_KEY in loaded.extra:
            self.grad_scaler.load_state_dict(loaded.extra[CHECKPOINT_KEY])
        scheduler = os.path.join(checkpoint_dir, trainer_file_names()[0])
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer`."""
    return getattr(optimizer, "optimizer", optimizer)


class Trainer(SimpleFSDPTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` for a simplefsdp model: a drop-in replacement (see the module docstring)."""
