"""Training runs the parity tests compare: a single-process reference, simplefsdp, FSDP2 and DDP.

Every run trains the same small transformer (uneven vocabulary) from the same seed on the same
token batches for `STEPS` optimizer steps (AdamW unless told) and returns `(losses, full
parameters)`. The distributed runs split each global batch evenly over the data-parallel ranks, so
the mean of the ranks' mean losses is the reference's full-batch mean loss. The mixed-precision
reference (`train_policy_reference`) computes in one process what a policy makes the ranks do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import simplefsdp
from simplefsdp._compat import functorch_config, inductor_config
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.install import pass_of

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
STEPS = 5
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-2


@dataclasses.dataclass(frozen=True)
class Result:
    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_dtypes: frozenset[torch.dtype] = frozenset()
    collectives_merged: int = 0  # by simplefsdp's pass, over every graph compiled
    collectives_moved: int = 0
    state_dtypes: frozenset[torch.dtype] = frozenset()  # of the optimizer's per-element state (not `step`)
    compile_cache: dict[str, int] = dataclasses.field(default_factory=dict)  # `CACHE_EVENTS` of the run


# torch's counters of the on-disk compile caches: AOTAutograd's (keyed with the DTensor inputs'
# `_stable_hash_for_caching`) and inductor's FX graph cache
CACHE_EVENTS = (
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
)


@contextlib.contextmanager
def _counting_cache_events(into: dict[str, int], cache_dir: str | None) -> Iterator[None]:
    """Fills `into` with how often each of `CACHE_EVENTS` happened in the block; with `cache_dir`, the
    caches live there for the block."""
    before = {name: counters[group][name] for group, name in CACHE_EVENTS}
    with temporary_cache_dir(cache_dir) if cache_dir else contextlib.nullcontext():
        yield
    into.update({name: counters[group][name] - before[name] for group, name in CACHE_EVENTS})


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def fresh_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        fqn: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for fqn, p in model.named_parameters()
    }


OPTIMIZERS = {
    "adamw-foreach": (torch.optim.AdamW, {"lr": LR, "foreach": True}),
    "adamw-for-loop": (torch.optim.AdamW, {"lr": LR, "foreach": False}),
    "adamw-fused": (torch.optim.AdamW, {"lr": LR, "fused": True}),
    "adam-foreach": (torch.optim.Adam, {"lr": LR, "foreach": True}),
    "adam-fused": (torch.optim.Adam, {"lr": LR, "fused": True}),
    "sgd-momentum-foreach": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "foreach": True}),
    "sgd-for-loop": (torch.optim.SGD, {"lr": 0.5, "foreach": False}),
}


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(model.parameters(), **kwargs)


def train_reference(optimizer: str = "adamw-foreach") -> Result:
    """One process, whole batch, fp32."""
    model = fresh_model()
    opt = _optimizer(model, optimizer)
    losses = []
    for tokens in batches():
        loss = loss_fn(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return Result(losses, full_params(model))


def train_policy_reference(
    optimizer: str,
    *,
    world: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    step: bool = True,
    reduce: bool = True,
) -> Result:
    """One process, training as a mixed-precision policy says `world` data-parallel ranks do: each
    rank's share of the batch runs with the fp32 master parameters cast to `param_dtype` (buffers
    untouched, as the gather leaves them), its gradients are cast to `reduce_dtype` and averaged over
    the ranks in `reduce_dtype`, the average is cast to fp32 and the optimizer steps the fp32
    masters. Negative controls: `step=False` leaves the optimizer step out, `reduce=False` steps
    with rank 0's own gradient (what training without the reduction would do on rank 0)."""
    model = fresh_model()
    opt = _optimizer(model, optimizer)
    losses = []
    for tokens in batches():
        per_rank, total = [], 0.0
        for rows in tokens.chunk(world):
            compute = {fqn: p.detach().to(param_dtype).requires_grad_() for fqn, p in model.named_parameters()}
            loss = loss_fn(lambda x, compute=compute: torch.func.functional_call(model, compute, (x,)), rows)
            loss.backward()
            per_rank.append({fqn: t.grad.to(reduce_dtype) for fqn, t in compute.items()})
            total += loss.item()
        for fqn, p in model.named_parameters():
            reduced = sum(grads[fqn] for grads in per_rank) / world if reduce else per_rank[0][fqn]
            p.grad = reduced.to(p.dtype)
        if step:
            opt.step()
        opt.zero_grad()
        losses.append(total / world)
    return Result(losses, full_params(model))


def _train_distributed(
    model: torch.nn.Module, step_fn: torch.nn.Module, optimizer: str = "adamw-foreach", reduce_op: str = "avg"
) -> Result:
    """Train on this rank's share of each global batch; `reduce_op="sum"` scales the loss by 1/world
    so the summed gradients equal the averaged ones (what a user switching to sum would do)."""
    dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
    opt = _optimizer(model, optimizer)
    losses = []
    grad_dtypes = set()
    for tokens in batches():
        local = tokens.chunk(dp_size)[dp_rank]
        loss = loss_fn(step_fn, local)
        (loss / dp_size if reduce_op == "sum" else loss).backward()
        grad_dtypes.update(p.grad.dtype for p in model.parameters())
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dp_size)
    state_dtypes = frozenset(
        value.dtype
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim > 0
    )
    return Result(losses, full_params(model), frozenset(grad_dtypes), state_dtypes=state_dtypes)


