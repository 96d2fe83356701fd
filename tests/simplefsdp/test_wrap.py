"""What `wrap()` does to a module, on the fake process group (world 8): names, placements, state, errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import simplefsdp
from simplefsdp._compat import rank_aware_cache_key
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.install import compile_scope
from tests._tiers import fast_first

ARGS = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)


class WithExtras(nn.Module):
    """A Linear plus state that must stay untouched: a buffer, an integer parameter, a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.steps = nn.Parameter(torch.tensor([7], dtype=torch.int64), requires_grad=False)
        self.register_buffer("running", torch.arange(5.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale + self.running[:3]


@pytest.fixture
def mesh(fake_world8):
    return init_device_mesh("cpu", (fake_world8,))


@pytest.mark.parametrize(
    ("strategy", "placements"),
    [("FULL_SHARD", (Shard(0),)), ("SHARD_GRAD_OP", (Shard(0),)), ("NO_SHARD", (Replicate(),))],
)
def test_parameters_keep_names_and_become_sharded_dtensors(mesh, strategy, placements):
    plain = Transformer(ARGS)
    names = [fqn for fqn, _ in plain.named_parameters()]
    shapes = {fqn: p.shape for fqn, p in plain.named_parameters()}
    keys = list(plain.state_dict())

    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy=strategy)
    assert [fqn for fqn, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    for fqn, param in model.named_parameters():
        assert isinstance(param, nn.Parameter), fqn
        assert isinstance(param, DTensor), fqn
        assert param.placements == placements, fqn
        assert param.shape == shapes[fqn], fqn
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor), key


def test_hybrid_placements(fake_world8):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy="HYBRID_SHARD")
    assert {p.placements for p in model.parameters()} == {(Replicate(), Shard(0))}


def test_attribute_access_returns_full_tensor(mesh):
    model = simplefsdp.wrap(Transformer(ARGS), mesh)
    weight = model.output.weight
    assert type(weight) is torch.Tensor
    assert weight.shape == (ARGS.vocab_size, ARGS.dim)
    assert isinstance(model.output, nn.Linear), "the swapped class still subclasses the original"


def test_uneven_and_tiny_shards(mesh):
    """vocab 67 on 8 ranks and a bias of 3 on 8 ranks: torch.chunk semantics, rank 0 holds the first chunk."""
    model = simplefsdp.wrap(WithExtras(), mesh)
    bias = model._modules["linear"]._parameters["bias"]
    assert bias.shape == (3,)
    assert bias.to_local().shape == (1,)
    emb = simplefsdp.wrap(Transformer(ARGS), mesh).tok_embeddings._parameters["weight"]
    assert emb.to_local().shape == (9, ARGS.dim)  # ceil(67 / 8) rows on rank 0


def test_buffers_and_non_float_parameters_untouched(mesh):
    model = WithExtras()
    steps, running = model.steps, model.running
    simplefsdp.wrap(model, mesh)
    assert model.steps is steps
    assert not isinstance(model.steps, DTensor)
    assert model.running is running
    assert not isinstance(model.running, DTensor)
    scale = model._parameters["scale"]
    assert isinstance(scale, DTensor)
    assert scale.placements == (Replicate(),), "0-dim: nothing to shard"
    assert model(torch.ones(2, 4)).shape == (2, 3)


def test_tied_parameters_stay_one_object(mesh):
    model = Transformer(ARGS)
    model.output.weight = model.tok_embeddings.weight
    simplefsdp.wrap(model, mesh)
    assert model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]
    assert len(list(model.parameters())) == len(list(Transformer(ARGS).parameters())) - 1


