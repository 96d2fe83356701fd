"""See what the compiler did to a wrapped model's training step: graphs, buckets, schedule, memory, pictures.

    report = inspect_model(wrapped_model, example_input, device="h100")       # any process group
    result = dry_run("llama3-70b", world_size=1024, device="h100")           # no GPU, no memory
    report.save("out/")  # graphs, inductor code, JSON tables, timeline.png, timeline.html
    graphs = record_step(wrapped_model, lambda compiled: compiled(x).sum())  # just the graphs, pre / post pass

What to run: `simplefsdp.inspect.advise.advise(...)` (the search, `advise.py`), on the command line
`--advise`. Command line: `simplefsdp inspect MODEL --world N --device h100 --out DIR` (`cli.py`).
"""

from simplefsdp.inspect.buckets import BucketRow, bucket_table
from simplefsdp.inspect.capture import StepCapture, capture_step
from simplefsdp.inspect.dryrun import DryRunResult, dry_run, fake_world, make_mesh
from simplefsdp.inspect.memory import MemoryEstimate, estimate_memory
from simplefsdp.inspect.record import GraphRecorder, StepGraphs, record_step, recording
from simplefsdp.inspect.report import Report, inspect_model
from simplefsdp.inspect.schedule import StepSchedule, simulate_step
from simplefsdp.inspect.shapes import SHAPES, ModelShape, model_shape
from simplefsdp.inspect.timeline import save_html, save_png

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
