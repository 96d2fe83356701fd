"""The bucket copy ops against their pure-torch specification, on CPU and through the Triton kernel.

Triton runs in the CPU interpreter here (`TRITON_INTERPRET=1`, set before the kernel module is
first imported) or on a GPU when there is one. Results are bit-exact, fp32 -> bf16 included
(the kernel rounds with integer arithmetic, see [Note: exact bf16 rounding] in `triton_copy.py`);
the one exception is a down-cast to fp16 in the interpreter, whose float cast may round 1 ulp away
from torch's, and is checked to be within 1 ulp.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import simplefsdp.kernels  # noqa: F401  (registers torch.ops.simplefsdp.*)
from simplefsdp._compat import chunk_cat, tree_leaves
from simplefsdp.kernels import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()


@st.composite
def buckets(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 7, 8, 16, 64]))
    shapes = draw(
        st.lists(st.tuples(st.integers(0, 70), st.integers(1, 5)).map(lambda t: t if t[1] > 1 else (t[0],)), max_size=5)
    )
    src = draw(st.sampled_from(DTYPES))
    dst = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(0, world - 1))
    seed = draw(st.integers(0, 2**16))
    return world, rank, [tuple(s) for s in shapes], src, dst, seed


def _params(shapes, dtype, seed, device="cpu"):
    """Random tensors of `shapes`; every third one in fp32 whatever `dtype` is (buckets mix dtypes),
    laid out in memory as `_layout(seed)` says (the ops must accept any layout)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        _layout(torch.randn(s, generator=gen).to(dtype if i % 3 else torch.float32).to(device), seed)
        for i, s in enumerate(shapes)
    ]


def _layout(t: torch.Tensor, seed: int) -> torch.Tensor:
    """`t`'s values in one of three memory layouts, chosen by `seed`: contiguous; every other
    element of a twice-as-long buffer; dims in reversed memory order (a transpose's layout)."""
    kind = seed % 3
    if kind == 0 or t.numel() < 2:
        return t
    if kind == 1 or t.dim() < 2:
        spaced = t.new_empty(*t.shape, 2).select(-1, 0)
        return spaced.copy_(t)
    reversed_dims = list(range(t.dim()))[::-1]
    return t.permute(reversed_dims).contiguous().permute(reversed_dims)


def _shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 shard of `full`: a view, in `full`'s layout."""
    rows = math.ceil(full.shape[0] / world)
    return full[rank * rows : (rank + 1) * rows]


def _chunks(shapes, world):
    return [reference.chunk_numel(s, world) for s in shapes]


@settings(max_examples=150, deadline=None)
@given(bucket=buckets())
def test_all_gather_round_trip_over_all_ranks(bucket):
    """copy_out(all_gather(copy_in(shards))) == the full parameters, cast."""
    world, _, shapes, src, dst, seed = bucket
    fulls = _params(shapes, src, seed)
    chunks = _chunks(shapes, world)
    copy_in = torch.ops.simplefsdp.all_gather_copy_in
    # what the all-gather does: every rank's slot from that rank's copy-in, in rank order
    gathered = torch.cat([copy_in([_shard(f, world, r) for f in fulls], chunks, dst) for r in range(world)])
    gathered = _layout(gathered, seed)  # the gathered buffer too may arrive strided
    outs = torch.ops.simplefsdp.all_gather_copy_out(gathered, chunks, *_flat([f.shape for f in fulls]), world)
    for out, full in zip(outs, fulls, strict=True):
        assert out.shape == full.shape, "each output in its parameter's shape"
        assert torch.equal(out, full.to(dst))
    # the CPU implementations against the specification, piece by piece
    rank = world - 1
    shards = [_shard(f, world, rank) for f in fulls]
    want = reference.all_gather_copy_in(shards, chunks, dst)
    assert torch.equal(copy_in(shards, chunks, dst), want)
    assert want.shape == (sum(chunks),), "this rank's slot only"
    for got, want in zip(outs, reference.all_gather_copy_out(gathered, chunks, shapes, world), strict=True):
        assert torch.equal(got, want)