def test_sharded_parameters_context(mesh):
    model = simplefsdp.wrap(Transformer(ARGS), mesh)
    with simplefsdp.sharded_parameters(model):
        raw = model.output.weight
        assert isinstance(raw, nn.Parameter)
        assert isinstance(raw, DTensor)
        with torch.no_grad():
            nn.init.constant_(raw, 0.5)
        model.reset_parameters()  # the model's own init runs on the shards
        nn.init.zeros_(model.norm.weight)
    assert type(model.output.weight) is torch.Tensor
    assert torch.equal(model.norm.weight, torch.zeros(ARGS.dim))
    with pytest.raises(RuntimeError, match="boom"), simplefsdp.sharded_parameters(model):
        raise RuntimeError("boom")
    assert type(model.output.weight) is torch.Tensor, "classes restored after an error"


def test_mixed_precision_casts(mesh):
    policy = simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = simplefsdp.wrap(WithExtras(), mesh, mp_policy=policy)
    assert model.linear.weight.dtype == torch.bfloat16
    assert model._modules["linear"]._parameters["weight"].dtype == torch.float32, "masters stay fp32"
    out = model(torch.ones(2, 4))  # fp32 input cast to bf16, output cast back
    assert out.dtype == torch.float32


# ---- bad input: each error names the culprit ---------------------------------------------------


def test_wrapping_twice(mesh):
    model = simplefsdp.wrap(Transformer(ARGS), mesh)
    with pytest.raises(ValueError, match="the model is already wrapped"):
        simplefsdp.wrap(model, mesh)
    parent = nn.Sequential(nn.Linear(3, 3), model)
    with pytest.raises(ValueError, match=r"submodule '1' is already wrapped"):
        simplefsdp.wrap(parent, mesh)


@pytest.mark.parametrize(
    ("strategy", "shape", "match"),
    [
        ("HYBRID_SHARD", (8,), r"HYBRID_SHARD needs a 2-D mesh \(replicate, shard\), got a 1-D"),
        ("HYBRID_SHARD_ZERO2", (8,), "HYBRID_SHARD_ZERO2 needs a 2-D mesh"),
        ("FULL_SHARD", (2, 4), r"FULL_SHARD needs a 1-D mesh \(dp,\), got a 2-D DeviceMesh\('cpu', shape \(2, 4\)"),
    ],
)
def test_mesh_dims_must_fit_strategy(fake_world8, strategy, shape, match):
    with pytest.raises(ValueError, match=match):
        simplefsdp.wrap(Transformer(ARGS), init_device_mesh("cpu", shape), strategy=strategy)


def test_hybrid_without_mesh(fake_world8):
    with pytest.raises(ValueError, match=r"HYBRID_SHARD needs a 2-D mesh .* and none was given"):
        simplefsdp.wrap(Transformer(ARGS), strategy="HYBRID_SHARD")


def test_default_mesh_is_the_whole_world(fake_world8):
    model = simplefsdp.wrap(Transformer(ARGS))
    mesh = model.output._parameters["weight"].device_mesh
    assert mesh.device_type == "cpu"
    assert tuple(mesh.shape) == (8,)


def test_parameter_on_another_device_type(mesh):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    with pytest.raises(ValueError, match="parameters live on several device types"):
        simplefsdp.wrap(model, mesh)
    # a model built wholly on meta wraps onto any mesh (simplefsdp.materialize allocates it later)
    meta = simplefsdp.wrap(nn.Sequential(nn.Linear(3, 3, device="meta")), mesh)
    assert meta[0]._parameters["weight"].to_local().is_meta


def test_unknown_strategy(mesh):
    with pytest.raises(ValueError, match=r"unknown sharding strategy 'ZERO3'; expected one of: FULL_SHARD, "):
        simplefsdp.wrap(Transformer(ARGS), mesh, strategy="ZERO3")


def test_strategy_names_are_case_insensitive(mesh):
    model = simplefsdp.wrap(Transformer(ARGS), mesh, strategy="no_shard")
    assert model.output._parameters["weight"].placements == (Replicate(),)


def test_already_dtensor_parameter(mesh):
    first = simplefsdp.wrap(nn.Linear(4, 4), mesh)
    model = nn.Sequential(nn.Linear(4, 4))
    model[0]._parameters["weight"] = first._parameters["weight"]
    with pytest.raises(ValueError, match=r"parameter '0.weight' is already a DTensor"):
        simplefsdp.wrap(model, mesh)


