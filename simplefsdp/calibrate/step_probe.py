"""Calibration's last timing: real compiled training steps, against what the profile predicts for them.

[Note: what a collective costs a step]
The other timings take each cost apart: a collective alone, its launch, its copy ops' calls, its
wake-up after compute, compute beside it. A compiled training step pays something on top for each
collective that none of them sees alone: over the scoreboard's rows, a fixed part plus a few tenths
of a millisecond per collective (bench/results/measurements.md, "the step probe"). So calibration
ends by measuring it in situ: one small Llama-style model (`PROBE`, not the benchmarks' models),
wrapped FULL_SHARD and compiled five times -- without passes (one collective per parameter use, each
waited right after its launch); with the default per-block buckets, not reordered (few collectives,
each waited right after its launch) and reordered (the default plan: the same buckets, run behind
compute); and with small buckets of about one feed-forward matrix each (`_small_cap`: several times
as many collectives), not reordered and reordered -- each timed for whole steps (forward, loss,
backward, AdamW step) and predicted by the schedule replay of `simplefsdp.inspect.schedule` on the
graphs it compiled, with the profile fitted from every other timing. `fit.fit_step_probe` splits the
error three ways by least squares: a part per collective (`step_collective_s`), a part per wait with
no compute since its launch (`step_exposed_wait_s`) -- or, where those waits cost less than the
collectives run behind compute, per collective run behind compute instead (`step_hidden_s`) -- and a
part that grows with neither (time outside the compiled graphs, which grows with the model, not with
the plan), left out: a plan cannot change it, and a different model would not share it.

Why five plans, not three: with only the first three, the per-wait term rests on the second and
third plans alone, which differ by a dozen or so exposed waits, so a few milliseconds of noise
between two such timings moves it by tenths of a millisecond, and the predictions of plans with
many collectives follow it. The two small-bucket plans differ by about 70 exposed waits at the same
collectives, which pins the term down. The split matters most where ranks outnumber cores: one term
per collective, fitted to two plans, charges the default plan's overlapped collectives for the
unbucketed plan's waits.

Which way the middle term goes depends on the host: where an exposed wait costs more than a
collective run behind compute, the fit charges it per exposed wait (`step_exposed_wait_s`); where
the reordered plans run slower than their unreordered twins although the rest of the profile has
them faster (gloo with one worker thread, [Note: torch's two gloo workers race] in
`simplefsdp/gloo.py`), a per-wait term would have to go negative, so the fit charges each
collective run behind compute instead (`step_hidden_s`). The numbers of both cases are in
bench/results/measurements.md ("the step probe").

[Note: compute as compiled]
Before the five plans, the same model is compiled without sharding (no collectives, no passes)
and its forward and backward are timed against their roofline at the profile's matmul and copy
rates: `fit.py` turns the pair into `DeviceProfile.compute_scale` ([Note: what a training step
adds] in `passes/cost.py`), and the five plans are then predicted with it -- so the per-collective
terms fitted from them are what is left once compute is charged what it really took.

[Note: the quick probes skip inductor]
`--quick` (and the scoreboard's `--tiny`) exists to check the pipeline in seconds, not to plan with:
its probe model (`PROBE_QUICK`, dim 32) is too small for its step times to say much about a real
model's. Compiled with inductor, its six forward-backward pairs (the compute probe and five plans)
would take nearly all of a quick calibration's time, inductor generating and building kernels.
So a quick run compiles them with `simplefsdp_aot_eager` (the same partitioned
graphs and post-grad passes, ours included, run op by op): the probes, their schedules and the fits
run as in a full run, but what they time is uncompiled compute, so a quick profile's
`compute_scale` and step terms describe that, not inductor's code. Plan with a full calibration.

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


def _backend(quick: bool) -> str:
    """The compiler the probes use: inductor, or for a quick run its post-grad graphs run op by op
    ([Note: the quick probes skip inductor])."""
    return "simplefsdp_aot_eager" if quick else "inductor"


def _small_cap(args: TransformerArgs, world: int) -> int:
    """The small-bucket plans' cap: the bytes one rank sends for one feed-forward matrix (fp32,
    `world` ranks), so that a bucket holds that matrix alone or two or three smaller parameters."""
    return args.dim * args.ffn_dim * 4 // world


def _plans(args: TransformerArgs, world: int) -> tuple[simplefsdp.PassConfig | None, ...]:
    """The five plans of [Note: what a collective costs a step], in the order they are timed. Not "the
    pass with bucketing off": that reorders a hundred small collectives to overlap, and on 2 gloo ranks
    one such probe of five hung in a reduce-scatter's wait; the small-bucket plans keep buckets of
    one or a few parameters (a parameter larger than the cap travels alone, as without passes)."""
    small = simplefsdp.BucketConfig(plan="cap", cap_bytes=_small_cap(args, world))
    return (
        None,
        simplefsdp.PassConfig(reorder=None),
        simplefsdp.PassConfig(),
        simplefsdp.PassConfig(bucket=small, reorder=None),
        simplefsdp.PassConfig(bucket=small),
    )


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
    compiled = torch.compile(model, backend=_backend(quick))
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
    passes: simplefsdp.PassConfig | None,
    args: TransformerArgs,
    profile: DeviceProfile,
    device: torch.device,
    backend: str,
) -> ProbeStep:
    model = _model(args, str(id(passes)), device)
    simplefsdp.wrap(model, passes=passes, compile_regions=False)  # its graphs are priced op by op
    compiled = torch.compile(model, backend=backend)
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
    plans = _plans(args, dist.get_world_size())
    return [_one_plan(passes, args, profile, device, _backend(quick)) for passes in plans]
