"""`simplefsdp calibrate`: the fits on known numbers, profile files, and a quick run on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from simplefsdp.calibrate import calibrate, timings
from simplefsdp.calibrate import cli as calibrate_cli
from simplefsdp.calibrate import run as calibrate_run
from simplefsdp.calibrate.fit import (
    compute_scale,
    fit_alpha_beta,
    fit_launch,
    fit_optimizer,
    fit_step_probe,
    fit_wake,
    overlap_share,
    profile_from,
)
from simplefsdp.passes import cost
from tests._tiers import fast_first


def test_fit_recovers_latency_and_bandwidth():
    alpha, bandwidth = 50e-6, 2e9
    points = [(x, alpha + x / bandwidth) for x in (4e3, 64e3, 1e6, 16e6)]
    got_alpha, got_bandwidth = fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-9)


def test_fit_keeps_latency_non_negative_and_rejects_flat_times():
    alpha, bandwidth = fit_alpha_beta([(1e3, 1e-6), (1e6, 1e-3), (2e6, 2.1e-3)])  # a line through < 0
    assert alpha >= 0
    assert bandwidth > 0
    with pytest.raises(ValueError, match="do not grow with the size"):
        fit_alpha_beta([(1e3, 1e-3), (1e6, 1e-3)])
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_alpha_beta([(1e3, 1e-3)])


def test_overlap_share():
    assert overlap_share(compute_s=1.0, comm_s=1.0, both_s=1.0) == 1.0, "fully hidden"
    assert overlap_share(compute_s=1.0, comm_s=1.0, both_s=2.0) == 0.0, "one after the other"
    assert overlap_share(compute_s=2.0, comm_s=1.0, both_s=2.5) == 0.5
    assert overlap_share(compute_s=1.0, comm_s=1.0, both_s=2.5) == 0.0, "clamped"


def test_profile_file_errors_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"profile file '.*nope\.json' does not exist"):
        cost.profile(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "latency_s": 1e-5}))
    with pytest.raises(ValueError, match=r"bad\.json' is not a valid profile: missing keys \['bus_bytes_per_s'"):
        cost.profile(str(bad))
    bad.write_text(json.dumps({"name": "x", "latency_s": 1e-5, "bus_bytes_per_s": 1e9, "flops_per_s": 1e9,
                               "memory_bytes_per_s": 1e9, "overlap": 1.5}))  # fmt: skip
    with pytest.raises(ValueError, match=r"overlap in \[0, 1\]"):
        cost.profile(str(bad))
    with pytest.raises(ValueError, match=r"unknown device profile 'tpu9'; known: .*or a profile \.json file"):
        cost.profile("tpu9")


@pytest.mark.slow
def test_quick_calibration_on_two_ranks_round_trips(tmp_path):
    out = tmp_path / "cpu.json"
    profile = calibrate(out=out, nproc=2, device_type="cpu", quick=True, name="test-cpu")
    assert profile.name == "test-cpu"
    assert profile.backend == "gloo", "simplefsdp's one-worker gloo, recorded as gloo (passes/backend.py)"
    assert cost.profile(str(out)) == profile, "the file loads back as the same profile"
    assert {kind for kind, _, _ in profile.collectives} == set(cost.COLLECTIVE_KINDS)
    assert 0.0 <= profile.overlap <= 1.0
    assert profile.flops_per_s > 1e8, "a CPU does more than this"
    assert profile.memory_bytes_per_s > 1e8
    data = json.loads(out.read_text())
    assert data["measured"]["world_size"] == 2
    assert len(data["measured"]["collectives"]["all_gather"]) >= 3, "the raw points are kept"
    assert {name for name, _, _ in profile.optimizers} == {"adamw", "sgd"}, "both optimizers measured"
    assert all(t >= 0 and e >= 0 for _, t, e in profile.optimizers)
    assert profile.wake_s >= 0
    assert len(data["measured"]["wake"]) == 2, "two idle stretches in quick mode"
    assert set(data["staging"]) == set(cost.COLLECTIVE_KINDS), "staging measured for every kind (Linux)"
    assert {kind for kind, _, _ in profile.launch} == set(cost.COLLECTIVE_KINDS), "launch measured for every kind"
    assert all(seconds >= 0 and per_byte >= 0 for _, seconds, per_byte in profile.launch)
    assert {op for op, _, _ in profile.copy_ops} == set(cost.COPY_OPS), "every copy op's call measured"
    assert all(seconds > 0 and per_tensor >= 0 for _, seconds, per_tensor in profile.copy_ops), "a call costs"
    assert [m for m, _ in data["measured"]["copy_calls"]["all_gather_copy_out"]] == [1, 4, 16]
    big = cost.collective_seconds(profile, kind="reduce_scatter", nbytes=2**24, world=2)
    assert big > cost.collective_seconds(profile, kind="reduce_scatter", nbytes=2**12, world=2)
    probe = data["measured"]["step_probe"]  # [Note: what a collective costs a step]
    assert len(probe) == 5, probe
    (none, none_exposed, _, _), (kept, kept_exposed, _, _), (default, default_exposed, _, _) = probe[:3]
    (small_kept, small_kept_exposed, _, _), (small, small_exposed, _, _) = probe[3:]
    assert none > default == kept, "no passes: more collectives; the default plan has the same buckets reordered"
    assert none_exposed == none, "no passes: each collective waited right after its launch"
    assert kept_exposed == kept, "buckets not reordered: each waited right after its launch"
    assert default_exposed < default, "the default plan runs collectives behind compute"
    assert none >= small == small_kept > default, "small buckets: more collectives than per block"
    assert small_kept_exposed == small_kept, "small buckets not reordered: each waited right after its launch"
    assert small_exposed < small, "small buckets reordered: behind compute"
    assert all(predicted > 0 and measured > 0 for _, _, predicted, measured in probe), probe
    fitted = fit_step_probe([tuple(point) for point in probe])
    assert (profile.step_collective_s, profile.step_exposed_wait_s, profile.step_hidden_s) == fitted
    assert min(fitted[1:]) == 0.0, "exposed waits and hidden collectives: one signed term, at most one priced"
    roofline_s, compute_s = data["measured"]["compute_probe"]  # [Note: compute as compiled]
    assert roofline_s > 0
    assert compute_s > 0
    assert profile.compute_scale == compute_s / roofline_s
    # offload's host tier: measured beside a GPU only; on a CPU the host is the device
    assert (profile.host_link_bytes_per_s, profile.host_memory_bytes_per_s, profile.host_capacity_bytes) == (None,) * 3
    assert data["measured"]["host_copy"] is None


def test_a_host_tier_measured_beside_a_gpu_fits_the_copy_and_step_rates():
    measured = timings.Measurements(
        world_size=2,
        backend="nccl",
        device="a GPU",
        matmul_n=1024,
        matmul_dtype="bfloat16",
        matmul_s=1e-4,
        copy_bytes=2**30,
        copy_s=1e-3,
        collectives={kind: GROWING for kind in cost.COLLECTIVE_KINDS},
        overlap_compute_s=1.0,
        overlap_comm_s=1.0,
        overlap_both_s=1.5,
        host_copy=(2**28, 0.01, 0.0125),
        host_adamw=(2**24, 0.05),
        host_capacity_bytes=2e11,
    )
    profile = profile_from(measured, name="gpu")
    assert profile.host_link_bytes_per_s == 2**28 / 0.0125, "the slower direction"
    assert profile.host_memory_bytes_per_s == 7 * 4 * 2**24 / 0.05, "AdamW's bytes read and written per second"
    assert profile.host_capacity_bytes == 2e11
    assert "host tier" in calibrate_cli._describe(profile)


GROWING = [(4096, 1e-4), (65536, 2e-4), (1 << 20, 1e-3)]


def _measurements(world_size: int = 2) -> timings.Measurements:
    """Made-up measurements a profile can be fitted from (every kind's times grow with the size)."""
    return timings.Measurements(
        world_size=world_size,
        backend="gloo",
        device="cpu",
        matmul_n=64,
        matmul_dtype="float32",
        matmul_s=1e-4,
        copy_bytes=1 << 20,
        copy_s=1e-4,
        collectives={kind: GROWING for kind in ("all_gather", "reduce_scatter", "all_reduce")},
        overlap_compute_s=1e-3,
        overlap_comm_s=1e-3,
        overlap_both_s=1.5e-3,
        optimizers={"adamw": [(4, 16, 1e-4), (1, 1024, 2e-4)]},
    )


def _measured_on_the_group(*, device: torch.device, quick: bool) -> timings.Measurements:
    """Stands in for `timings.measure` (the tests below are about where calibrate runs, not what it
    measures): one all-reduce over the default group, then made-up measurements of its size."""
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    return _measurements(world_size=int(ones.item()))


def _process_state() -> tuple:
    root = logging.getLogger()
    torch_levels = tuple(logging.getLogger(name).level for name in ("torch", "torch._dynamo", "torch._inductor"))
    return (root.level, tuple(root.handlers), torch_levels, tuple(warnings.filters), dist.group.WORLD)


def _calibrate_in_a_script(out: str, torchrun: bool) -> tuple[str | None, bool]:
    """A user's script (a rank of the pool, whose default group it has set up, maybe under torchrun)
    with its own logging and warning filters calls `calibrate()`: (rank 0's profile name, whether
    the group, logging and warning filters are as before)."""
    env = {"RANK": str(dist.get_rank()), "WORLD_SIZE": str(dist.get_world_size()), "LOCAL_RANK": "0"}
    handler, root = logging.NullHandler(), logging.getLogger()
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with (
            warnings.catch_warnings(),
            mock.patch.dict(os.environ, env if torchrun else {}),
            mock.patch.object(calibrate_run, "measure", _measured_on_the_group),
        ):
            warnings.simplefilter("always", UserWarning)
            before = _process_state()
            profile = calibrate(out=out, quick=True, device_type="cpu", name="a script's")
            return (None if profile is None else profile.name), _process_state() == before
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)


