"""`simplefsdp train`: the main job -- a Llama-style model trained with simplefsdp + torch.compile.

    from simplefsdp.train import TrainConfig, launch
    outcome = launch(TrainConfig(steps=20, n_layers=2))   # spawns 2 gloo ranks (or uses torchrun's)

Files: `config.py` (settings, TOML, flags), `data.py` (embedded corpus, held-out tail, resumable
batches), `loop.py` (model, steps, checkpoints), `schedule.py` (learning rate by step),
`grad_norm.py` (global gradient norm, clipping), `evaluate.py` (held-out loss, text sample),
`hf_model.py` (`--model`: Hugging Face causal LMs, `--init-from`), `comm.py` (the communication
summary), `output.py` (rank 0's bar, summary line and run folder), `plot.py` (the loss curve),
`job_cache.py` (the run's compile-cache entry), `precompile.py` (`simplefsdp precompile`),
`launch.py` (torchrun or spawn), `cli.py` (the command).
The names load on first use ([Note: lazy package exports] in `simplefsdp/_lazy.py`).
"""

from simplefsdp._lazy import lazy_exports

__all__ = ["ConfigError", "TrainConfig", "TrainOutcome", "launch", "parse_args", "train"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "simplefsdp.train.config": ("ConfigError", "TrainConfig", "parse_args"),
        "simplefsdp.train.launch": ("launch",),
        "simplefsdp.train.loop": ("TrainOutcome", "train"),
    },
)
