"""Hugging Face integration: `transformers.Trainer` on a simplefsdp model (needs `simplefsdp[hf]`).

    import simplefsdp.hf
    simplefsdp.wrap(model)                      # under torchrun, after the process group is up
    model.compile()                             # in place: the model stays a PreTrainedModel
    trainer = simplefsdp.hf.Trainer(model=model, args=args, train_dataset=data)

Files: `trainer.py` (the Trainer mixin and class). Accelerate's FSDP settings are read by
`simplefsdp.from_accelerate` (`simplefsdp/accelerate_config.py`), which needs no transformers.
"""

from simplefsdp.hf.trainer import SimpleFSDPTrainerMixin, Trainer

__all__ = ["SimpleFSDPTrainerMixin", "Trainer"]