def test_bad_policy_and_reduce_op(mesh):
    with pytest.raises(ValueError, match=r"param_dtype must be a floating-point torch\.dtype, got torch\.int32"):
        simplefsdp.MixedPrecisionPolicy(param_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"mp_policy must be a simplefsdp\.MixedPrecisionPolicy"):
        simplefsdp.wrap(Transformer(ARGS), mesh, mp_policy={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="reduce_op must be 'avg' or 'sum', got 'mean'"):
        simplefsdp.wrap(Transformer(ARGS), mesh, reduce_op="mean")


@pytest.mark.parametrize("value", ["no", 0, 1.0])
def test_reshard_after_forward_takes_a_bool_or_none(mesh, value):
    """A truthy string or number is not taken for True (nor 0 for False)."""
    with pytest.raises(ValueError, match=rf"reshard_after_forward must be True, False or None .*got {value!r}$"):
        simplefsdp.wrap(Transformer(ARGS), mesh, reshard_after_forward=value)


def test_not_a_module(mesh):
    with pytest.raises(TypeError, match=r"wrap\(\) takes an nn.Module, got list"):
        simplefsdp.wrap([nn.Linear(2, 2)], mesh)


def test_parameter_replaced_after_wrap(mesh):
    model = simplefsdp.wrap(nn.Linear(4, 4), mesh)
    model.weight = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="parameter 'weight' of Linear was replaced after"):
        model(torch.ones(1, 4))


def test_sharded_parameters_on_unwrapped_model():
    with (
        pytest.raises(ValueError, match=r"Linear is not wrapped by simplefsdp\.wrap"),
        simplefsdp.sharded_parameters(nn.Linear(2, 2)),
    ):
        pass


# torch's own method, taken before any scope of this process replaced it (none is open at import)
TORCH_KEY = DTensor._stable_hash_for_caching


def _uneven(mesh, rows: int, fill: float = 0.0) -> DTensor:
    """One rank's view of a 67-row parameter sharded over `mesh`: `rows` rows here."""
    return DTensor.from_local(torch.full((rows, 4), fill), mesh, [Shard(0)], shape=(67, 4), stride=(4, 1))


def test_dtensor_cache_key_sees_the_local_shard(mesh):
    """Two ranks' views of one uneven parameter (9 rows on rank 0, 4 on rank 7 of 67) must not share a
    compile-cache key while a wrapped model compiles; see [Note: per-rank AOTAutograd cache keys for
    DTensor inputs]."""
    model = simplefsdp.wrap(nn.Linear(2, 2), mesh)
    rank0, rank7, same_as_rank0 = _uneven(mesh, 9), _uneven(mesh, 4), _uneven(mesh, 9, fill=1.0)
    with compile_scope(model):
        assert rank0._stable_hash_for_caching() != rank7._stable_hash_for_caching()
        assert rank0._stable_hash_for_caching() == same_as_rank0._stable_hash_for_caching()
    assert rank0._stable_hash_for_caching() == rank7._stable_hash_for_caching(), "torch's own key again"


def test_dtensor_cache_key_changes_only_on_wrapped_meshes(mesh):
    """The workaround is as narrow as torch allows: even while a wrapped model compiles, a DTensor on a
    mesh no wrapped model uses keeps torch's own key (different local shards, same key, as torch has it)."""
    model = simplefsdp.wrap(nn.Linear(2, 2), mesh)
    other = init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b"))  # no wrapped model uses it
    rank0 = DTensor.from_local(torch.zeros(9, 4), other, [Replicate(), Shard(0)], shape=(67, 4), stride=(4, 1))
    rank7 = DTensor.from_local(torch.zeros(4, 4), other, [Replicate(), Shard(0)], shape=(67, 4), stride=(4, 1))
    with compile_scope(model):
        assert rank0._stable_hash_for_caching() == rank7._stable_hash_for_caching() == TORCH_KEY(rank0)


