"""The scoreboard: simplefsdp against DDP, FSDP2 and torch's own compiler passes, same model, same data, one run.

    python bench/scoreboard.py                          # 2 gloo ranks on the CPU (one rank per GPU on CUDA)
    python bench/scoreboard.py --tiny --out /tmp/sb     # the end-to-end check the tests run (seconds, not a result)
    python bench/scoreboard.py --set bf16,quant         # only the bf16 and quantized-gather rows

Rows: see `_scoreboard_rows.py` (`--set fp32`: fp32; `bf16`: bf16 mixed precision, like for like;
`quant`: simplefsdp's quantized parameter gathers).

[Note: one inductor setting for every compiled row]
`wrap()` compiles a model on the CPU with inductor's buffer reuse off ([Note: no buffer reuse on the
CPU] in passes/install.py); torch's own settings keep it on. So that no row gains or loses by that
setting alone, every compiled row -- FSDP2's blocks, simplefsdp with no passes, with torch's passes and
with ours -- is compiled with the same `allow_buffer_reuse`, passed as `torch.compile(...,
options=...)` (applied inside simplefsdp's own settings, so it wins over them): `--buffer-reuse auto`
(the default) is what `wrap()` does on the device (off on the CPU, on on a GPU), `on` / `off` force
it. `--reuse-twins` adds, for every compiled row, a twin compiled the other way (`ROW~reuse-on` /
`ROW~reuse-off`), timed in the same interleaved run: the setting's effect on record, row by row.

The profile: unless `--profile FILE` names one, the ranks first measure this machine (what
`simplefsdp calibrate` does) and write `profile.json` next to the results; the auto rows plan with it
and the predictions below use it.

Measurements, per row:
- step time: median of `--steps` steps after `--warmup`, rank 0, forward + backward + optimizer step,
  the rows' steps interleaved behind barriers (see `_harness.interleaved_times`);
- tokens/s: global tokens per step (ranks x batch x seq) over that median;
- compile time: first step minus the median step, compile caches off (eager rows: 0);
- collectives / step: the process group's own collective calls recorded by `torch.profiler` in one
  step (events named `gloo:*` / `nccl:*`): the same counter for eager hooks and compiled code;
- gathered / step: in that same step, the bytes of the tensors its all-gathers gathered (each call's
  recorded input x ranks), the largest over the ranks ([Note: one counter for eager hooks and
  compiled code] in `_collectives.py`); in these rows only parameters are all-gathered;
- peak memory per rank: see [Note: peak memory]; the table shows the largest over the ranks;
- predicted step time and peak memory (simplefsdp's compiled rows with its own passes or none):
  `simplefsdp.inspect.dry_run` of the same configuration with the profile, in the parent process;
- once per run, the host's speed: the calibration's matmul timed again, interleaved with the rows'
  steps, against its time in the profile ([Note: the host's speed, twice]); with bf16 rows, the
  model's matmuls in bf16 and in fp32 ([Note: bf16 compute here]).

[Note: peak memory]
All rows live in one process (so their steps can be interleaved), so a process-wide high-water mark
cannot tell them apart. Peak = the row's resident state (bytes of this rank's parameters and
optimizer state, exact, plus DDP's gradient buckets, as many bytes as the parameters) + the step's
transient peak, measured in extra steps after the timing, two ways:
- tensor bytes (the "peak memory / rank" column, the targets, the picture): torch's allocator -- on
  CUDA `torch.cuda.max_memory_allocated` above `memory_allocated` before the step, on the CPU the
  allocator's running total over every thread at the allocation events `torch.profiler` records
  (`tensor_high_water_bytes`), which count
  inductor's buffers and gloo's staging tensors but not gloo's own scratch (a few MiB per
  all-reduce, outside torch's allocator);
- resident bytes (the "resident peak" column; CPU only): the kernel's resident high-water mark
  (VmHWM, reset through /proc/self/clear_refs just before the step) above the resident size before
  it, with glibc returning freed blocks of 64 KiB and more and a free heap top above 128 KiB
  (`simplefsdp.cpu_memory.return_freed_memory`; `malloc_trim(0)` before the step). It still counts
  freed memory glibc keeps inside its heaps
  (see [Note: resident is not allocated] in `simplefsdp/calibrate/high_water.py`): 35-52 MiB stayed
  resident after a simplefsdp step freed every tensor, so it moves with the allocation history of
  the rows measured before, and is shown, not held to a target.
The timing runs first, every row's ranks keeping the memory they free for their next step, as
spawned simplefsdp ranks do ([Note: freed memory kept on the CPU] in `simplefsdp/cpu_memory.py`;
under glibc's defaults, the compiled rows' steps fault thousands of pages back in every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import _scoreboard_report as report
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _collectives import StepCollectives, count_step_collectives
from _harness import (
    add_model_arguments,
    interleaved_times,
    model_args,
    record_header,
    release_freed_memory,
    spawn,
    state_bytes,
    transient_peak,
)
from _scoreboard_rows import (
    CONFIGS,
    FRONTIER,
    ROW_SETS,
    TWIN,
    Config,
    compile_options,
    config_of,
    fsdp2_policy,
    passes_of,
    rows_of_sets,
    simplefsdp_policy,
)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import simplefsdp
from simplefsdp._compat import functorch_config, inductor_config, major_minor
from simplefsdp.calibrate import measure, profile_from
from simplefsdp.calibrate.high_water import count_cpu_allocations_on_every_thread, tensor_high_water_bytes
from simplefsdp.inspect import dry_run
from simplefsdp.inspect.shapes import ModelShape
from simplefsdp.models import Transformer
from simplefsdp.passes.cost import save_profile

# an even vocabulary: torch 2.11's own bucketing cannot run uneven shards ([Note: torch 2.11's FX
# bucketing and uneven shards]); uneven shards are tested with simplefsdp's passes in tests/
TINY = {"layers": 2, "dim": 32, "heads": 4, "ffn": 88, "vocab": 68, "seq": 16, "warmup": 1, "steps": 2}


def _fsdp2(model: nn.Module, config: Config, buffer_reuse: bool) -> nn.Module:
    if config.compiled:
        options = compile_options(config, buffer_reuse)
        for i, block in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(block, options=options))
    reshard, policy = config.strategy == "FULL_SHARD", fsdp2_policy(config)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)


def _simplefsdp(model: nn.Module, config: Config, profile: str, buffer_reuse: bool) -> nn.Module:
    policy, passes = simplefsdp_policy(config), passes_of(config, profile)
    simplefsdp.wrap(model, strategy=config.strategy, mp_policy=policy, passes=passes)
    if not config.compiled:
        return model
    return torch.compile(model, options=compile_options(config, buffer_reuse))


def check_torch_passes(model: nn.Module, world: int, *, version: str = torch.__version__) -> None:
    """[Note: torch 2.11's FX bucketing and uneven shards]
    On torch 2.11.0 the "torch's passes" rows (inductor's own FX bucketing on our front end) abort
    a rank with gloo's "Received data size doesn't match expected size" whenever a parameter's rows
    do not divide by the ranks (the tiny configuration with a vocabulary of 67 over 2 ranks; 68 runs):
    the ranks then issue different collectives. torch 2.13 runs both. Refused up front, by name,
    before any rank can hang or abort on it."""
    if major_minor(version) >= (2, 13):
        return
    for name, param in model.named_parameters():
        if param.shape[0] % world:
            raise ValueError(
                f"torch {version}'s own FX bucketing (the \"torch's passes\" rows) issues different "
                f"collectives on different ranks when a parameter's rows do not divide by the ranks: "
                f"{name} has {param.shape[0]} rows over {world} ranks; use sizes the ranks divide, or "
                "torch >= 2.13"
            )


def build(
    row: str, args: argparse.Namespace, device: torch.device, profile: str
) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """(the model whose parameters the optimizer steps, the callable the step runs) for one row."""
    torch.manual_seed(0)
    with device:
        # [Note: one class per row] Dynamo reuses a compiled `forward` for any instance of the same
        # class whose guards pass, and the guards do not see which simplefsdp passes a model has:
        # "ours" and "ours-auto" would share graphs. A subclass per row keeps their compiles apart.
        model = type(f"Transformer_{row}", (Transformer,), {})(model_args(args))
    config = config_of(row)
    if config.family == "ddp":
        return model, DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if config.family == "fsdp2":
        return model, _fsdp2(model, config, args.buffer_reuse)
    if config.passes == "torch":
        check_torch_passes(model, dist.get_world_size())
    return model, _simplefsdp(model, config, profile, args.buffer_reuse)


def _state_bytes(row: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    ddp_buckets = sum(p.numel() * p.element_size() for p in model.parameters()) if row == "ddp" else 0
    return state_bytes(model, optimizer) + ddp_buckets  # DDP keeps gradient buckets as large as the params


@dataclasses.dataclass
class Row:
    step: Callable[[], None]
    state_bytes: Callable[[], int]
    first_step_s: float = 0.0
    collectives: StepCollectives | None = None


def _make_row(row: str, args: argparse.Namespace, device: torch.device, profile: str) -> Row:
    model, forward = build(row, args, device, profile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)  # [B, S + 1]

    def step() -> None:
        logits = forward(tokens[:, :-1]).float()  # [B, S, V]; the loss in fp32 under every policy
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    result = Row(step=step, state_bytes=lambda: _state_bytes(row, model, optimizer))
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        dist.barrier()
        start = time.perf_counter()
        step()  # compiles forward and backward (compiled rows)
        result.first_step_s = time.perf_counter() - start
    return result


def _memory(rows: dict[str, Row], device: torch.device) -> dict[str, tuple[int, int]]:
    """Row -> (tensor peak, resident peak) of this rank (see [Note: peak memory])."""
    release_freed_memory(device)
    peaks = {}
    with count_cpu_allocations_on_every_thread():  # what one step leaves to the next is counted
        for name, row in rows.items():
            row.step()  # settle allocations under the new malloc settings
            dist.barrier()
            tensors = tensor_high_water_bytes(row.step, device)
            dist.barrier()
            resident = transient_peak(row.step, device)
            peaks[name] = (row.state_bytes() + tensors, row.state_bytes() + resident)
    return peaks


def _profile(args: argparse.Namespace, device: torch.device) -> str:
    """The profile file the auto rows plan with: `--profile`, or measured here now (all ranks) and
    written next to the results by rank 0."""
    if args.profile:
        return args.profile
    measured = measure(device=device, quick=args.tiny)
    path = str(Path(args.out) / "profile.json")
    if dist.get_rank() == 0:
        profile = profile_from(measured, name=f"scoreboard-{device.type}-{dist.get_world_size()}x")
        save_profile(profile, path, extra={"measured": dataclasses.asdict(measured)})
    dist.barrier()
    return path


_HOST = "(host probe)"  # the interleaved matmul of [Note: the host's speed, twice]


def _host_probe(profile: str, device: torch.device) -> tuple[dict, Callable[[], None]] | None:
    """[Note: the host's speed, twice]
    Predictions come from a profile measured before the rows are built, on a machine that may be
    shared: when the host runs slower while it calibrates than while the rows are timed (or faster),
    every prediction moves with it (two runs of the same code on 2026-12-04: 1 and 8 of 10 step
    predictions within 15%). So the calibration's own matmul (`Measurements.matmul_n`, its dtype) is
    timed again as one more entry of the interleaved timing, beside the rows' steps, and both times are
    reported: a ratio far from 1 says the host, not the model, moved the predictions. Nothing is
    corrected with it. None when the profile carries no measurements (a named or hand-written one)."""
    measured = json.loads(Path(profile).read_text()).get("measured") if Path(profile).is_file() else None
    if not measured:
        return None
    n, dtype = measured["matmul_n"], getattr(torch, measured["matmul_dtype"].removeprefix("torch."))
    a = torch.randn(n, n, device=device, dtype=dtype)

    def probe() -> None:
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()

    return {"matmul_n": n, "calibration_matmul_s": measured["matmul_s"]}, probe


_MATMULS = {"(fp32 matmuls)": torch.float32, "(bf16 matmuls)": torch.bfloat16}  # [Note: bf16 compute here]


def _matmul_probes(args: argparse.Namespace, device: torch.device) -> dict[str, Callable[[], None]]:
    """[Note: bf16 compute here]
    The bf16 rows run their matmuls in bf16, which pays only where the host multiplies bf16 natively;
    a CPU without bf16 units (or a kernel library that does not use them) converts and runs them
    slower than fp32. So the linear layers of one block and the output layer, at the model's shapes
    ([batch x seq, in] @ [in, out]), are timed in fp32 and in bf16 as two more entries of the
    interleaved timing, and the report gives both: it says the bf16 rows' compute ran slower than
    fp32's when it did. Only when a bf16 row runs."""
    m = args.batch * args.seq
    shapes = [(args.dim, args.dim)] * 4 + [(args.dim, args.ffn)] * 2 + [(args.ffn, args.dim), (args.dim, args.vocab)]

    def probe(dtype: torch.dtype) -> Callable[[], None]:
        pairs = [
            (torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
            for k, n in shapes
        ]

        def run() -> None:
            for a, b in pairs:
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    if all(config_of(row).precision == "fp32" for row in args.rows):
        return {}
    return {name: probe(dtype) for name, dtype in _MATMULS.items()}


def _slowest_median(times: list[float]) -> float:
    """The largest median over the ranks of a probe's times (calibration keeps its matmul time so)."""
    medians = [None] * dist.get_world_size()
    dist.all_gather_object(medians, statistics.median(times))
    return max(medians)


def _worker(rank: int, args: argparse.Namespace, results: dict) -> None:
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    profile = _profile(args, device)
    rows = {}
    for name in args.rows:
        rows[name] = _make_row(name, args, device, profile)
        rows[name].collectives = count_step_collectives(rows[name].step)
        if rank == 0:
            print(f"  built {config_of(name).label}: first step {rows[name].first_step_s:.1f}s", flush=True)
    host = _host_probe(profile, device)
    matmuls = _matmul_probes(args, device)
    steps = {n: r.step for n, r in rows.items()} | ({_HOST: host[1]} if host else {}) | matmuls
    times = interleaved_times(steps, warmup=args.warmup, timed=args.steps)
    if host:
        results["host"] = {**host[0], "rows_matmul_s": _slowest_median(times.pop(_HOST))}
    if matmuls:
        seconds = {name: _slowest_median(times.pop(name)) for name in matmuls}
        results["bf16_matmuls"] = {"fp32_s": seconds["(fp32 matmuls)"], "bf16_s": seconds["(bf16 matmuls)"]}
    peaks = _memory(rows, device)
    all_peaks = [None] * dist.get_world_size()
    dist.all_gather_object(all_peaks, peaks)
    all_gathered = [None] * dist.get_world_size()
    dist.all_gather_object(all_gathered, {name: row.collectives.gathered_bytes for name, row in rows.items()})
    if rank == 0:
        tokens = dist.get_world_size() * args.batch * args.seq
        results["profile"] = profile
        for name, row in rows.items():
            median = statistics.median(times[name])
            results[name] = {
                "step_time_s": median,
                "step_times_s": times[name],
                "tokens_per_s": tokens / median,
                "peak_memory_bytes": max(p[name][0] for p in all_peaks),
                "peak_memory_bytes_per_rank": [p[name][0] for p in all_peaks],
                "resident_peak_bytes": max(p[name][1] for p in all_peaks),
                "resident_peak_bytes_per_rank": [p[name][1] for p in all_peaks],
                "compile_s": max(0.0, row.first_step_s - median) if config_of(name).compiled else 0.0,
                "collectives_per_step": row.collectives.calls,
                "gathered_bytes_per_step": max(g[name] for g in all_gathered),
                "gathered_bytes_per_step_per_rank": [g[name] for g in all_gathered],
            }


def _predict(row: str, args: argparse.Namespace, world: int, profile: str) -> dict[str, float | None]:
    """simplefsdp's own prediction of the row's step time and peak memory per rank (None where it makes
    none: eager rows, other libraries, torch's passes)."""
    config = config_of(row)
    if config.family != "simplefsdp" or not config.compiled or config.passes == "torch":
        return {"predicted_step_s": None, "predicted_peak_bytes": None}
    shape = ModelShape(name=row, args=model_args(args), batch=args.batch, seq=args.seq)
    result = dry_run(
        shape,
        world_size=world,
        device=profile,
        strategy=config.strategy,
        mp_policy=simplefsdp_policy(config),
        passes=passes_of(config, profile),
        optimizer="adamw",
    )
    return {"predicted_step_s": result.step_s, "predicted_peak_bytes": result.peak_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model and 2 timed steps: {TINY}")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rows", default=None, help=f"comma-separated: {', '.join(CONFIGS)}, {FRONTIER}<fraction>")
    which.add_argument(
        "--set",
        default="all",
        help=f"comma-separated sets of rows: {', '.join(ROW_SETS)} (with the --frontier rows) or all (default)",
    )
    parser.add_argument(
        "--frontier",
        default="0.05,0.2,0.35,0.5",
        help="memory budgets (fractions) of the auto-plan rows added by default",
    )
    parser.add_argument(
        "--buffer-reuse",
        choices=("auto", "on", "off"),
        default="auto",
        help="inductor's allow_buffer_reuse for every compiled row; auto: what wrap() does on the device "
        "(off on the CPU, on on a GPU)",
    )
    parser.add_argument(
        "--reuse-twins", action="store_true", help="add each compiled row again, with buffer reuse the other way"
    )
    parser.add_argument("--profile", default=None, help="a `simplefsdp calibrate` file (default: measure first)")
    parser.add_argument("--no-predict", action="store_true", help="skip simplefsdp's predictions (dry runs)")
    parser.add_argument("--world", type=int, default=0, help="ranks; 0: 2 on the CPU, every GPU on CUDA")
    parser.add_argument("--out", default="bench/results", help="directory for scoreboard.json / .md / .png")
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    cuda = torch.cuda.is_available()
    args.buffer_reuse = cuda if args.buffer_reuse == "auto" else args.buffer_reuse == "on"
    try:
        args.rows = [r.strip() for r in args.rows.split(",")] if args.rows else rows_of_sets(args.set, args.frontier)
        for row in args.rows:
            config_of(row)
        if args.reuse_twins:
            other = "off" if args.buffer_reuse else "on"
            args.rows += [f"{row}{TWIN}{other}" for row in args.rows if config_of(row).compiled and TWIN not in row]
    except ValueError as error:
        parser.error(str(error))
    args.backend = "nccl" if cuda else "gloo"
    world = args.world or (torch.cuda.device_count() if cuda else 2)
    setup = report.describe_setup(args, world, precisions={config_of(row).precision for row in args.rows})
    header = record_header(
        "Scoreboard",
        host=f"{setup['machine']}, {world} {args.backend} ranks",
        files="`scoreboard.json` (every row, every timed step, per-rank peaks, predictions, targets), "
        "`scoreboard.png` (step time against peak memory), `profile.json` (the calibration the auto rows "
        "planned and the predictions were made with)",
        argv=argv,
    )
    print(setup["summary"], flush=True)
    load_at_start = os.getloadavg()[0]  # the host is shared: its load is part of the record
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # see simplefsdp/train/launch.py's note
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = spawn(_worker, args, world=world, backend=args.backend)
    profile = results.pop("profile")
    host = results.pop("host", None)
    matmuls = results.pop("bf16_matmuls", None)
    rows, predictions = {}, {}
    for name in args.rows:
        # a buffer-reuse twin's prediction is its row's: the dry run does not depend on that setting
        base = name.split(TWIN)[0]
        if not args.no_predict and base not in predictions:
            predictions[base] = _predict(base, args, world, profile)
        predicted = predictions.get(base, {})
        rows[name] = {
            "label": config_of(name).label,
            "strategy": config_of(name).strategy,
            "precision": config_of(name).precision,
            "gather_dtype": config_of(name).gather,
            **results[name],
            **predicted,
        }
    setup["profile"] = profile
    setup["host_probe"] = host
    setup["bf16_matmuls"] = matmuls and {**matmuls, **report.bf16_units()}
    setup["load_average_1min"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    document = {"setup": setup, "rows": rows, "targets": report.targets(rows)}
    (out / "scoreboard.json").write_text(json.dumps(document, indent=2) + "\n")
    table = report.markdown(document)
    (out / "scoreboard.md").write_text(header + table)
    report.plot(rows, out / "scoreboard.png", title=setup["summary"], frontier_prefix=FRONTIER)
    print(table)
    print(f"wrote {out / 'scoreboard.json'}, {out / 'scoreboard.md'}, {out / 'scoreboard.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
