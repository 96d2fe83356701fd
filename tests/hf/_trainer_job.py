"""A tiny `LlamaForCausalLM` trained by `transformers.Trainer`: the plain one in one process, or
`simplefsdp.hf.Trainer` on the ranks torchrun starts (compiled with inductor through the Trainer's
`torch_compile`, two micro-batches accumulated per step).

    python -m tests.hf._trainer_job --out DIR --mode reference                 # one process, global batch 8
    torchrun --nproc-per-node 2 -m tests.hf._trainer_job --out DIR --mode simplefsdp   # 2 ranks x 2 x 2 micro

Both train `STEPS` AdamW steps on the same 64 sequences in the same order (the Trainer's sampler is
seeded; Accelerate hands rank r the r-th slice of each loader batch, so one optimizer step's two
micro-batches over two ranks hold the 8 sequences the single process takes at once) and end
with `trainer.save_model(DIR/final)`. The simplefsdp mode saves Trainer checkpoints at step 2 and
4, then builds a fresh model and resumes a second Trainer from `checkpoint-2` to step 4, saving it
to `DIR/resumed`.
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
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH // world,
        max_steps=STEPS,
        learning_rate=1e-2,
        seed=0,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def _losses(trainer: transformers.Trainer) -> dict[int, float]:
    """Loss by step, as logged (a resumed Trainer's history starts with its checkpoint's)."""
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def reference(out: str) -> None:
    trainer = transformers.Trainer(model=model(), args=arguments(out, 1, save_strategy="no"), train_dataset=Sequences())
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    with open(os.path.join(out, "losses.json"), "w") as file:
        json.dump(_losses(trainer), file)


def _simplefsdp_trainer(out: str, **extra) -> transformers.Trainer:
    import simplefsdp
    import simplefsdp.hf

    wrapped = simplefsdp.wrap(model())
    # compiled by the Trainer's own `torch_compile` (the mixin compiles in place); each optimizer step
    # accumulates two micro-batches of 2 sequences per rank: the same 8 sequences a step as the reference
    args = arguments(
        out,
        ACCUMULATE * torch.distributed.get_world_size(),
        save_strategy="steps",
        save_steps=2,
        torch_compile=True,
        gradient_accumulation_steps=ACCUMULATE,
        **extra,
    )
    return simplefsdp.hf.Trainer(model=wrapped, args=args, train_dataset=Sequences())


def with_simplefsdp(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    trainer = _simplefsdp_trainer(out)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    losses = _losses(trainer)
    resumed = _simplefsdp_trainer(out)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    resumed.save_model(os.path.join(out, "resumed"))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "losses.json"), "w") as file:
            json.dump({"run": losses, "resumed": _losses(resumed)}, file)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("reference", "simplefsdp"), required=True)
    options = parser.parse_args()
    (reference if options.mode == "reference" else with_simplefsdp)(options.out)
