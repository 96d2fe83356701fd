"""The advisor: re-costing equals tracing, the ranking's rules, determinism, pruning, the CLI and its
bad input, and -- on 2 gloo ranks -- that what it says fits stays within its predicted memory.

Fast tier: the CLI's search end to end (one trace), the rendered choice and the bad input; the tests
on the full world-8 search (its fixture traces every strategy x AC twice), the pruning and the
measured memory run in the full suite."""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import subprocess
import sys

import pytest

from simplefsdp.inspect import advise as advise_module
from simplefsdp.inspect import cli
from simplefsdp.inspect.advise import PASS_VARIANTS, Choice, advise, rank_rows
from simplefsdp.inspect.advised_run import run_settings, torchrun_command, train_command, write_toml
from simplefsdp.inspect.dryrun import dry_run
from simplefsdp.inspect.shapes import model_shape
from simplefsdp.strategy import ShardingStrategy
from simplefsdp.train.config import parse_args
from tests.inspect._advised_ranks import measured_peak

AC = ("none", "full")


def _numbers(advice) -> list[tuple]:
    return [
        (
            row.choice,
            row.fits,
            row.verdict.peak_bytes,
            None if row.result is None else row.result.step_s,
            None if row.result is None else row.result.exposed_s,
        )
        for row in advice.rows
    ]