def _keys_while_compiling(fn, *args) -> list[tuple[str, DTensor]]:
    """(key, fake input) of every DTensor input of the graphs Dynamo compiles for `fn(*args)`, the key
    as `DTensor._stable_hash_for_caching` gives it to AOTAutograd's cache there (in the backend)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend((t._stable_hash_for_caching(), t) for t in example_inputs if isinstance(t, DTensor))
        return gm.forward

    torch.compile(fn, backend=backend)(*args)
    return seen


@pytest.mark.parametrize("how", ["model", "passes off", "inside a compiled step, in compile_scope()"])
def test_wrapped_model_compiles_with_per_rank_cache_keys(mesh, how):
    """simplefsdp's own compiles -- the wrapped model compiled, with passes or without, or called
    from a compiled function inside `compile_scope(model)` -- key its DTensors per rank."""
    passes = None if how == "passes off" else simplefsdp.PassConfig()
    model = simplefsdp.wrap(nn.Linear(4, 67), mesh, passes=passes)
    x = torch.ones(2, 4)
    if how.startswith("inside"):
        with compile_scope(model):
            keys = _keys_while_compiling(lambda x: model(x).sum(), x)
    else:
        keys = _keys_while_compiling(model, x)
    assert keys, "the parameters are graph inputs"
    for key, fake in keys:
        assert key == rank_aware_cache_key(fake, TORCH_KEY(fake)) != TORCH_KEY(fake)


def test_dtensor_programs_outside_simplefsdp_compiles_keep_torchs_cache_key(mesh):
    """A DTensor program on a mesh that `wrap()` used, compiled in the same process after the wrapped
    model compiled, gets exactly torch's own key: nothing of the workaround outlives the model's compile."""
    assert TORCH_KEY.__module__ == "torch.distributed.tensor._api", "torch's own method"
    model = simplefsdp.wrap(nn.Linear(4, 67), mesh)
    assert _keys_while_compiling(model, torch.ones(2, 4))
    assert DTensor._stable_hash_for_caching is TORCH_KEY
    keys = _keys_while_compiling(lambda t: (t * 2).to_local(), _uneven(mesh, 9))
    assert [key for key, _ in keys] == [TORCH_KEY(fake) for _, fake in keys] != []


def test_swapped_classes_say_what_they_add(mesh):
    """`repr` and tracebacks name each class swap: gather on access, the compiler pass, checkpointing,
    the nested compile region."""
    model = Transformer(ARGS)
    simplefsdp.checkpoint_blocks(model)
    simplefsdp.wrap(model, mesh)
    assert type(model).__name__ == "PassOnCompile[Transformer]"
    assert type(model.layers[0]).__name__ == "Region[Checkpointed[Block]]"
    assert type(model.layers[0].attention.wq).__name__ == "GatherOnAccess[Linear]"
    assert isinstance(model.layers[0].attention.wq, nn.Linear)
    assert repr(model).startswith("PassOnCompile[Transformer](")


def test_bad_pattern_leaves_the_model_unwrapped(mesh):
    model = Transformer(ARGS)
    config = simplefsdp.PassConfig(bucket=simplefsdp.BucketConfig(plan="patterns", patterns=("decoder.*",)))
    with pytest.raises(ValueError, match=r"bucket patterns \['decoder\.\*'\] match no parameter"):
        simplefsdp.wrap(model, mesh, passes=config)
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "checked before anything changed"
    simplefsdp.wrap(model, mesh)  # and it can still be wrapped


class _WithState(torch.nn.Module):
    """Parameters plus every kind of replicated state: a float buffer, a bool buffer, a
    non-persistent buffer, an integer parameter, and a BatchNorm's running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))
        self.register_buffer("table", torch.zeros(2, 2).t(), persistent=False)  # not contiguous
        self.index = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)