@settings(max_examples=150, deadline=None)
@given(bucket=buckets(), scale=st.sampled_from([1.0, 0.5, 1 / 3]))
def test_reduce_scatter_copy_in_is_chunk_cat(bucket, scale):
    world, _, shapes, src, dst, seed = bucket
    grads = _params(shapes, src, seed)
    out = torch.ops.simplefsdp.reduce_scatter_copy_in(grads, world, dst, scale)
    assert torch.equal(out, reference.reduce_scatter_copy_in(grads, world, dst, scale))
    scaled = [(g.float() * scale).to(dst) if scale != 1.0 else g.to(dst) for g in grads]
    if grads and all(g.numel() for g in grads):  # torch._chunk_cat rejects empty tensors
        assert torch.equal(out, chunk_cat(scaled, dim=0, num_chunks=world).reshape(-1))
    else:
        assert torch.equal(out, reference.reduce_scatter_copy_in(grads, world, dst, scale))
    # rank 0's slot holds each gradient's first chunk, contiguous: what the pass unpacks with views
    chunks = _chunks(shapes, world)
    for g, shard, chunk in zip(scaled, out.view(world, -1)[0].split(chunks), chunks, strict=True):
        assert torch.equal(shard[: min(chunk, g.numel())], g.reshape(-1)[:chunk])


def _flat(shapes) -> tuple[list[int], list[int]]:
    """The copy-out op's (sizes, ndims) for `shapes`."""
    return [d for shape in shapes for d in shape], [len(shape) for shape in shapes]


def test_bad_inputs_are_named():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"shards\[1\] has dtype torch.int64"):
        torch.ops.simplefsdp.all_gather_copy_in([x, torch.ones(3, dtype=torch.long)], [16, 3], torch.bfloat16)
    with pytest.raises(ValueError, match=r"shards\[0\] has 16 elements, more than its chunk of 8"):
        torch.ops.simplefsdp.all_gather_copy_in([x], [8], torch.bfloat16)
    with pytest.raises(ValueError, match="gathered has 16 elements; world 2 x bucket 4 expected"):
        torch.ops.simplefsdp.all_gather_copy_out(x.reshape(-1), [4], [8], [1], 2)
    with pytest.raises(ValueError, match=r"shape \[3, 3\] of output 0 does not fit 2 chunks of 4"):
        torch.ops.simplefsdp.all_gather_copy_out(torch.randn(8), [4], [3, 3], [2], 2)
    with pytest.raises(ValueError, match=r"ndims \[2\] do not split the 1 sizes"):
        torch.ops.simplefsdp.all_gather_copy_out(torch.randn(8), [4], [8], [2], 2)
    with pytest.raises(ValueError, match="got 2 chunk sizes for 1 tensors"):
        torch.ops.simplefsdp.all_gather_copy_in([x], [16, 1], torch.float32)
    leaf = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"grads\[0\] requires grad: the copy ops have no derivative"):
        torch.ops.simplefsdp.reduce_scatter_copy_in([leaf], 2, torch.float32, 1.0)
    with torch.no_grad():  # no gradient recorded: the op runs
        assert torch.ops.simplefsdp.reduce_scatter_copy_in([leaf], 2, torch.float32, 1.0).shape == (16,)


def test_ops_trace_under_compile():
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(a, b):
        flat = torch.ops.simplefsdp.all_gather_copy_in([a, b], [12, 4], torch.bfloat16)
        return torch.ops.simplefsdp.all_gather_copy_out(flat, [12, 4], [3, 4, 3], [2, 1], 1)

    a, b = torch.randn(3, 4), torch.randn(3)
    out = step(a, b)
    assert torch.equal(out[0], a.bfloat16())
    assert torch.equal(out[1], b.bfloat16())


def test_ops_stay_out_of_cuda_graphs():
    """[Note: not inside CUDA graphs]: each op's Triton path copies a fresh pointer table per call."""
    from simplefsdp.kernels import copy_ops

    for op in (copy_ops.ALL_GATHER_COPY_IN, copy_ops.ALL_GATHER_COPY_OUT, copy_ops.REDUCE_SCATTER_COPY_IN):
        assert torch.Tag.cudagraph_unsafe in op.tags, op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_convolution_weights(dtype):
    """Inductor hands conv weights and their gradients over channels-last; the ops read them in
    logical order, like their contiguous copies."""
    world, rank = 2, 1
    fulls = [torch.randn(s).to(memory_format=torch.channels_last) for s in [(8, 3, 4, 4), (6, 1, 3, 3), (5, 2, 1, 1)]]
    chunks = _chunks([f.shape for f in fulls], world)
    shards = [_shard(f, world, rank) for f in fulls]
    assert not fulls[0].is_contiguous()
    assert not shards[0].is_contiguous()
    plain = [s.contiguous() for s in shards]
    copy_in = torch.ops.simplefsdp.all_gather_copy_in
    assert torch.equal(copy_in(shards, chunks, dtype), copy_in(plain, chunks, dtype))
    rs = torch.ops.simplefsdp.reduce_scatter_copy_in
    assert torch.equal(rs(fulls, world, dtype, 0.5), rs([f.contiguous() for f in fulls], world, dtype, 0.5))
    assert torch.equal(rs(fulls, world, dtype, 0.5), reference.reduce_scatter_copy_in(fulls, world, dtype, 0.5))