def _mesh(strategy: simplefsdp.ShardingStrategy) -> DeviceMesh:
    world = dist.get_world_size()
    if strategy.is_hybrid:
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def train_simplefsdp(
    strategy: str,
    backend: str,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    optimizer: str = "adamw-foreach",
    reduce_op: str = "avg",
    passes: simplefsdp.PassConfig | None = simplefsdp.PassConfig(),
    compile_caches: bool = True,
    cache_dir: str | None = None,
    offload: simplefsdp.OffloadPolicy | simplefsdp.OffloadPlan | None = None,
) -> Result:
    """simplefsdp on every rank of the default group; `backend` is "eager" or a torch.compile backend.

    `passes` goes to `wrap()`: the default buckets per block and reorders; None turns the pass off.
    `compile_caches=False` compiles from scratch, so the pass really runs (and counts what it did);
    `cache_dir`: the on-disk compile caches' directory for this run (default: the session's).
    """
    parsed = simplefsdp.ShardingStrategy.parse(strategy)
    model = fresh_model()
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    simplefsdp.wrap(
        model, _mesh(parsed), strategy=parsed, mp_policy=policy, reduce_op=reduce_op, passes=passes, offload=offload
    )
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    caches = {} if compile_caches else {"fx_graph_cache": False}
    events: dict[str, int] = {}
    with (
        inductor_config.patch(caches),
        functorch_config.patch(enable_autograd_cache=compile_caches),
        _counting_cache_events(events, cache_dir),
    ):
        result = _train_distributed(model, step_fn, optimizer, reduce_op)
    result = dataclasses.replace(result, compile_cache=events)
    graph_pass = pass_of(model)
    if graph_pass is None:
        return result
    return dataclasses.replace(result, collectives_merged=graph_pass.merged, collectives_moved=graph_pass.moved)


def train_loaded(held_dtype: torch.dtype, *, policy: bool = True) -> Result:
    """FULL_SHARD, eager, a model whose parameters hold bf16 values (what a bf16 checkpoint gives),
    held in `held_dtype` (bf16: loaded as `from_pretrained(dtype=torch.bfloat16)` loads it; fp32:
    loaded in fp32); buffers as built. Trained under the bf16 / fp32-reduce policy (`policy`) or none."""
    model = fresh_model()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16).to(held_dtype)
    mp_policy = (
        simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else None
    )
    simplefsdp.wrap(model, mp_policy=mp_policy)
    return _train_distributed(model, model)


def train_fsdp2(
    strategy: str, *, param_dtype=None, reduce_dtype=None, optimizer: str = "adamw-foreach", offload: bool = False
) -> Result:
    """FSDP2 `fully_shard` per block and at the root (its recommended use), eager; DDP for NO_SHARD;
    `offload`: with `CPUOffloadPolicy(pin_memory=False)` (what runs on a CPU mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    parsed = simplefsdp.ShardingStrategy.parse(strategy)
    model = fresh_model()
    if parsed is simplefsdp.ShardingStrategy.NO_SHARD:
        ddp = DistributedDataParallel(model)
        return _train_distributed(model, ddp, optimizer)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # FSDP2 casts the floating-point inputs of every fully_shard module, simplefsdp those of the
    # wrapped root only: the blocks' inputs (the hidden state, already in param_dtype, and the fp32
    # rope tables) are left as they come, as simplefsdp leaves them
    block_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    mesh = _mesh(parsed)
    where = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    reshard = parsed.reshard_after_forward
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=block_policy, offload_policy=where)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=where)
    return _train_distributed(model, model, optimizer)


def tiny_bias_grads(backend: str) -> tuple[dict[str, torch.Tensor], int]:
    """FULL_SHARD on the whole world, a Linear(5, 3) and a Linear(3, 2) whose biases (3, 2) and
    rows are fewer than the ranks on a world of 4 (some shards empty) and uneven on 2: one step's
    full gradients, to compare with a single process on the whole batch, and how many collectives
    the pass merged away (0 without one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    simplefsdp.wrap(model)
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    x = torch.randn(4 * dist.get_world_size(), 5, generator=torch.Generator().manual_seed(1))
    step_fn(x.chunk(dist.get_world_size())[dist.get_rank()]).square().mean().backward()
    return {fqn: p.grad.full_tensor() for fqn, p in model.named_parameters()}, pass_of(model).merged


def train_composed(backend: str, tier: str) -> Result:
    """FULL_SHARD with bf16 compute / fp32 reduction, tied embeddings, two micro-batches per step
    (the first inside `no_sync`), `clip_grad_norm_` at 0.5 and activation checkpointing of every
    block, offloading `tier` ("none", "optimizer", "all"): what offload composes with, in one run."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(ARGS, tie_embeddings=True))
    simplefsdp.checkpoint_blocks(model)
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    simplefsdp.wrap(model, mp_policy=policy, offload=simplefsdp.OffloadPolicy.of_tier(tier))
    step_fn = model if backend == "eager" else torch.compile(model, backend=backend)
    opt = _optimizer(model, "adamw-foreach")
    norms = []
    for tokens in batches():
        local = tokens.chunk(dist.get_world_size())[dist.get_rank()]
        parts = local.chunk(2)
        for i, part in enumerate(parts):
            with simplefsdp.no_sync(model, enabled=i < len(parts) - 1):
                (loss_fn(step_fn, part) / len(parts)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
    return Result(norms, full_params(model))  # the gradient norms before clipping, in place of losses