def _replicated_state_after_wrap(mesh_shape: tuple[int, ...]) -> dict[str, list]:
    """On each rank: state set from the rank number, then wrapped over a mesh of `mesh_shape`."""
    rank = dist.get_rank()
    model = _WithState()
    with torch.no_grad():
        for t in (model.norm.running_mean, model.scale, model.table, model.index):
            t.fill_(rank + 1)
        model.mask[rank] = True
        model.norm.num_batches_tracked.fill_(10 * rank)
    simplefsdp.wrap(
        model, init_device_mesh("cpu", mesh_shape), strategy="HYBRID_SHARD" if len(mesh_shape) > 1 else "FULL_SHARD"
    )
    return {name: t.tolist() for name, t in [*model.named_buffers(), ("index", model._parameters["index"])]}


@pytest.mark.parametrize("mesh_shape", fast_first([(2,), (2, 2)]), ids=["1d", "2d"])
def test_replicated_state_takes_rank0_values(request, mesh_shape):
    """Buffers and integer parameters start from rank 0's values, as the sharded parameters do: a
    rank that initialised differently no longer evaluates a different model ([Note: replicated
    state starts from rank 0])."""
    states = request.getfixturevalue(f"ranks{math.prod(mesh_shape)}").run(_replicated_state_after_wrap, mesh_shape)
    assert states[0]["norm.running_mean"] == [1.0] * 4
    assert states[0]["mask"] == [True] + [False] * 4
    assert states[0]["norm.num_batches_tracked"] == 0
    assert states[0]["index"] == [1, 1]
    for rank, state in enumerate(states[1:], start=1):
        assert state == states[0], f"rank {rank} kept its own replicated state"


def test_low_precision_parameters_get_fp32_masters_under_a_policy(mesh, caplog):
    """bf16 parameters under a policy with param_dtype: fp32 shards, logged once with the bytes per
    rank; without a policy they stay bf16 (see [Note: full-precision masters])."""
    args = TransformerArgs(vocab_size=67, dim=32, n_layers=2, n_heads=4, ffn_dim=88, max_seq_len=16)
    model = Transformer(args).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="simplefsdp.wrap"):
        simplefsdp.wrap(model, mesh, mp_policy=simplefsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    (record,) = [r for r in caplog.records if "fp32 sharded masters" in r.getMessage()]
    added = sum(p.to_local().numel() * 2 for p in model.parameters())  # 2 more bytes per element
    assert f"{len(list(model.parameters()))} bfloat16 parameters" in record.getMessage()
    assert f"+{added / 2**20:.1f} MiB per rank" in record.getMessage()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    pure = simplefsdp.wrap(Transformer(args).to(torch.bfloat16), mesh)
    assert {p.dtype for p in pure.parameters()} == {torch.bfloat16}


def test_accelerate_mixed_precision_gives_fp32_masters(mesh):
    """Accelerate's `mixed_precision: bf16` on a model loaded in bf16: fp32 sharded masters, as
    Accelerate's own FSDP upcasts them."""
    document = {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {}}
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)).to(torch.bfloat16)
    simplefsdp.wrap(model, mesh, **simplefsdp.from_accelerate(document, model=model).wrap_kwargs())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_public_names_mean_one_thing():
    """Every name a module of the package exports (`__all__`) is one object wherever it is exported:
    two different functions under one public name (two `reduce_pending`s once) read as one."""
    import importlib
    import pkgutil

    exported: dict[str, dict[int, str]] = {}
    for info in pkgutil.walk_packages(simplefsdp.__path__, prefix="simplefsdp."):
        if info.name.endswith(".__main__"):  # runs its command when imported
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if name == "main":  # each command's entry point
                continue
            if callable(value) or isinstance(value, type):
                exported.setdefault(name, {})[id(value)] = info.name
    clashes = {name: sorted(where.values()) for name, where in exported.items() if len(where) > 1}
    assert not clashes, f"one public name, different objects: {clashes}"
    assert simplefsdp.compile_scope is simplefsdp.passes.install.compile_scope