# --- the Triton kernel ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_device():
    """The device the Triton path runs on (the GPU, or the CPU through the interpreter), and the
    list of kernel launches (one plan each), so a test can tell the Triton path ran, and how often."""
    with pytest.MonkeyPatch.context() as patch:
        if not CUDA:
            patch.setenv("TRITON_INTERPRET", "1")
            patch.setenv("SIMPLEFSDP_TRITON_ON_CPU", "1")
        from simplefsdp.kernels import copy_ops, triton_copy

        importlib.reload(triton_copy)  # decorate the kernels in interpreter mode
        if not CUDA and (problem := triton_copy.interpreter_problem()):
            pytest.skip(problem)  # a third-party incompatibility, refused with this reason by `supports`
        copy_ops._kernel_choice.cache_clear()
        launches = []
        launch = triton_copy.launch_bucket

        def counted(plan, *args, **kwargs):
            launches.append(plan)
            return launch(plan, *args, **kwargs)

        patch.setattr(triton_copy, "launch_bucket", counted)
        yield ("cuda" if CUDA else "cpu"), launches
    copy_ops._kernel_choice.cache_clear()


def _close_or_one_ulp(actual: torch.Tensor, expected: torch.Tensor, interpreter: bool) -> None:
    if expected.dtype == torch.float16 and interpreter:
        assert actual.shape == expected.shape
        diff = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        assert bool((diff <= 1).all()), f"fp16 down-cast off by more than 1 ulp: {diff.max().item()} ulps"
    else:
        assert torch.equal(actual, expected)


def _check_triton_against_reference(triton_device, bucket, scale) -> None:
    triton_device, launches = triton_device
    del launches[:]
    world, rank, shapes, src, dst, seed = bucket
    interpreter = triton_device == "cpu"
    fulls = _params(shapes, src, seed)
    chunks = _chunks(shapes, world)
    shards = [_shard(f, world, rank) for f in fulls]
    on = [t.to(triton_device) for t in shards]
    got = torch.ops.simplefsdp.all_gather_copy_in(on, chunks, dst).cpu()
    _close_or_one_ulp(got, reference.all_gather_copy_in(shards, chunks, dst), interpreter)

    gathered = torch.cat(
        [reference.all_gather_copy_in([_shard(f, world, r) for f in fulls], chunks, src) for r in range(world)]
    )
    got = torch.ops.simplefsdp.all_gather_copy_out(gathered.to(triton_device), chunks, *_flat(shapes), world)
    for g, e in zip(got, reference.all_gather_copy_out(gathered, chunks, shapes, world), strict=True):
        assert torch.equal(g.cpu(), e)

    got = torch.ops.simplefsdp.reduce_scatter_copy_in([f.to(triton_device) for f in fulls], world, dst, scale).cpu()
    _close_or_one_ulp(got, reference.reduce_scatter_copy_in(fulls, world, dst, scale), interpreter)
    buckets_launched = [plan for plan in launches if plan.segments]
    assert len(buckets_launched) == 3 * bool(shapes), "the Triton path: one launch per op call, whole bucket"
    assert all(len(plan.segments) == len(shapes) for plan in buckets_launched)


# The Triton kernel against the reference on random buckets: a few in the fast tier (Triton's
# interpreter runs each launch element by element), many in the full suite.
@settings(max_examples=8, deadline=None)
@given(bucket=buckets(), scale=st.sampled_from([1.0, 0.25, 1 / 3]))
def test_triton_matches_reference(triton_device, bucket, scale):
    _check_triton_against_reference(triton_device, bucket, scale)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(bucket=buckets(), scale=st.sampled_from([1.0, 0.25, 1 / 3]))
def test_triton_matches_reference_on_many_buckets(triton_device, bucket, scale):
    _check_triton_against_reference(triton_device, bucket, scale)