@pytest.fixture(scope="module")
def tiny_w8():
    """Every configuration of "tiny" at world 8 on h100, with a capacity some fit and some do not."""
    roomy = advise("tiny", world_size=8, device="h100", ac=AC, capacity_bytes=2**30, offload=("none",))
    peaks = sorted(row.verdict.peak_bytes for row in roomy.rows)
    middle = peaks[len(peaks) // 2]
    return advise("tiny", world_size=8, device="h100", ac=AC, capacity_bytes=middle / 0.9, offload=("none",))


@pytest.mark.slow
def test_every_configuration_is_costed_once(tiny_w8):
    strategies = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
    expected = {
        Choice(strategy=s, ac=a, tp=1, plan=p, prefetch_depth=d, memory_budget=b)
        for s in strategies
        for a in AC
        for p, d, b in PASS_VARIANTS
    }
    assert len(tiny_w8.rows) == len(expected), "no configuration twice"
    assert {row.choice for row in tiny_w8.rows} == expected
    assert tiny_w8.traces == len(strategies) * len(AC), "one trace per strategy x AC, not per pass variant"
    assert tiny_w8.recosts == len(expected)


@pytest.mark.slow
def test_recosting_equals_tracing_with_the_pass_on(tiny_w8):
    """[Note: trace once, re-cost many]: the default pass (blocks, prefetch 1) and no pass, re-costed
    on the pass-off trace, give exactly what a dry run compiled with them gives."""
    by_choice = {row.choice: row.result for row in tiny_w8.rows}
    for plan, depth, passes in (("blocks", 1, dry_run.__kwdefaults__["passes"]), ("none", None, None)):
        traced = dry_run("tiny", world_size=8, device="h100", passes=passes)
        choice = Choice(strategy=ShardingStrategy.FULL_SHARD, ac="none", tp=1, plan=plan, prefetch_depth=depth)
        recosted = by_choice[choice]
        assert recosted.step_s == pytest.approx(traced.step_s, rel=1e-9), plan
        assert recosted.exposed_s == pytest.approx(traced.exposed_s, rel=1e-9, abs=1e-12), plan
        assert recosted.peak_bytes == traced.peak_bytes, plan


@pytest.mark.slow
def test_ranking_fits_first_fastest_first_then_smallest_peak(tiny_w8):
    fits = [row for row in tiny_w8.rows if row.fits]
    rest = [row for row in tiny_w8.rows if not row.fits]
    assert fits, "the fixture's capacity fits some configurations"
    assert rest, "and not others"
    assert tiny_w8.rows[: len(fits)] == tuple(fits), "every fitting row ranks above every other"
    throughput = [row.result.tokens_per_s for row in fits]
    assert throughput == sorted(throughput, reverse=True), "most tokens per second first"
    peaks = [row.verdict.peak_bytes for row in rest]
    assert peaks == sorted(peaks)
    assert all(row.verdict.peak_bytes <= 0.9 * tiny_w8.capacity_bytes for row in fits)
    assert tiny_w8.winner is tiny_w8.rows[0]
    assert tiny_w8.winner.result.tokens_per_s == max(throughput)


@pytest.mark.slow
def test_the_ranking_does_not_depend_on_the_order_rows_are_costed_in(tiny_w8):
    shuffled = list(tiny_w8.rows)
    random.Random(0).shuffle(shuffled)
    assert rank_rows(shuffled) == tiny_w8.rows


@pytest.mark.slow
def test_same_answer_twice_and_in_worker_processes(tiny_w8):
    """A second search, its configurations traced in 2 worker processes ([Note: worker processes] in workers.py),
    ranks the same configurations with the same numbers."""
    again = advise(
        "tiny", world_size=8, device="h100", ac=AC, capacity_bytes=tiny_w8.capacity_bytes, jobs=2, offload=("none",)
    )
    assert _numbers(again) == _numbers(tiny_w8)
    assert again.traces == tiny_w8.traces


@pytest.mark.slow
def test_a_bound_above_the_memory_prunes_without_tracing():
    """SHARD_GRAD_OP without checkpointing keeps every gathered weight from forward to backward:
    with less memory than that, its rows are listed as not fitting, with the bound, never traced."""
    roomy = advise("tiny", world_size=8, device="h100", ac=("none",), capacity_bytes=2**30, offload=("none",))
    persistent = roomy.rows[0].result.persistent
    held = persistent.params_bytes + persistent.optimizer_bytes
    tight = held + 1000  # above the shards and optimizer state, below them plus the bf16 weights
    advice = advise("tiny", world_size=8, device="h100", ac=("none", "full"), capacity_bytes=tight, offload=("none",))
    pruned = [row for row in advice.rows if row.pruned]
    assert {(row.choice.strategy, row.choice.ac) for row in pruned} == {(ShardingStrategy.SHARD_GRAD_OP, "none")}
    assert len(pruned) == len(PASS_VARIANTS)
    assert all(row.bound_bytes > tight and not row.fits for row in pruned)
    assert advice.traces == 3, "FULL_SHARD twice, SHARD_GRAD_OP with checkpointing (it re-gathers)"


@pytest.mark.slow
def test_checks_stop_once_the_winner_is_decided(monkeypatch):
    """[Note: checking only what can win]: two configurations of a deep shape fit; checked best first
    one at a time, the first decides: the other's rows stay "not checked", rank after the checked
    rows that fit, and none of them would have beaten the winner had its check found it steady."""
    deep = dataclasses.replace(model_shape("tiny").args, n_layers=10)
    shape = dataclasses.replace(model_shape("tiny"), name="tiny-10", args=deep)
    monkeypatch.setattr(advise_module, "CHECK_BATCH", 1)
    advice = advise(
        shape,
        world_size=8,
        device="h100",
        ac=("none",),
        strategies=("FULL_SHARD", "SHARD_GRAD_OP"),
        capacity_bytes=2**30,
        max_traced_blocks=2,
        jobs=2,
        offload=("none",),
    )
    assert all(row.verdict.fits for row in advice.rows), "the premise: both configurations have rows that fit"
    checked = {r.choice.strategy for r in advice.rows if r.steady is not None}
    assert checked == {advice.winner.choice.strategy}, "the best configuration, checked first, decided it"
    unchecked = [r for r in advice.rows if r.steady is None]
    assert len(unchecked) == len(PASS_VARIANTS)
    assert all(not r.fits for r in unchecked), "fits by the extrapolation, not ranked as fitting"
    ranks = {id(r): i for i, r in enumerate(advice.rows)}
    fitting = [ranks[id(r)] for r in advice.rows if r.fits]
    assert max(fitting) < min(ranks[id(r)] for r in unchecked), "checked rows that fit rank first"
    for row in unchecked:  # a check changes no number: found steady, the row would still rank below
        assert rank_rows([dataclasses.replace(row, steady=True), advice.winner])[0] is advice.winner


@pytest.mark.slow
def test_deep_shapes_extrapolate_from_a_steady_state():
    """A 10-block shape searched from traces of 4, 5 and 6 blocks: the default pass's row matches a
    full 10-block trace, and rows are marked steady or not by the two extrapolations' agreement."""
    shape = dataclasses.replace(
        model_shape("tiny"), name="tiny-10", args=dataclasses.replace(model_shape("tiny").args, n_layers=10)
    )
    advice = advise(
        shape,
        world_size=8,
        device="h100",
        ac=("full",),
        strategies=("FULL_SHARD",),
        capacity_bytes=2**30,
        max_traced_blocks=2,
        jobs=2,  # the three rounds of [Note: the search's rounds] over worker processes
        offload=("none",),  # the tiers are priced on the same traces (test_offload_cost.py)
    )
    assert advice.traces == 1
    default = next(r for r in advice.rows if r.choice.plan == "blocks" and r.choice.prefetch_depth == 1)
    assert default.result.traced_blocks == (5, 6), "extrapolated from 5 and 6 blocks (4: the check)"
    full = dry_run(shape, world_size=8, device="h100", ac="full", max_traced_blocks=10)
    assert default.steady is True
    assert default.result.step_s == pytest.approx(full.step_s, rel=0.01)
    # a peak is a maximum over time, not a sum: 1.7% under the full trace here, inside the margin
    assert default.result.peak_bytes == pytest.approx(full.peak_bytes, rel=0.02)
    assert all(isinstance(row.steady, bool) for row in advice.rows), "a row fits: every row is checked"
    for row in advice.rows:
        assert row.fits == (row.steady and row.verdict.fits)

    # where nothing fits by the (5, 6) extrapolation, no 4-block trace is made and nothing is checked;
    # the numbers are those of the search above (in worker processes; this one runs here)
    held = default.result.persistent.params_bytes + default.result.persistent.optimizer_bytes
    cramped = advise(
        shape,
        world_size=8,
        device="h100",
        ac=("full",),
        strategies=("FULL_SHARD",),
        capacity_bytes=held + 1,  # above the bound (shards, optimizer state), below any traced peak
        max_traced_blocks=2,
        offload=("none",),
    )
    assert not any(row.pruned for row in cramped.rows), "the bound alone does not prune FULL_SHARD"
    assert all(row.steady is None and not row.fits for row in cramped.rows)
    again = next(r for r in cramped.rows if r.choice == default.choice)
    assert (again.result.step_s, again.result.peak_bytes) == (default.result.step_s, default.result.peak_bytes)


def _settings(choice: Choice, *, shape: str = "tiny", seq: int = 64, world_size: int = 8) -> dict:
    return run_settings(
        choice,
        shape=model_shape(shape),
        param_dtype="bf16",
        reduce_dtype="fp32",
        batch=1,
        seq=seq,
        profile="h100",
        shard_size=None,
        world_size=world_size,
    )


def test_choice_renders_the_train_command_its_toml_file_and_the_wrap_call(tmp_path):
    choice = Choice(strategy=ShardingStrategy.FULL_SHARD, ac="full", tp=2, plan="blocks", prefetch_depth=2)
    settings = _settings(choice)
    command = train_command(settings)
    assert command.startswith("simplefsdp train --shape tiny ")
    config = parse_args(shlex.split(command)[2:])  # the train command takes it as it is
    from_file = parse_args(["--config", str(write_toml(settings, tmp_path / "advised.toml"))])
    for run in (config, from_file):
        assert {key: getattr(run, key) for key in settings} == settings
    assert (config.shape, config.strategy, config.tp, config.activation_checkpoint) == ("tiny", "FULL_SHARD", 2, "full")
    assert (config.bucket_plan, config.prefetch_depth, config.nproc) == ("blocks", 2, 8)
    assert (config.param_dtype, config.reduce_dtype, config.batch_per_rank, config.seq_len) == ("bf16", "fp32", 1, 64)
    assert (config.dim, config.n_layers) == (model_shape("tiny").args.dim, model_shape("tiny").args.n_layers)
    code = choice.wrap_call(param_dtype="bf16", reduce_dtype="fp32", profile="h100", shard_size=None)
    assert 'parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))' in code
    assert 'simplefsdp.checkpoint_blocks(model, policy="full")' in code
    assert "ReorderConfig(prefetch_depth=2)" in code
    compile(code, "<wrap call>", "exec")  # valid Python
    auto = dataclasses.replace(choice, plan="auto", prefetch_depth=None, tp=1, memory_budget=0.25)
    auto_settings = _settings(auto)
    assert (auto_settings["profile"], auto_settings["memory_budget"]) == ("h100", "0.25")
    assert parse_args(shlex.split(train_command(auto_settings))[2:]).memory_budget == "0.25"
    assert 'BucketConfig(plan="auto", device="h100", memory_budget=0.25)' in auto.wrap_call(
        param_dtype="bf16", reduce_dtype="fp32", profile="h100", shard_size=None
    )
    for tier, policy in (("optimizer", "OffloadPolicy(parameters=False)"), ("all", "OffloadPolicy()")):
        offloaded = dataclasses.replace(choice, offload=tier)
        assert parse_args(shlex.split(train_command(_settings(offloaded)))[2:]).offload == tier
        code = offloaded.wrap_call(param_dtype="bf16", reduce_dtype="fp32", profile="h100", shard_size=None)
        assert f"offload=simplefsdp.{policy}," in code
        compile(code, "<wrap call>", "exec")
    assert "offload" not in choice.wrap_call(param_dtype="bf16", reduce_dtype="fp32", profile="h100", shard_size=None)
    assert "gather" not in command
    for block, flags in ((128, "--gather-dtype int8 "), (64, "--gather-dtype int8 --gather-block 64 ")):
        quantized = dataclasses.replace(choice, gather_dtype="int8", gather_block=block)
        line = train_command(_settings(quantized))
        assert flags in line
        parsed = parse_args(shlex.split(line)[2:])
        assert (parsed.gather_dtype, parsed.gather_block) == ("int8", block)
        code = quantized.wrap_call(param_dtype="bf16", reduce_dtype="fp32", profile="h100", shard_size=None)
        assert 'reduce_dtype=torch.float32, gather_dtype="int8"' + ("" if block == 128 else ", gather_block=64") in code
        compile(code, "<wrap call>", "exec")
        assert quantized.label().endswith(
            ", int8 gathers (lossy)" if block == 128 else ", int8 gathers, block 64 (lossy)"
        )
        assert quantized.order() > choice.order(), "a tie goes to the lossless gather"


def test_the_torchrun_line_starts_the_advised_world_and_a_resized_shape_keeps_its_sizes():
    choice = Choice(strategy=ShardingStrategy.SHARD_GRAD_OP, ac="none", tp=1, plan="auto", prefetch_depth=None)
    settings = _settings(choice, shape="llama3-8b", seq=8192, world_size=64)
    line = torchrun_command(settings, world_size=64)
    assert line.startswith("torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d ")
    assert " -m simplefsdp.train --shape llama3-8b --strategy SHARD_GRAD_OP " in line
    assert "--nproc" not in line.split("-m simplefsdp.train", 1)[1], "torchrun starts the ranks"
    assert torchrun_command(settings, world_size=2, config="a.toml") == (
        "torchrun --nnodes 1 --nproc-per-node 2 --standalone -m simplefsdp.train --config a.toml"
    )
    resized = run_settings(
        choice,
        shape=model_shape("llama3-8b").resized(n_layers=4),
        param_dtype="bf16",
        reduce_dtype="fp32",
        batch=1,
        seq=8192,
        profile="h100",
        shard_size=None,
        world_size=64,
    )
    assert resized["n_layers"] == 4
    assert "dim" not in resized
    assert parse_args(shlex.split(train_command(resized))[2:]).n_layers == 4


def test_cli_prints_the_ranking_and_the_winner_and_writes_its_run(capsys, tmp_path):
    argv = ["tiny", "--world", "8", "--device", "h100", "--advise", "--ac", "none", "--device-memory-gib", "1"]
    argv += ["--jobs", "1", "--advise-toml", str(tmp_path / "advised.toml")]  # one trace: no worker processes
    argv += ["--advise-lossy", "none"]  # no int8 alternative: its trace is the slow test's below
    assert cli.main([*argv, "--strategy", "FULL_SHARD", "--offload", "none"]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "6 configurations, 1 traced" in out, "--strategy and --ac restrict the search"
    assert "SHARD_GRAD_OP" not in out
    assert "advise: tiny at world 8 on h100" in out
    assert "run: " in out
    command = next(line for line in captured.out.splitlines() if line.startswith("simplefsdp train "))
    assert command.startswith("simplefsdp train --shape tiny --strategy FULL_SHARD ")
    assert parse_args(shlex.split(command)[2:]) == parse_args(["--config", str(tmp_path / "advised.toml")])
    assert f"torchrun --nnodes 1 --nproc-per-node 8 --standalone -m simplefsdp.train --config {tmp_path}" in out
    assert "simplefsdp.wrap(" in out
    assert "built-in 'h100' profile (datasheet numbers" in out
    progress = captured.err.splitlines()  # not a terminal: a line per round and task of the search
    assert progress[0].startswith("advise: [1/1] sharded FULL_SHARD, AC none, TP 1")
    assert progress[1].startswith("advise: 1 strategy x AC x TP combinations: 0 pruned by the memory bound, 1 to")
    assert progress[2].startswith("advise: [1/1] traced FULL_SHARD, AC none, TP 1")


_ONE_CONFIGURATION = [
    "tiny",
    "--world",
    "8",
    "--device",
    "h100",
    "--advise",
    "--ac",
    "none",
    "--strategy",
    "FULL_SHARD",
]
_ONE_CONFIGURATION += ["--offload", "none", "--device-memory-gib", "1", "--jobs", "1"]
_PLACE = ("strategy", "ac", "tp", "plan", "prefetch_depth", "memory_budget", "offload")


def _train_commands(out: str) -> list:
    return [parse_args(shlex.split(line)[2:]) for line in out.splitlines() if line.startswith("simplefsdp train ")]


@pytest.mark.slow
def test_the_advice_stays_lossless_and_prices_the_winner_with_int8_gathers_beside_it(capsys, tmp_path):
    """[Note: lossy gathers, on request]: by default no row of the search gathers quantized; the
    winner's configuration, traced once more with int8 gathers, is shown apart with its command (the
    winner's with --gather-dtype int8), and moves fewer bytes on the wire, so less waits on them."""
    assert cli.main([*_ONE_CONFIGURATION, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "advice.json").read_text())
    assert {row["gather_dtype"] for row in data["rows"]} == {None}
    winner, lossy = data["rows"][0], data["lossy_alternative"]
    assert lossy["gather_dtype"] == "int8"
    assert [lossy[k] for k in _PLACE] == [winner[k] for k in _PLACE]
    assert lossy["exposed_s"] < winner["exposed_s"]
    out = " ".join(captured.out.split())
    assert "gather" not in out.split("run: ")[0], "no gather column: the search had none"
    assert "lossy alternative (the model computes with rounded weights): FULL_SHARD, AC none, TP 1, " in out
    advised, alternative = _train_commands(captured.out)
    assert alternative == dataclasses.replace(advised, gather_dtype="int8")
    progress = captured.err.splitlines()
    assert progress[-1].startswith(
        "advise: [1/1] traced FULL_SHARD, AC none, TP 1, int8 gathers (the lossy alternative)"
    )


@pytest.mark.slow
def test_advise_lossy_search_ranks_int8_gathers_with_the_rest(capsys, tmp_path):
    """`--advise-lossy search`: every configuration twice, in the param dtype and with int8 gathers,
    ranked together (a gather column shows which); the advised command gathers as its row does."""
    assert cli.main([*_ONE_CONFIGURATION, "--out", str(tmp_path), "--advise-lossy", "search"]) == 0
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "advice.json").read_text())
    assert data["lossy_alternative"] is None
    places = [(tuple(row[k] for k in _PLACE), row["gather_dtype"]) for row in data["rows"]]
    assert sorted(places, key=str) == sorted(
        [(place, gather) for place, _ in places if _ is None for gather in (None, "int8")], key=str
    )
    fitting = [row for row in data["rows"] if row["fits"]]
    assert [row["tokens_per_s"] for row in fitting] == sorted((row["tokens_per_s"] for row in fitting), reverse=True)
    assert "12 configurations" in " ".join(captured.out.split())
    assert sum(" traced FULL_SHARD, AC none, TP 1" in line for line in captured.err.splitlines()) == 2
    assert "gather" in captured.out.split("run: ")[0], "the column that tells the rows apart"
    (advised,) = _train_commands(captured.out)
    assert advised.gather_dtype == (data["rows"][0]["gather_dtype"] or "none")


