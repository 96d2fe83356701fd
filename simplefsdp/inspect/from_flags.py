"""What parsed `simplefsdp inspect` flags ask for: the dry run (`run`), its `--offload auto` plan,
the verdict, and `--advise`. `cli.py` parses the flags without torch and imports this after.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console

import simplefsdp
from simplefsdp.blocks import find_repeated_blocks
from simplefsdp.inspect.dryrun import DryRunResult, dry_run
from simplefsdp.inspect.offload_cost import copy_fraction, reshards, with_plan
from simplefsdp.inspect.shapes import ModelShape, model_shape
from simplefsdp.inspect.verdict import MemoryVerdict, memory_verdict
from simplefsdp.offload_plan import OffloadPlan, offload_units, plan_offload
from simplefsdp.settings import torch_dtype
from simplefsdp.strategy import ShardingStrategy

__all__ = ["advise_command", "model_of", "mp_policy", "run", "verdict_of"]


def _factory(spec: str) -> Callable[[], tuple[torch.nn.Module, Any]]:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load model factory {spec!r}: {error}") from error
    if not callable(factory):
        raise ValueError(f"model factory {spec!r} is a {type(factory).__name__}, not a function")
    return factory


def model_of(args: argparse.Namespace) -> str | ModelShape | Callable[[], tuple[torch.nn.Module, Any]]:
    if ":" in args.model:
        return _factory(args.model)
    shape = model_shape(args.model)
    if not args.code:
        return shape

    def on_cpu() -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        return shape.build(device="cpu"), shape.example_input(batch=args.batch, seq=args.seq, device="cpu")

    on_cpu.__name__ = shape.name
    return on_cpu


def run(args: argparse.Namespace) -> DryRunResult:
    """Dry-run per the parsed arguments; returns the result (the CLI prints it)."""
    if len(args.tp) != 1:
        raise ValueError(f"--tp takes one degree without --advise, got {','.join(map(str, args.tp))}")
    plan = args.plan or "blocks"
    if plan == "none":
        passes = None
    else:
        reorder = simplefsdp.ReorderConfig()
        if args.max_in_flight_gib is not None:
            reorder = simplefsdp.ReorderConfig(max_in_flight_bytes=int(args.max_in_flight_gib * 2**30))
        bucket = simplefsdp.BucketConfig(plan=plan, device=args.device, memory_budget=args.memory_budget)
        passes = simplefsdp.PassConfig(bucket=bucket, reorder=reorder)
    result = dry_run(
        model_of(args),
        world_size=args.world,
        device=args.device,
        strategy=args.strategy or "FULL_SHARD",
        shard_size=args.shard_size,
        mp_policy=mp_policy(args),
        passes=passes,
        batch=args.batch,
        seq=args.seq,
        optimizer=args.optimizer,
        max_traced_blocks=args.max_traced_blocks,
        code=args.code,
        tp=args.tp[0],
        ac=args.ac or "none",
        offload="none" if args.offload in (None, "auto") else args.offload,
    )
    if args.offload != "auto":
        return result
    return _planned(result, args)


def _planned(result: DryRunResult, args: argparse.Namespace) -> DryRunResult:
    """`--offload auto`: the per-block plan that keeps the step under the limit ([Note: planning
    offload under a limit] in `offload_plan.py`), priced; everything at "all" when none does (the
    verdict then says it does not fit)."""
    model = model_of(args)
    module = model.build() if isinstance(model, ModelShape) else model()[0]
    units = offload_units(module, blocks=find_repeated_blocks(module), world_size=args.world, mp_policy=mp_policy(args))
    capacity = args.device_memory_gib * 2**30 if args.device_memory_gib else result.device.capacity_bytes
    if args.device_memory_limit_gib is not None:
        limit = args.device_memory_limit_gib * 2**30
    elif capacity is not None:
        limit = (1.0 - args.margin) * capacity
    else:
        raise ValueError("--offload auto needs a device memory: --device-memory-limit-gib or --device-memory-gib")
    persistent = result.persistent
    transient = result.peak_bytes - persistent.params_bytes - persistent.optimizer_bytes
    plan = plan_offload(units, transient_bytes=transient, limit_bytes=limit)
    if plan is None:
        plan = OffloadPlan(tiers=tuple((unit.name, "all") for unit in units))
    strategy = ShardingStrategy.parse(args.strategy or "FULL_SHARD")
    return with_plan(
        result,
        plan,
        units=units,
        copy_fraction=copy_fraction(mp_policy(args)),
        reshards=reshards(strategy, args.ac or "none"),
    )


def verdict_of(result: DryRunResult, args: argparse.Namespace) -> MemoryVerdict:
    """The fits verdict per the parsed `--device-memory-gib`, `--host-memory-gib` and `--margin`."""
    capacity = None if args.device_memory_gib is None else args.device_memory_gib * 2**30
    host = None if args.host_memory_gib is None else args.host_memory_gib * 2**30
    return memory_verdict(result, margin=args.margin, capacity_bytes=capacity, host_capacity_bytes=host)


def mp_policy(args: argparse.Namespace) -> simplefsdp.MixedPrecisionPolicy:
    return simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch_dtype(args.param_dtype),
        reduce_dtype=torch_dtype(args.reduce_dtype),
        gather_dtype=None if args.gather_dtype == "none" else args.gather_dtype,
        gather_block=args.gather_block,
    )


def advise_command(args: argparse.Namespace, out: Console) -> int:
    from simplefsdp.inspect.advice_view import run_advise, show_advice

    if args.code:
        raise ValueError("--advise traces on the meta device; --code is for a single dry run")
    fixed = {"--plan": args.plan, "--memory-budget": args.memory_budget, "--max-in-flight-gib": args.max_in_flight_gib}
    if args.offload == "auto":
        raise ValueError("--advise searches the offload tiers itself; --offload auto plans one dry run")
    if args.advise_toml and ":" in args.model:
        raise ValueError("--advise-toml writes a `simplefsdp train` run of a named shape; a factory's model has none")
    given = [flag for flag, value in fixed.items() if value is not None]
    if given:
        raise ValueError(f"--advise searches the bucket plans and prefetch depths itself; drop {', '.join(given)}")
    model = model_of(args)
    advice = run_advise(args, model=model, mp_policy=mp_policy(args))
    show_advice(advice, args, out, shape=model if isinstance(model, ModelShape) else None)
    return 0
