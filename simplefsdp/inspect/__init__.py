"""See what the compiler did to a wrapped model's training step: graphs, buckets, schedule, memory, pictures.

    report = inspect_model(wrapped_model, example_input, device="h100")       # any process group
    result = dry_run("llama3-70b", world_size=1024, device="h100")           # no GPU, no memory
    report.save("out/")  # graphs, inductor code, JSON tables, timeline.png, timeline.html
    graphs = record_step(wrapped_model, lambda compiled: compiled(x).sum())  # just the graphs, pre / post pass

What to run: `simplefsdp.inspect.advise.advise(...)` (the search, `advise.py`), on the command line
`--advise`. Command line: `simplefsdp inspect MODEL --world N --device h100 --out DIR` (`cli.py`).
The names load on first use ([Note: lazy package exports] in `simplefsdp/_lazy.py`).
"""

from simplefsdp._lazy import lazy_exports

__all__ = [
    "SHAPES",
    "BucketRow",
    "DryRunResult",
    "GraphRecorder",
    "MemoryEstimate",
    "ModelShape",
    "Report",
    "StepCapture",
    "StepGraphs",
    "StepSchedule",
    "bucket_table",
    "capture_step",
    "dry_run",
    "estimate_memory",
    "fake_world",
    "inspect_model",
    "make_mesh",
    "model_shape",
    "record_step",
    "recording",
    "save_html",
    "save_png",
    "simulate_step",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "simplefsdp.inspect.buckets": ("BucketRow", "bucket_table"),
        "simplefsdp.inspect.capture": ("StepCapture", "capture_step"),
        "simplefsdp.inspect.dryrun": ("DryRunResult", "dry_run", "fake_world", "make_mesh"),
        "simplefsdp.inspect.memory": ("MemoryEstimate", "estimate_memory"),
        "simplefsdp.inspect.record": ("GraphRecorder", "StepGraphs", "record_step", "recording"),
        "simplefsdp.inspect.report": ("Report", "inspect_model"),
        "simplefsdp.inspect.schedule": ("StepSchedule", "simulate_step"),
        "simplefsdp.inspect.shapes": ("SHAPES", "ModelShape", "model_shape"),
        "simplefsdp.inspect.timeline": ("save_html", "save_png"),
    },
)
