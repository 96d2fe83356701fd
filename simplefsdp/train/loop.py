"""The training loop of `simplefsdp train`, run on every rank of an initialised process group.

    outcome = train(config, device=torch.device("cpu"))

Builds the mesh `([replicate, shard] | dp) x [tp]`, the model (TP-parallelized when `tp > 1`,
blocks checkpointed on request), wraps it with `simplefsdp.wrap`, compiles it, then runs AdamW
steps on `TokenBatches`, saving a sharded checkpoint every `checkpoint_every` steps and at the
end. Each step's learning rate is `schedule.lr_at` of the step; the global gradient norm is measured
every step, and clipped with `--grad-clip` (`grad_norm.py`). With `--eval-every` the held-out loss is
measured every N steps and at the end, and with `--sample-tokens` a greedy sample closes the run
(`evaluate.py`). Rank 0 prints a summary line, shows the progress bar and keeps the run folder (`output.py`).

With float16 gathers or reductions (`--param-dtype fp16`, `--reduce-dtype fp16`) the loss is
scaled (`simplefsdp.grad_scaler`, [Note: float16 needs loss scaling] in `loss_scaling.py`): scale,
backward, unscale, the norm and clipping of the true gradients, then the scaler's step (the
optimizer step unless a gradient holds an inf or nan on any rank, then the same skip on every rank)
and update. Rank 0 says so once; each step's metrics record carries the scale it used and whether it
was skipped.

Invariants: every rank runs the same number of steps and the same collectives; a resumed run
restores the model, the optimizer, the loss scaler, the RNG states and the batch position, so its
step count and loss curve continue those of the run it resumes (bitwise in fp32 on the same world
size, as `simplefsdp.checkpoint` guarantees for the state it restores).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import parallelize_module

import simplefsdp
from simplefsdp import checkpoint
from simplefsdp.accelerate_config import blocks_of_classes
from simplefsdp.compile_cache import StageCounts
from simplefsdp.inspect.record import recording
from simplefsdp.loss_scaling import CHECKPOINT_KEY
from simplefsdp.models import Transformer, TransformerArgs, tensor_parallel_plan
from simplefsdp.passes import cost
from simplefsdp.passes.install import pass_of
from simplefsdp.settings import parse_memory_budget, torch_dtype
from simplefsdp.train import comm, hf_model
from simplefsdp.train.config import ConfigError, TrainConfig, shape_of
from simplefsdp.train.data import CORPUS, VOCAB, TokenBatches, encode, repeated_corpus, split
from simplefsdp.train.evaluate import HeldOut, lm_loss
from simplefsdp.train.grad_norm import clip_grad_norm, grad_norm
from simplefsdp.train.job_cache import JobCache, job_cache
from simplefsdp.train.output import RunOutput, summary_line
from simplefsdp.train.quiet import drop_benign_torch_warnings
from simplefsdp.train.schedule import lr_at

__all__ = ["TrainOutcome", "build_model", "check_model", "token_batches", "train"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOutcome:
    """What a run did (the same on every rank except `losses`, which only rank 0 keeps)."""

    start_step: int
    end_step: int
    losses: tuple[float, ...]
    tokens_per_s: float | None  # median over the steps after the first of this run
    comm: comm.CommSummary
    skipped_steps: int = 0  # steps the float16 loss scaler skipped (an inf or nan in a gradient)
    eval_loss: float | None = None  # the held-out loss at the end (--eval-every); None: not measured
    sample: str = ""  # the text sampled at the end (--sample-tokens); empty: none
    compile_cache: dict[str, Any] | None = None  # the entry and the first step's hits (JobCache.record)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """The model a run trains, and where this rank sits in data parallelism."""

    model: nn.Module  # the wrapped root
    step_fn: nn.Module  # what the loop calls: compiled, or the model itself in eager mode
    dp_rank: int
    dp_size: int
    corpus: torch.Tensor | None  # the corpus in the model's tokens; None: the built-in model's characters


def mesh_dims(config: TrainConfig, world_size: int) -> list[tuple[str, int]]:
    """(name, size) of each dimension of the run's device mesh: `([replicate, shard] | dp) x [tp]`."""
    dp = world_size // config.tp
    if config.sharding.is_hybrid:
        shard = config.shard_size or dp // 2
        dims = [("replicate", dp // shard), ("shard", shard)]
    else:
        dims = [("dp", dp)]
    if config.tp > 1:
        dims.append(("tp", config.tp))
    return dims


def _meshes(config: TrainConfig, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None, int, int]:
    """(data-parallel mesh, tp mesh or None, dp rank, dp size) over the whole world."""
    dims = mesh_dims(config, dist.get_world_size())
    dp = math.prod(size for name, size in dims if name != "tp")
    names = tuple(name for name, _ in dims)
    world = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=names)
    dp_names = tuple(name for name in names if name != "tp")
    dp_mesh = world if dp_names == names else world[dp_names if len(dp_names) > 1 else dp_names[0]]
    coordinate = dict(zip(names, world.get_coordinate(), strict=True))
    dp_rank = 0
    for name, size in dims:  # row-major over the dp dims; the tp ranks of one dp rank share its data
        if name != "tp":
            dp_rank = dp_rank * size + coordinate[name]
    return dp_mesh, world["tp"] if config.tp > 1 else None, dp_rank, dp


def _passes(config: TrainConfig, profile: str, blocks: tuple[str, ...]) -> simplefsdp.PassConfig | None:
    if config.bucket_plan == "none":
        return None
    cap = int(config.bucket_cap_mib * 2**20)
    budget = parse_memory_budget(config.memory_budget) if config.memory_budget else None
    bucket = simplefsdp.BucketConfig(
        plan=config.bucket_plan, cap_bytes=cap, device=profile, memory_budget=budget, blocks=blocks
    )
    return simplefsdp.PassConfig(
        bucket=bucket,
        reorder=simplefsdp.ReorderConfig(prefetch_depth=config.prefetch_depth),
    )


def profile_name(config: TrainConfig, device: torch.device) -> str:
    if config.profile != "auto":
        return config.profile
    return "h100" if device.type == "cuda" else "cpu-gloo"


def unwrapped_model(config: TrainConfig) -> tuple[nn.Module, torch.Tensor | None]:
    """The model to train, with fresh weights on the current default device, and the corpus in its
    tokens (None: the built-in model's characters)."""
    if config.model:
        model = hf_model.build(config.model)
        return model, hf_model.corpus_ids(config.model, model)
    if config.shape:
        return shape_of(config).build(device=torch.get_default_device()), repeated_corpus(seq_len=config.seq_len)
    args = TransformerArgs(
        vocab_size=len(VOCAB),
        dim=config.dim,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        ffn_dim=config.ffn_dim,
        max_seq_len=config.seq_len,
    )
    return Transformer(args), None


def layer_blocks(config: TrainConfig, model: nn.Module) -> tuple[str, ...]:
    """The modules of `config.layer_classes` (empty: none named, the model's repeated blocks)."""
    names = [name.strip() for name in config.layer_classes.split(",") if name.strip()]
    try:
        return blocks_of_classes(model, names) if names else ()
    except ValueError as err:
        raise ConfigError(f"layer_classes: {err}") from None


def check_model(config: TrainConfig) -> None:
    """The model's checks, on the meta device (no memory, no ranks): it builds, its tokens cover the
    corpus at `seq_len`, its layer classes exist, the `--init-from` checkpoint fits it. ConfigError."""
    with torch.device("meta"):
        model, corpus = unwrapped_model(config)
    layer_blocks(config, model)
    try:
        split(corpus if corpus is not None else encode(CORPUS), seq_len=config.seq_len)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if config.init_from:
        hf_model.check_weights(model, config.init_from)


def mp_policy(config: TrainConfig) -> simplefsdp.MixedPrecisionPolicy:
    reduce = None if config.reduce_dtype == "auto" else torch_dtype(config.reduce_dtype)
    return simplefsdp.MixedPrecisionPolicy(
        param_dtype=torch_dtype(config.param_dtype),
        reduce_dtype=reduce,
        gather_dtype=None if config.gather_dtype == "none" else config.gather_dtype,
        gather_block=config.gather_block,
    )


def build_model(
    config: TrainConfig, device: torch.device, *, offload_plan: simplefsdp.OffloadPlan | None = None
) -> TrainSetup:
    """The wrapped (and compiled) model, the same on every rank for a given seed; `offload_plan`:
    what `--offload auto` planned (`offload_auto.py`)."""
    dp_mesh, tp_mesh, dp_rank, dp_size = _meshes(config, device.type)
    torch.manual_seed(config.seed)
    # [Note: --init-from builds no full parameter] in hf_model.py; a shape is built on meta and
    # materialized after wrap(): each rank allocates its shards, one full parameter at a time
    lazy = hf_model.parameters_on_meta() if config.init_from else contextlib.nullcontext()
    with device, lazy, torch.device("meta") if config.shape else contextlib.nullcontext():
        model, corpus = unwrapped_model(config)
    if config.init_from:
        hf_model.retie(model)
    blocks = layer_blocks(config, model)
    if tp_mesh is not None:
        parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    if config.activation_checkpoint != "none":
        simplefsdp.checkpoint_blocks(model, blocks=blocks or None, policy=config.activation_checkpoint)
        if not config.verbose:
            drop_benign_torch_warnings()
    if config.offload == "auto":
        if offload_plan is None:
            raise ConfigError("offload auto: the plan is made before the ranks start (not under torchrun)")
        logger.info("offload auto: %s", offload_plan.summary())
    simplefsdp.wrap(
        model,
        dp_mesh,
        strategy=config.sharding,
        mp_policy=mp_policy(config),
        passes=_passes(config, profile_name(config, device), blocks),
        offload=offload_plan if config.offload == "auto" else simplefsdp.OffloadPolicy.of_tier(config.offload),
    )
    if config.init_from:
        hf_model.allocate_shards(model, device)
        hf_model.load_weights(model, config.init_from)
    elif config.shape:
        simplefsdp.materialize(model, device=device)
    if config.backend == "eager":
        step_fn = model
    else:
        step_fn = torch.compile(model, backend="simplefsdp_aot_eager" if config.backend == "aot_eager" else "inductor")
    return TrainSetup(model=model, step_fn=step_fn, dp_rank=dp_rank, dp_size=dp_size, corpus=corpus)


def token_batches(config: TrainConfig, setup: TrainSetup) -> TokenBatches:
    """This rank's training batches, from the first; ConfigError where the corpus cannot fill them."""
    try:
        return TokenBatches(
            seq_len=config.seq_len,
            batch_per_rank=config.batch_per_rank,
            dp_rank=setup.dp_rank,
            dp_size=setup.dp_size,
            seed=config.seed,
            ids=setup.corpus,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_fresh_start(config: TrainConfig) -> None:
    """Without --resume, refuse a checkpoint directory that already holds checkpoints (they would mix runs)."""
    if config.resume:
        return
    newest = checkpoint.latest_checkpoint(config.checkpoint_dir)
    if newest is not None:
        raise ConfigError(
            f"checkpoint_dir {config.checkpoint_dir} already holds checkpoints (newest: {newest.name}); "
            "pass --resume to continue that run, or choose another --checkpoint-dir"
        )


@dataclasses.dataclass(frozen=True)
class _Optimization:
    """The optimizer and, under float16, its loss scaler (whose state travels with the checkpoint)."""

    opt: torch.optim.Optimizer
    scaler: ShardedGradScaler | None
    config: TrainConfig
    device: torch.device  # where the gradient norm is reduced

    def step(self, index: int) -> tuple[bool, dict[str, float]]:
        """Optimizer step `index` (0-based) at its scheduled learning rate, after measuring (and with
        --grad-clip clipping) the global gradient norm of the unscaled gradients; through the scaler
        under float16 (step unless skipped on every rank, then update). Returns whether the
        parameters were stepped, and the step's learning rate and gradient norm for the metrics."""
        c = self.config
        lr = lr_at(index, lr=c.lr, schedule=c.lr_schedule, warmup_steps=c.warmup_steps, steps=c.steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)  # the scaler's step then uses these gradients as they are
        params = [p for group in self.opt.param_groups for p in group["params"]]
        if c.grad_clip:
            norm = clip_grad_norm(params, max_norm=c.grad_clip, device=self.device)
        else:
            norm = grad_norm(params, device=self.device)
        record = {"lr": lr, "grad_norm": norm.item()}
        if self.scaler is None:
            self.opt.step()
            return True, record
        scale = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale() >= scale, record  # update() lowers the scale exactly when it skipped

    def state(self) -> dict[str, Any]:
        return {} if self.scaler is None else {CHECKPOINT_KEY: self.scaler.state_dict()}

    def load_state(self, extra: dict[str, Any]) -> None:
        if self.scaler is None:
            return
        if CHECKPOINT_KEY in extra:
            self.scaler.load_state_dict(extra[CHECKPOINT_KEY])
        else:
            logger.warning("--resume: the checkpoint holds no loss-scaler state; float16 scaling starts afresh")


def _resume(config: TrainConfig, setup: TrainSetup, optim: _Optimization, batches: TokenBatches) -> int:
    """The step to start from: the newest checkpoint's (restored in place), or 0."""
    if not config.resume:
        return 0
    loaded = checkpoint.load_checkpoint(config.checkpoint_dir, model=setup.model, optimizer=optim.opt, missing_ok=True)
    if loaded is None:
        logger.warning("--resume: no checkpoint under %s, starting from step 0", config.checkpoint_dir)
        return 0
    batches.load_state_dict(loaded.extra["data"])
    optim.load_state(loaded.extra)
    logger.info("resumed from %s (step %d)", loaded.path, loaded.step)
    return loaded.step


def _save(config: TrainConfig, setup: TrainSetup, optim: _Optimization, batches: TokenBatches, step: int) -> None:
    extra = {"data": batches.state_dict(), **optim.state()}
    checkpoint.save_checkpoint(
        config.checkpoint_dir,
        step=step,
        model=setup.model,
        optimizer=optim.opt,
        extra=extra,
        keep_last=config.keep_last,
    )


def train(
    config: TrainConfig, *, device: torch.device, offload_plan: simplefsdp.OffloadPlan | None = None
) -> TrainOutcome:
    """Run the steps from the resumed (or first) step to `config.steps`; see the module docstring.
    The compiles cache into the job's entry (`job_cache.py`)."""
    check_fresh_start(config)
    with job_cache(config, device=device, mesh=mesh_dims(config, dist.get_world_size())) as cache:
        return _train(config, device=device, offload_plan=offload_plan, cache=cache)


def _train(
    config: TrainConfig, *, device: torch.device, offload_plan: simplefsdp.OffloadPlan | None, cache: JobCache | None
) -> TrainOutcome:
    setup = build_model(config, device, offload_plan=offload_plan)
    optim = _Optimization(
        torch.optim.AdamW(setup.model.parameters(), lr=config.lr), simplefsdp.grad_scaler(setup.model), config, device
    )
    batches = token_batches(config, setup)
    held = HeldOut.of(config, setup.corpus, dp_rank=setup.dp_rank, dp_size=setup.dp_size)
    start = _resume(config, setup, optim, batches)
    out = RunOutput(
        config, start=start, enabled=dist.get_rank() == 0, compiling="compile" if cache is None else cache.label
    )
    parameters = sum(p.numel() for p in setup.model.parameters())  # DTensors: their global sizes
    mesh = mesh_dims(config, dist.get_world_size())
    out.say(summary_line(config, parameters=parameters, mesh=mesh, tokens_per_step=_tokens(config, setup), start=start))
    if optim.scaler is not None:
        out.say(f"float16: the loss is scaled (initial scale {optim.scaler.get_scale():g}); skipped steps are counted")
    try:
        outcome = _steps(config, setup, optim, batches, out, held, start=start, device=device, cache=cache)
        out.steps_done()  # the bar ends with the steps: the sample prints below it
        if config.sample_tokens and outcome.end_step > start:
            # [Note: one no-grad graph] in evaluate.py: compiled only where evaluation compiled it
            step_fn = setup.step_fn if config.eval_every else setup.model
            text = held.sample(step_fn, setup.model, tokens=config.sample_tokens, device=device)
            out.say(f"sample ({config.sample_tokens} tokens, greedy, after the held-out prompt):\n{text}")
            outcome = dataclasses.replace(outcome, sample=text)
        parameters = sum(p.numel() for p in setup.model.parameters())  # global counts: DTensors report them
        out.finish({**_summary_record(outcome), "parameters": parameters})
    finally:
        out.close()
    if config.export_dir:
        checkpoint.export_full_state_dict(setup.model, config.export_dir)
        if dist.get_rank() == 0 and config.model:
            hf_model.save_config(setup.model, config.model, config.export_dir)
    return outcome


def _steps(
    config: TrainConfig,
    setup: TrainSetup,
    optim: _Optimization,
    batches: TokenBatches,
    out: RunOutput,
    held: HeldOut,
    *,
    start: int,
    device: torch.device,
    cache: JobCache | None,
) -> TrainOutcome:
    tokens_per_step = _tokens(config, setup)
    losses, rates, summary, skipped, eval_loss = [], [], comm.CommSummary(traced=False), 0, None
    for step in range(start, config.steps):
        tokens = next(batches).to(device)  # [B, S + 1]
        first = step == start
        began = time.perf_counter()
        scale = {} if optim.scaler is None else {"loss_scale": optim.scaler.get_scale()}
        if first and config.backend != "eager":
            counted = StageCounts.now()
            with recording(pass_of(setup.model), caches=cache is not None) as graphs:  # the compiling call
                loss = _forward_backward(setup.step_fn, tokens, optim.scaler)
            summary = comm.summarize(setup.model, graphs, profile=cost.profile(profile_name(config, device)))
            if cache is not None:  # graphs the caches served were not traced: the entry keeps their summary
                summary, hits = cache.compiled(summary, StageCounts.now().since(counted))
                out.say(hits)
        else:
            loss = _forward_backward(setup.step_fn, tokens, optim.scaler)
        stepped, optimized = optim.step(step)
        optim.opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # the tp ranks of one dp rank hold the same loss: the mean is the dp mean
        value = loss.item() / dist.get_world_size()
        seconds = time.perf_counter() - began
        losses.append(value)
        if not first:
            rates.append(tokens_per_step / seconds)
        if not stepped:
            skipped += 1
            logger.info(
                "step %d skipped: an inf or nan in the gradients at loss scale %g", step + 1, scale["loss_scale"]
            )
        record = {"step": step + 1, "loss": value, "seconds": seconds, "tokens_per_s": tokens_per_step / seconds}
        record.update(_peak_memory(device))
        record.update(optimized)
        if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            eval_loss = record["eval_loss"] = held.loss(setup.step_fn, setup.model, device=device)  # not timed
        out.step({**record, **scale, **({"skipped": not stepped} if scale else {})}, compiling=first)
        if first:
            out.say(summary.line())
        if (config.checkpoint_every and (step + 1) % config.checkpoint_every == 0) or step + 1 == config.steps:
            _save(config, setup, optim, batches, step + 1)
    return TrainOutcome(
        start_step=start,
        end_step=config.steps,
        losses=tuple(losses),
        tokens_per_s=statistics.median(rates) if rates else None,
        comm=summary,
        skipped_steps=skipped,
        eval_loss=eval_loss,
        compile_cache=None if cache is None else cache.record,
    )


def _tokens(config: TrainConfig, setup: TrainSetup) -> int:
    """Tokens per step over all data-parallel ranks."""
    return config.batch_per_rank * config.seq_len * setup.dp_size


def _peak_memory(device: torch.device) -> dict[str, int]:
    """This rank's memory high-water mark so far: on CUDA the bytes the caching allocator handed out
    (`peak_memory_bytes`); elsewhere the process's peak resident set (`peak_rss_bytes`: everything
    the process touched, the Python runtime and torch's libraries included)."""
    if device.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device)}
    try:
        import resource
    except ImportError:  # not a POSIX system: no honest number to give
        return {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024}  # bytes on macOS, KiB on Linux


def _forward_backward(step_fn: nn.Module, tokens: torch.Tensor, scaler: ShardedGradScaler | None) -> torch.Tensor:
    loss = lm_loss(step_fn, tokens)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss.detach()


def _summary_record(outcome: TrainOutcome) -> dict[str, Any]:
    return {
        "start_step": outcome.start_step,
        "end_step": outcome.end_step,
        "tokens_per_s": outcome.tokens_per_s,
        "eval_loss": outcome.eval_loss,
        "sample": outcome.sample,
        "compile_cache": outcome.compile_cache,
        **dataclasses.asdict(outcome.comm),
    }