def test_triton_table_cache_reuses_only_identical_tables(triton_device):
    """A repeated copy between the same tensors reuses its device table (the table holds pointers, so
    new values at the same addresses are still read); another destination gets a table of its own."""
    from simplefsdp.kernels import triton_copy

    device, _ = triton_device
    world, rank, shapes = 2, 1, [(5, 3), (4,), (7, 2)]
    chunks = _chunks(shapes, world)
    shards = [_shard(f, world, rank).to(device) for f in _params(shapes, torch.float32, 0)]
    out = torch.empty(sum(chunks), dtype=torch.bfloat16, device=device)
    triton_copy._tables.clear()  # far from the cache's bound, whatever ran before

    def check(dst):
        triton_copy.pack([t.view(-1) for t in shards], chunks, dst, rows=1)
        assert torch.equal(dst.cpu(), reference.all_gather_copy_in([t.cpu() for t in shards], chunks, torch.bfloat16))

    check(out)
    sent = len(triton_copy._tables)
    for t in shards:
        t.mul_(-3.0)  # same addresses, new values
    check(out)
    assert len(triton_copy._tables) == sent, "an identical table was sent again"
    check(torch.empty_like(out))
    assert len(triton_copy._tables) == sent + 1, "a new destination must get a table of its own"


@settings(max_examples=25, deadline=None)
@given(bucket=buckets(), programs=st.integers(1, 4), block=st.sampled_from([8, 16, 1024]))
def test_triton_grid_stride_loop_covers_every_tile(triton_device, bucket, programs, block):
    """Fewer programs than tiles (the loop inside the kernel that keeps any size within CUDA's grid
    limits) and small tiles (many per row): still the reference, bit for bit."""
    from simplefsdp.kernels import launch, triton_copy

    triton_device, _ = triton_device
    world, _, shapes, src, dst, seed = bucket
    grads = _params(shapes, src, seed)
    chunks = _chunks(shapes, world)
    out = torch.full((world * sum(chunks),), float("nan"), dtype=dst, device=triton_device)
    flat = [g.contiguous().view(-1).to(triton_device) for g in grads]  # the kernel reads flat memory
    plan = launch.plan_launch(kind="pack", chunks=chunks, numels=[g.numel() for g in grads], rows=world, block=block,
                            max_programs=programs)  # fmt: skip
    triton_copy.launch_bucket(plan, flat, [out] * len(flat), scale=0.5)
    _close_or_one_ulp(out.cpu(), reference.reduce_scatter_copy_in(grads, world, dst, 0.5), triton_device == "cpu")

    gathered = out.to(src)
    outs = [torch.full((math.prod(s),), float("nan"), dtype=src, device=triton_device) for s in shapes]
    plan = launch.plan_launch(kind="unpack", chunks=chunks, numels=[o.numel() for o in outs], rows=world, block=block,
                              max_programs=programs)  # fmt: skip
    triton_copy.launch_bucket(plan, [gathered] * len(outs), outs)
    for o, e in zip(outs, reference.all_gather_copy_out(gathered.cpu(), chunks, shapes, world), strict=True):
        assert torch.equal(o.cpu(), e.reshape(-1))


def test_fake_impls_match_what_the_dispatcher_returns():
    """[Note: the copy ops' output metadata, directly]: the pass's shortcut gives the same metadata."""
    from simplefsdp._compat import FakeTensorMode
    from simplefsdp.kernels.copy_ops import (
        ALL_GATHER_COPY_IN,
        ALL_GATHER_COPY_OUT,
        FAKE_IMPLS,
        RANK_SLOT,
        REDUCE_SCATTER_COPY_IN,
    )

    with FakeTensorMode() as mode:
        shards = [mode.from_tensor(torch.zeros(3, 5)), mode.from_tensor(torch.zeros(7))]
        gathered = mode.from_tensor(torch.zeros(4 * 23))
        grads = [mode.from_tensor(torch.zeros(9, 5)), mode.from_tensor(torch.zeros(10))]
        calls = [
            (ALL_GATHER_COPY_IN, (shards, [15, 8], torch.bfloat16)),
            (ALL_GATHER_COPY_OUT, (gathered, [15, 8], [12, 5, 30], [2, 1], 4)),
            (REDUCE_SCATTER_COPY_IN, (grads, 4, torch.float32, 0.5)),
            (RANK_SLOT, (gathered, "0", 23)),
        ]
        for op, args in calls:
            expected, got = op(*args), FAKE_IMPLS[op](*args)
            for e, g in zip(tree_leaves(expected), tree_leaves(got), strict=True):
                assert (g.shape, g.stride(), g.dtype, g.device) == (e.shape, e.stride(), e.dtype, e.device), op
                assert isinstance(g, type(e)), op
    assert set(FAKE_IMPLS) == {ALL_GATHER_COPY_IN, ALL_GATHER_COPY_OUT, REDUCE_SCATTER_COPY_IN, RANK_SLOT}
