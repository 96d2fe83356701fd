"""A tiny `LlamaForCausalLM` trained by `transformers.Trainer`: the plain one in one process, or
`simplefsdp.hf.Trainer` on the ranks torchrun starts.

    python -m tests.hf._trainer_job --out DIR --mode reference                 # one process, global batch 8
    torchrun --nproc-per-node 2 -m tests.hf._trainer_job --out DIR --mode simplefsdp   # 2 ranks x 2 x 2 micro
    python -m tests.hf._trainer_job --out DIR --mode tiny-reference            # float32, the loss times TINY
    torchrun --nproc-per-node 2 -m tests.hf._trainer_job --out DIR --mode tiny-fp16    # float16, fp16=True

`reference` / `simplefsdp`: both train `STEPS` AdamW steps on the same 64 sequences in the same order
(the Trainer's sampler is seeded; Accelerate hands rank r the r-th slice of each loader batch, so one
optimizer step's two micro-batches over two ranks hold the 8 sequences the single process takes at
once); the simplefsdp mode is compiled with inductor through the Trainer's `torch_compile`, two
micro-batches accumulated per step. `tiny-reference` / `tiny-fp16`: `STEPS` SGD steps, eager, on a
loss multiplied by `TINY`, so that without loss scaling most float16 gradients would underflow, and
gradients clipped to `TINY_CLIP` (below their norm: every step clips, so the clip must see unscaled
gradients); the fp16 mode wraps the model with a float16 policy and sets `fp16=True`.
Every mode ends with `trainer.save_model(DIR/final)`. The simplefsdp modes save Trainer checkpoints at
step 2 and 4, then build a fresh model and resume a second Trainer from `checkpoint-2` to step 4,
saving it to `DIR/resumed`, and write `DIR/run.json`: the losses (and gradient norms) by step of both
Trainers, the process group's backend, and the fp16 modes' loss-scaler state at the end of each.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

from tests.hf._tiny import llama_config

BATCH = 8  # sequences per optimizer step, over all ranks (and micro-batches)
ACCUMULATE = 2  # micro-batches per optimizer step in the simplefsdp run
STEPS = 4
SEQ = 17
TINY = 2.0**-16  # the tiny modes' loss factor: logit gradients of about 2^-29..2^-23, float16's underflow
TINY_CLIP = 5e-6  # max_grad_norm of the tiny modes: about half the gradients' norm (about 1.2e-5)
TINY_LR = 2000.0  # SGD: clipped steps of about 1e-2


class Sequences(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = llama_config(max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def arguments(out: str, world: int, **extra) -> transformers.TrainingArguments:
    extra.setdefault("learning_rate", 1e-2)
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH // world,
        max_steps=STEPS,
        seed=0,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def _history(trainer: transformers.Trainer, key: str) -> dict[int, float]:
    """`key` ("loss", "grad_norm") by step, as logged (a resumed Trainer's history starts with its checkpoint's)."""
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


class TinyLossTrainer(transformers.Trainer):
    """The model's loss times `TINY` (so its gradients too)."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        return (result[0] * TINY, result[1]) if return_outputs else result * TINY


def _tiny_arguments(out: str, world: int, **extra) -> transformers.TrainingArguments:
    return arguments(out, world, optim="sgd", learning_rate=TINY_LR, max_grad_norm=TINY_CLIP, **extra)


def reference(out: str) -> None:
    trainer = transformers.Trainer(model=model(), args=arguments(out, 1, save_strategy="no"), train_dataset=Sequences())
    _finish(trainer, out)


def tiny_reference(out: str) -> None:
    args = _tiny_arguments(out, 1, save_strategy="no")
    _finish(TinyLossTrainer(model=model(), args=args, train_dataset=Sequences()), out)


def _finish(trainer: transformers.Trainer, out: str) -> None:
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    with open(os.path.join(out, "run.json"), "w") as file:
        json.dump({"loss": _history(trainer, "loss"), "grad_norm": _history(trainer, "grad_norm")}, file)


def _simplefsdp_trainer(out: str, fp16: bool) -> transformers.Trainer:
    import simplefsdp
    import simplefsdp.hf

    world = torch.distributed.get_world_size()
    if not fp16:
        wrapped = simplefsdp.wrap(model())
        # compiled by the Trainer's own `torch_compile` (the mixin compiles in place); each optimizer step
        # accumulates two micro-batches of 2 sequences per rank: the same 8 sequences a step as the reference
        args = arguments(
            out,
            ACCUMULATE * world,
            save_strategy="steps",
            save_steps=2,
            torch_compile=True,
            gradient_accumulation_steps=ACCUMULATE,
        )
        return simplefsdp.hf.Trainer(model=wrapped, args=args, train_dataset=Sequences())

    class Tiny(simplefsdp.hf.SimpleFSDPTrainerMixin, TinyLossTrainer):
        pass

    wrapped = simplefsdp.wrap(model(), mp_policy=simplefsdp.MixedPrecisionPolicy(param_dtype=torch.float16))
    args = _tiny_arguments(out, world, save_strategy="steps", save_steps=2, fp16=True)
    return Tiny(model=wrapped, args=args, train_dataset=Sequences())


def _summary(trainer: transformers.Trainer) -> dict:
    scaler = getattr(trainer, "grad_scaler", None)
    return {
        "loss": _history(trainer, "loss"),
        "grad_norm": _history(trainer, "grad_norm"),
        "scaler": None if scaler is None else scaler.state_dict(),
    }


def with_simplefsdp(out: str, fp16: bool) -> None:
    import simplefsdp

    torch.distributed.init_process_group(simplefsdp.gloo.backend())  # [Note: torch's two gloo workers race]
    trainer = _simplefsdp_trainer(out, fp16)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    run = _summary(trainer)
    resumed = _simplefsdp_trainer(out, fp16)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "run.json"), "w") as file:
            backend = torch.distributed.get_backend()
            json.dump({"run": run, "resumed": _summary(resumed), "backend": backend}, file)
    torch.distributed.destroy_process_group()


MODES = {
    "reference": reference,
    "tiny-reference": tiny_reference,
    "simplefsdp": lambda out: with_simplefsdp(out, fp16=False),
    "tiny-fp16": lambda out: with_simplefsdp(out, fp16=True),
}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=tuple(MODES), required=True)
    options = parser.parse_args()
    MODES[options.mode](options.out)