def test_where_nothing_fits_on_the_device_it_advises_offloading_with_the_command(capsys):
    """ "tiny" at world 8: 0.155 MiB a device leaves 0.14 MiB with the margin, under every peak without
    offload (the smallest, no passes: 0.143 MiB) and above some with a tier (0.10 to 0.13 MiB): the
    winner offloads, and its command and wrap call say so."""
    argv = ["tiny", "--world", "8", "--device", "h100", "--advise", "--ac", "none", "--strategy", "FULL_SHARD"]
    argv += ["--device-memory-gib", str(0.155 / 1024), "--jobs", "1"]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "18 configurations, 1 traced" in out, "6 pass variants x 3 tiers, priced on one trace"
    assert "run: FULL_SHARD, AC none, TP 1" in out
    assert "offloaded to host memory" in out
    assert "--offload " in out.split("simplefsdp train", 1)[1].split("import torch", 1)[0]
    assert "offload=simplefsdp.OffloadPolicy(" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--offload", "all", "--device", "cpu-gloo", "--device-memory-gib", "1"], "has no host tier"),
        (["--host-memory-gib", "-1"], "--host-memory-gib must be > 0"),
        (["--tp", "1,3"], "tp degrees must be positive integers dividing the world size 8"),
        (["--tp", "two"], "argument --tp: expected an integer or a comma-separated list such as 1,8; got 'two'"),
        (["--device-memory-gib", "0"], "--device-memory-gib must be > 0"),
        (["--device", "cpu-gloo"], "has no memory capacity"),
        (["--device", "tpu-v9"], "unknown"),
        (["--plan", "auto", "--memory-budget", "0.2"], "searches the bucket plans and prefetch depths itself; drop"),
        (["--strategy", "HYBRID_SHARD"], "shard_size must divide the world size 8"),
        (
            ["--advise-toml", "/nonexistent/a.toml"],
            "--advise-toml /nonexistent/a.toml: directory /nonexistent does not",
        ),
    ],
)
def test_cli_bad_input_is_one_line_naming_it(capsys, argv, message):
    assert cli.main(["tiny", "--world", "8", "--advise", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("simplefsdp inspect: error:"), err
    assert err.count("\n") == 1, err
    assert message in err


def test_one_tp_degree_without_advise(capsys):
    assert cli.main(["tiny", "--world", "8", "--tp", "1,2"]) == 2
    assert "--tp takes one degree without --advise" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_w2():
    return advise("tiny", world_size=2, device="cpu-gloo", ac=AC, capacity_bytes=2**30)


def _distinct(rows):
    """One row per (strategy, AC, plan, budget): the variants whose memory differs most."""
    seen, picked = set(), []
    for row in rows:
        key = (row.choice.strategy, row.choice.ac, row.choice.plan, row.choice.memory_budget)
        if key not in seen:
            seen.add(key)
            picked.append(row)
    return picked


@pytest.mark.slow
@pytest.mark.parametrize("index", range(16))
def test_what_it_says_fits_stays_within_its_predicted_memory(ranks2, tiny_w2, index):
    """The advisor's configurations (the winner first), run on 2 gloo ranks: this rank's shards and
    optimizer state plus the most tensor bytes alive in a forward + backward (`LiveTensorBytes`,
    the op-by-op backend) do not exceed the predicted peak by more than the margin -- and are not
    far below it (a check that cannot pass by measuring nothing)."""
    rows = _distinct(tiny_w2.rows)
    assert len(rows) == 16
    assert rows[0] is tiny_w2.winner
    row = rows[index]
    measured = ranks2.run(measured_peak, "tiny", row.choice, device="cpu-gloo")
    predicted = row.verdict.peak_bytes
    for which, nbytes in enumerate(measured):
        assert nbytes <= predicted * (1 + tiny_w2.margin), (row.choice.label(), which, nbytes, predicted)
        assert nbytes >= 0.8 * predicted, (row.choice.label(), which, nbytes, predicted)


@pytest.mark.slow
def test_tensor_parallel_rows_rank_by_throughput_not_step_time(tiny_w8):
    """A TP-2 step that is 40% shorter trains half the sequences per step over the same GPUs: it
    loses to the longer data-parallel step (8 / 1.0 vs 4 / 0.6 sequences per step-time unit)."""
    dp = tiny_w8.winner
    tp_choice = dataclasses.replace(dp.choice, tp=2)
    tp = dataclasses.replace(
        dp, choice=tp_choice, result=dataclasses.replace(dp.result, tp=2, step_s=0.6 * dp.result.step_s)
    )
    assert tp.result.step_s < dp.result.step_s
    assert rank_rows([tp, dp]) == (dp, tp)


@pytest.mark.slow
def test_the_printed_command_trains_the_advised_shape(capsys, tmp_path):
    """The advice for "tiny" at world 2, its `simplefsdp train` line run as printed (2 steps, eager,
    added): the ranks train a model of tiny's parameter count with the advised settings."""
    argv = ["tiny", "--world", "2", "--device", "cpu-gloo", "--device-memory-gib", "1", "--advise"]
    argv += ["--advise-lossy", "none"]  # the winner's run only: no int8 alternative to trace
    assert cli.main([*argv, "--ac", "none", "--strategy", "FULL_SHARD", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    command = shlex.split(next(line for line in out.splitlines() if line.startswith("simplefsdp train ")))
    metrics = tmp_path / "metrics.jsonl"
    extra = ["--steps", "2", "--backend", "eager", "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt")]
    run = [sys.executable, "-m", "simplefsdp.cli", *command[1:], *extra, "--metrics-file", str(metrics)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "simplefsdp train: tiny, 29.54K parameters | mesh dp=2 |" in done.stderr
    summary = next(json.loads(line)["summary"] for line in metrics.read_text().splitlines() if "summary" in line)
    assert summary["parameters"] == sum(p.numel() for p in model_shape("tiny").build().parameters())
    assert summary["end_step"] == 2
    config = parse_args(command[2:])
    assert (config.shape, config.nproc, config.strategy, config.param_dtype) == ("tiny", 2, "FULL_SHARD", "bf16")
