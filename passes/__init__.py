"""simplefsdp's compiler passes: what `torch.compile(model)` does to a wrapped model's collectives.

Every compile of a wrapped model runs its `FsdpPass` on inductor's post-grad forward and backward
graphs: find the FSDP collectives, plan buckets, merge each bucket into one collective, reorder
for overlap. Pick what it does with `simplefsdp.wrap(model, passes=PassConfig(...))`.

The modules, in the order a graph goes through them:

- `collectives.py`: the typed view of a collective node (`parse_collective`) and node predicates;
- `walk.py`: the depth-first graph walks the others build on;
- `uneven.py`: DTensor's split + pad + concatenation of an uneven gradient folded into one pad
  (first, on the joint graph, before inductor partitions it);
- `detect.py`: which collectives are FSDP's (a parameter's all-gather, a gradient's reduction);
- `plan.py`: pure bucket plans over candidates; `cost.py`: the cost model the `auto` plan uses;
- `bucket.py`: a bucket becomes copy-in -> one collective -> copy-out (`simplefsdp.kernels`);
  `backend.py`: on gloo a reduce-scatter bucket is an in-place all-reduce (what gloo does anyway);
- `reorder.py`: prefetch all-gathers, launch reductions early, within a byte budget;
- `fsdp_pass.py`: the pass and its configuration;
- `install.py`: how a plain `torch.compile(model)` runs it; `aot_eager.py`: the debugging backend.
"""

# `aot_eager` registers the `simplefsdp_aot_eager` compile backend: every module that compiles a
# wrapped model has imported this package by then (`simplefsdp.wrap` does)
from simplefsdp.passes import aot_eager as _aot_eager  # noqa: F401
from simplefsdp.passes.fsdp_pass import BucketConfig, FsdpPass, PassConfig
from simplefsdp.passes.reorder import ReorderConfig

__all__ = ["BucketConfig", "FsdpPass", "PassConfig", "ReorderConfig"]
