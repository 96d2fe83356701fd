"""Calibration's last timing: real compiled training steps, against what the profile predicts for them.

[Note: what a collective costs a step]
The other timings take each cost apart: a collective alone, its launch, its copy ops' calls, its
wake-up after compute, compute beside it. A compiled training step pays something on top for each
collective that none of them sees alone. Measured on the 2-core development host (2 gloo ranks),
the scoreboard's eight simplefsdp rows ran 24 ms + 0.41 ms per collective longer than the profile
predicted (27 to 224 collectives a step, least squares); `bench/inspect_validate.py`'s model, half
as deep, 0.34 ms per collective. So calibration ends by measuring it in situ: one small
Llama-style model (`PROBE`, not the benchmarks' models), wrapped FULL_SHARD and compiled three
times -- without passes (one collective per parameter use, each waited right after its launch),
with the default per-block buckets not reordered (few collectives, each waited right after its
launch) and with the default plan (the same buckets, run behind compute) -- each timed for whole
steps (forward, loss, backward, AdamW step) and predicted by the schedule replay of
`simplefsdp.inspect.schedule` on the graphs it compiled, with the profile fitted from every other
timing. `fit.fit_step_probe` splits the error three ways: a part per collective
(`step_collective_s`), a part per wait with no compute since its launch (`step_exposed_wait_s`:
the second and third plans differ only there), and a part that grows with neither (time outside
the compiled graphs, which grows with the model, not with the plan), left out: a plan cannot
change it, and a different model would not share it. The split matters where ranks outnumber
cores: on 4 gloo ranks over 2 cores two calibrations fitted 0.80 and 0.58 ms per wait right after
a launch (and 0 and 1.74 ms per collective: the two terms trade from run to run), on 2 ranks
0.15-0.39 ms per collective and 0-0.01 ms per such wait; one term per collective fitted to two
plans had charged the default plan's overlapped collectives for the unbucketed plan's waits (2.0 ms
each on 4 ranks: +21-25% on `inspect_validate`'s 4-rank rows).

Tried and withdrawn (2026-12-05): two more plans, buckets of about one feed-forward matrix
(`BucketConfig(plan="cap")`, 76 collectives) not reordered and reordered, about 70 exposed waits
apart where the second and third plans are 16 apart. Fitted over five plans, two scoreboard runs put
all 10 of their step predictions within 15% (0.16-0.30 ms per collective, 0.17-0.25 ms per such
wait), against 7 of 10 in the last run with three. But the small-bucket plans corrupted the heap on
2 gloo ranks ("malloc(): unaligned tcache chunk detected", SIGABRT; once SIGSEGV): over runs of 600
steps, reordered in 5 of 6 and not reordered in 1 of 2, where the default plan and the plan without
passes ran clean (2 of 2 each; the default also 4 runs of 300 steps). So the fault points at
bucketing with small `cap` buckets, not at reordering alone or at gloo with plain collectives: a
calibration must not run such a plan until it is found and fixed.

[Note: compute as compiled]
Before the three plans, the same model is compiled without sharding (no collectives, no passes)
and its forward and backward are timed against their roofline at the profile's matmul and copy
rates: `fit.py` turns the pair into `DeviceProfile.compute_scale` ([Note: what a training step
adds] in `passes/cost.py`), and the three plans are then predicted with it -- so the per-collective
terms fitted from them are what is left once compute is charged what it really took.

Invariant: the predictions are a pure function of the graphs and the profile, the same on every
rank; `timings.measure` times the steps like every other timing (median, then the largest over the
ranks), so every rank ends with the same points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import simplefsdp
from simplefsdp.inspect.record import recording
from simplefsdp.inspect.schedule import simulate_step
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.collectives import is_collective
from simplefsdp.passes.cost import DeviceProfile, compute_between
from simplefsdp.passes.install import pass_of

__all__ = ["PROBE", "PROBE_QUICK", "ProbeCompute", "ProbeStep", "probe_compute", "probe_steps"]

PROBE = TransformerArgs(vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_dim=344, max_seq_len=64)
PROBE_QUICK = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
_BATCH = 2
# the three plans: no passes (one collective per parameter use, each waited where traced), the
# default buckets not reordered (few collectives, each waited where traced) and the default plan
# (the same buckets, run behind compute). Not "the pass with bucketing off": that reorders a hundred
# small collectives to overlap, and on 2 gloo ranks one such probe of five hung in a reduce-scatter's wait
_PLANS = (None, simplefsdp.PassConfig(reorder=None), simplefsdp.PassConfig())


@dataclasses.dataclass(frozen=True)
class ProbeStep:
    """One plan of the probe, compiled: its collectives per step, the step the profile predicts,
    and the training step itself, for `timings.py` to time."""

    collectives: int
    exposed: int  # of which waited with no compute since their launch (`CommEvent.status` "exposed")
    predicted_s: float
    step: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class ProbeCompute:
    """The probe model compiled without sharding ([Note: compute as compiled]): the roofline seconds of
    its forward and backward under the profile it was costed with, and that forward and backward, to time."""

    roofline_s: float
    forward_backward: Callable[[], None]


def _model(args: TransformerArgs, tag: str, device: torch.device) -> Transformer:
    torch.manual_seed(0)
    with device:
        # a class per compile: Dynamo would otherwise reuse an earlier compile's forward
        return type(f"Probe{tag}", (Transformer,), {})(args)


def _tokens(args: TransformerArgs, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randint(0, args.vocab_size, (_BATCH, args.max_seq_len + 1), generator=generator).to(device)


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def probe_compute(*, profile: DeviceProfile, device: torch.device, quick: bool = False) -> ProbeCompute:
    """[Note: compute as compiled]: the probe model, unsharded, compiled on this rank and costed under
    `profile` (the scale it carries is left out: the roofline itself). Collective: call on every
    rank, which each compile the same graphs, so the roofline is the same on every rank."""
    args = PROBE_QUICK if quick else PROBE
    model = _model(args, "Compute", device)
    compiled = torch.compile(model)
    tokens = _tokens(args, device)

    def forward_backward() -> None:
        _loss(compiled(tokens[:, :-1]), tokens).backward()
        for param in model.parameters():
            param.grad = None

    with recording() as graphs:
        forward_backward()  # compiles the forward and the backward
    if len(graphs.post) != 2:
        raise RuntimeError(f"the probe compiled {len(graphs.post)} graphs unsharded, expected a forward and a backward")
    roofline = dataclasses.replace(profile, compute_scale=1.0)
    seconds = sum(sum(compute_between(roofline, graph, [])) for graph in graphs.post)
    return ProbeCompute(roofline_s=seconds, forward_backward=forward_backward)


def _one_plan(
    passes: simplefsdp.PassConfig | None, args: TransformerArgs, profile: DeviceProfile, device: torch.device
) -> ProbeStep:
    model = _model(args, str(id(passes)), device)
    simplefsdp.wrap(model, passes=passes)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = _tokens(args, device)

    def step() -> None:
        _loss(compiled(tokens[:, :-1]), tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with recording(pass_of(model)) as graphs:
        step()  # compiles the forward and the backward
    if len(graphs.post) != 2:
        raise RuntimeError(f"the probe's step compiled {len(graphs.post)} graphs, expected a forward and a backward")
    schedule = simulate_step(graphs.post[0], graphs.post[1], device=profile, model=model)
    collectives = sum(is_collective(node) for graph in graphs.post for node in graph.nodes)
    if collectives != len(schedule.comm):
        raise RuntimeError(f"the probe issues {collectives} collectives, its schedule waits {len(schedule.comm)}")
    exposed = sum(event.status == "exposed" for event in schedule.comm)
    return ProbeStep(collectives=collectives, exposed=exposed, predicted_s=schedule.step_s, step=step)


def probe_steps(*, profile: DeviceProfile, device: torch.device, quick: bool = False) -> list[ProbeStep]:
    """Each plan of [Note: what a collective costs a step], compiled on this rank and predicted under
    `profile` (timed by the caller, `timings.measure`). Collective: call on every rank."""
    args = PROBE_QUICK if quick else PROBE
    return [_one_plan(passes, args, profile, device) for passes in _PLANS]