@pytest.mark.parametrize("torchrun", fast_first([True, False]))
def test_calibrate_in_a_script_with_a_group_runs_on_it_and_leaves_the_process_as_it_was(ranks2, tmp_path, torchrun):
    """The library function measures on the script's own group (both ranks, collectively) and
    changes neither that group nor the script's logging or warning filters."""
    results = ranks2.run(_calibrate_in_a_script, str(tmp_path / "profile.json"), torchrun)
    assert results == [("a script's", True), (None, True)]
    assert cost.profile(str(tmp_path / "profile.json")).name == "a script's", "rank 0 wrote the file"


def _refuse_to_measure(**kwargs) -> None:
    raise AssertionError("measured before checking where the profile goes")


def test_an_unwritable_out_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibrate_run, "measure", _refuse_to_measure)
    missing = tmp_path / "nonexistent" / "x.json"
    with pytest.raises(ValueError, match=rf"^out {missing}: directory {missing.parent} does not exist$"):
        calibrate(out=missing, quick=True, device_type="cpu")
    assert calibrate_cli.main(["--out", str(missing), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == f"simplefsdp calibrate: error: --out {missing}: directory {missing.parent} does not exist\n"
    assert calibrate_cli.main(["--out", str(tmp_path), "--quick"]) == 2
    assert capsys.readouterr().err.endswith(f"--out {tmp_path}: is a directory, not a file\n")


def test_compute_scale_is_measured_over_roofline_seconds_and_one_when_not_probed():
    """[Note: compute as compiled]: the scale is what the probe's compiled compute took per roofline
    second; a profile measured without the probe (a GPU) charges the roofline; nonsense is refused."""
    assert compute_scale((0.010, 0.0115)) == pytest.approx(1.15)
    assert compute_scale((0.020, 0.010)) == pytest.approx(0.5), "a matmul timed in a slow moment: below 1"
    assert compute_scale(None) == 1.0
    with pytest.raises(ValueError, match=r"compiled compute: roofline 0.0 s and measured 0.01 s must both be > 0"):
        compute_scale((0.0, 0.01))


def test_fit_step_probe_separates_what_every_collective_and_an_exposed_wait_cost():
    """[Note: what a collective costs a step]: the error that grows with the collective count is
    charged per collective, the error that grows with the waits with no compute before them per such
    wait; the part that grows with neither (the model's own overhead) is not charged."""
    per_collective, per_wait, outside = 2e-4, 1.5e-3, 0.02

    def point(n: int, exposed: int, predicted: float, noise: float = 0.0) -> tuple[int, int, float, float]:
        return n, exposed, predicted, predicted + outside + n * per_collective + exposed * per_wait + noise

    plans = [point(116, 116, 0.08), point(15, 15, 0.05), point(15, 2, 0.04)]  # the probe's three plans
    assert fit_step_probe(plans) == pytest.approx((per_collective, per_wait, 0.0), rel=1e-9)
    noisy = [*plans, point(60, 30, 0.06, noise=5e-4)]
    a, b, c = fit_step_probe(noisy)
    assert c == 0.0
    assert a == pytest.approx(per_collective, rel=0.2), "least squares"
    assert b == pytest.approx(per_wait, rel=0.2), "least squares"
    # a term that would go negative is dropped and the other refitted alone
    only_waits = [(n, e, 0.1, 0.1 + outside + e * per_wait - n * 1e-5) for n, e, _, _ in plans]
    a, b, c = fit_step_probe(only_waits)
    assert a == 0.0
    assert b > 0
    assert c == 0.0
    over = [(n, e, 0.1 + 0.001 * n + 0.01 * (n - e), 0.2) for n, e, _, _ in plans]
    assert fit_step_probe(over) == (0.0, 0.0, 0.0), "over-predicted more with more of each: nothing charged"
    two = [point(116, 116, 0.08), point(15, 2, 0.04)]
    assert fit_step_probe(two) == pytest.approx(((101 * per_collective + 114 * per_wait) / 101, 0.0, 0.0)), (
        "two plans cannot separate the terms: all of it per collective"
    )
    assert fit_step_probe([point(27, 3, 0.1)]) == (0.0, 0.0, 0.0), "one plan: no slope"
    # why five plans: 4 ms of noise apart on the two 15-collective plans moves a three-plan fit's
    # per-wait term by 0.3 ms; the small-bucket pair (70 waits apart) holds it within 0.1 ms
    shaken = [point(116, 116, 0.08), point(15, 15, 0.05, noise=-2e-3), point(15, 2, 0.04, noise=2e-3)]
    assert abs(fit_step_probe(shaken)[1] - per_wait) > 2.5e-4
    five = [*shaken, point(74, 74, 0.07), point(74, 4, 0.07)]
    a, b, _ = fit_step_probe(five)
    assert abs(b - per_wait) < 1e-4
    assert abs(a - per_collective) < 1e-4
    assert fit_step_probe([]) == (0.0, 0.0, 0.0), "not probed: no charge"


def test_fit_step_probe_prices_collectives_run_behind_compute_where_they_cost_more():
    """[Note: what a training step adds], the per-hidden-collective term: when the reordered plans run
    slower than the plans that wait each collective at once (one gloo worker thread on 2 cores), the
    fit prices a collective with compute before its wait, not a negative exposed wait; the per-wait
    fit on the same plans would have had to drop that part."""
    per_collective, per_hidden, outside = 4.5e-4, 4e-4, 0.003

    def point(n: int, exposed: int, predicted: float, noise: float = 0.0) -> tuple[int, int, float, float]:
        return n, exposed, predicted, predicted + outside + n * per_collective + (n - exposed) * per_hidden + noise

    five = [point(116, 116, 0.06), point(17, 17, 0.04), point(17, 1, 0.03), point(76, 76, 0.06), point(76, 2, 0.05)]
    assert fit_step_probe(five) == pytest.approx((per_collective, 0.0, per_hidden), rel=1e-9)
    a, b, c = fit_step_probe([*five[:4], point(76, 2, 0.05, noise=2e-3)])
    assert b == 0.0
    assert a == pytest.approx(per_collective, rel=0.2), "least squares"
    assert c == pytest.approx(per_hidden, rel=0.2), "least squares"
    # hidden collectives that cost less than the rest: a per-wait term (the other sign), not a hidden one
    cheaper = [(n, e, p, p + outside + n * per_collective - (n - e) * 1e-4) for n, e, p, _ in five]
    a, b, c = fit_step_probe(cheaper)
    assert c == 0.0
    assert a == pytest.approx(per_collective - 1e-4, rel=1e-9)
    assert b == pytest.approx(1e-4, rel=1e-9)


def test_fit_wake_recovers_a_saturating_curve_with_drift_and_clamps_noise():
    wake, tau, drift = 1e-3, 0.5e-3, 0.25
    idles = (0.25e-3, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)
    points = [(idle, wake * -math.expm1(-idle / tau) + drift * idle) for idle in idles]
    got_wake, got_tau, got_drift = fit_wake(points)
    assert got_tau == pytest.approx(tau, rel=0.08), "the grid has 16 steps per decade"
    assert got_wake == pytest.approx(wake, rel=0.05)
    assert got_drift == pytest.approx(drift, rel=0.05)
    saturating = [(idle, wake * -math.expm1(-idle / tau)) for idle in idles]
    assert fit_wake(saturating)[2] * 8e-3 < 0.02 * wake, "(next to) no drift where the extra saturates"
    assert fit_wake([(1e-3, -1e-5), (4e-3, -2e-5)]) == (0.0, 1e-4, 0.0), "negative extras (noise): no extra"
    assert fit_wake([]) == (0.0, 1e-3, 0.0)


def test_fit_launch_keeps_both_terms_non_negative_and_takes_flat_times_as_a_constant():
    points = [(x, 2e-4 + x * 1e-10) for x in (4e3, 64e3, 1e6, 16e6)]
    assert fit_launch(points) == pytest.approx((2e-4, 1e-10), rel=1e-9)
    flat = [(4e3, 2.3e-4), (1e6, 2.2e-4), (16e6, 2.0e-4)]  # falling with the size: noise, a constant
    seconds, per_byte = fit_launch(flat)
    assert per_byte == 0.0
    assert 2.0e-4 <= seconds <= 2.3e-4
    steep = [(1e3, 1e-6), (1e6, 1e-3), (2e6, 2.1e-3)]  # a line through < 0: through the origin instead
    seconds, per_byte = fit_launch(steep)
    assert seconds == 0.0
    assert per_byte > 0
    assert fit_launch([]) == (0.0, 0.0), "not measured: no launch cost"


def test_fit_optimizer_solves_per_tensor_and_per_element():
    per_tensor, per_element = 2e-4, 3e-9
    points = [(n, e, n * per_tensor + n * e * per_element) for n, e in ((64, 4096), (4, 1 << 20))]
    assert fit_optimizer(points) == pytest.approx((per_tensor, per_element), rel=1e-9)
    assert fit_optimizer([(64, 4096, 1e-3), (4, 1 << 20, 1.0)])[0] == 0.0, "clamped, not negative"
    with pytest.raises(ValueError, match="at least two shapes"):
        fit_optimizer(points[:1])


def _scripted_collective_times(series: list[list[float]]) -> tuple[list[tuple[int, float]], int]:
    """`_collective_times` with this rank's medians scripted: `series[rank][i]` is the i-th timing."""
    import torch.distributed as dist

    scripted = iter(series[dist.get_rank()])
    calls = 0

    def median(fn, device, repeats):
        nonlocal calls
        calls += 1
        return next(scripted)

    plan = timings._Plan(sizes=(1, 2, 3), repeats=1, matmul_n=1, copy_bytes=1, overlap_bytes=1)
    saved, timings._median_s = timings._median_s, median
    try:
        return timings._collective_times("all_gather", torch.device("cpu"), plan), calls
    finally:
        timings._median_s = saved


def test_times_that_do_not_grow_are_taken_again_by_every_rank_alike(ranks2):
    """[Note: timing on a busy machine]: one rank's swamped timings make every rank time again."""
    busy_then_quiet = [[5e-3, 4e-3, 1e-3, 1e-4, 2e-4, 3e-4], [1e-4, 2e-4, 3e-4, 1e-4, 2e-4, 3e-4]]
    results = ranks2.run(_scripted_collective_times, busy_then_quiet)
    assert results[0] == results[1], "the ranks agree on the points"
    points, calls = results[0]
    assert calls == 6, "the three sizes were timed twice"
    assert points == [(1, 1e-4), (2, 2e-4), (3, 3e-4)], "the quiet attempt's times, agreed (the larger)"
    always_busy = [[3e-3, 2e-3, 1e-3] * 3, [1e-4, 2e-4, 3e-4] * 3]
    points, calls = ranks2.run(_scripted_collective_times, always_busy)[1]
    assert calls == 3 * timings._ATTEMPTS, "gives up after the last attempt"
    assert points == [(1, 3e-3), (2, 2e-3), (3, 1e-3)], "and returns what it measured"


def test_a_profile_is_refused_when_a_kinds_times_do_not_grow():
    fine = _measurements()
    flat = [(4096, 3e-3), (1 << 20, 1e-3)]
    measured = dataclasses.replace(fine, collectives={**fine.collectives, "reduce_scatter": flat})
    assert profile_from(fine, name="roofline").compute_scale == 1.0, "no compute probe: the roofline"
    assert profile_from(fine, name="roofline").backend == "gloo"
    assert profile_from(dataclasses.replace(fine, backend="nccl"), name="gpu").backend == "nccl"
    probed = dataclasses.replace(fine, compute_probe=(0.004, 0.005))
    assert profile_from(probed, name="probed").compute_scale == pytest.approx(1.25)
    assert profile_from(fine, name="no wake timing").drift_span_s is None, "nothing measured: no bound"
    woken = dataclasses.replace(fine, wake=[(1e-3, 2e-4), (8e-3, 1.6e-3), (4e-3, 8e-4)])
    assert profile_from(woken, name="woken").drift_span_s == 8e-3, "the longest stretch measured"
    with pytest.raises(ValueError, match=r"reduce_scatter: the times do not grow with the size.*busy"):
        profile_from(measured, name="flat")


def _scripted_paired(rounds: dict[str, list[tuple[float, ...]]]) -> tuple[tuple[float, float, float], list]:
    """`_overlap` and `_wake` (one gap) with the interleaved rounds scripted: what they make of them."""
    calls, real = [], timings._paired_s

    def paired(fns, device, repeats):
        if len(fns) == 1:  # a plain median (`_median_s`): timed for real
            return real(fns, device, repeats)
        calls.append((len(fns), repeats))
        return rounds["overlap" if len(calls) == 1 else "wake"]

    plan = timings._Plan(sizes=(1, 2), repeats=1, matmul_n=8, copy_bytes=1, overlap_bytes=4096, wake_gaps_s=(1e-3,))
    plan = dataclasses.replace(plan, wake_rounds=2, paired_repeats=3)
    timings._paired_s = paired
    try:
        return timings._overlap(torch.device("cpu"), plan), timings._wake(torch.device("cpu"), plan), calls
    finally:
        timings._paired_s = real


def test_overlap_and_wake_take_differences_within_each_round(ranks2):
    """[Note: paired timings]: a round where the host was slow for everything is not read as overlap
    (or as a wake-up); the difference is taken inside each round, then the median."""
    # (compute, comm, both): two quiet rounds where both at once saved 10 ms, one slow round
    overlap_rounds = [(0.030, 0.030, 0.050), (0.060, 0.060, 0.110), (0.031, 0.029, 0.050)]
    # (back to back, compute alone, compute + gather): the gathers cost 1 ms more after compute
    wake_rounds = [(0.002, 0.010, 0.014), (0.004, 0.020, 0.026), (0.002, 0.011, 0.015)]
    rounds = {"overlap": overlap_rounds, "wake": wake_rounds}
    (compute, comm, both), wake, calls = ranks2.run(_scripted_paired, rounds)[0]
    assert calls == [(3, 3), (3, 3)], "three timings interleaved, paired_repeats rounds"
    assert (compute, comm) == pytest.approx((0.031, 0.030))
    assert compute + comm - both == pytest.approx(0.010), "the median of each round's saving"
    assert overlap_share(compute, comm, both) == pytest.approx(0.010 / 0.030)
    ((idle, extra),) = wake
    assert idle == pytest.approx(0.011 / 2), "compute per round (2 gathers per timing)"
    assert extra == pytest.approx(0.002 / 2), "the median of each round's extra, per gather"
