"""Turn `Measurements` into a `DeviceProfile`: least-squares alpha-beta fits and the overlap share.

For each kind of collective the points `(full buffer bytes, seconds)` are fitted to the cost model's
own formula, `t = alpha + factor * (world - 1) / world * bytes / bandwidth` (`passes/cost.py`), by
least squares on the *relative* error in `(x, t)` with `x = factor * (world - 1) / world * bytes`
(each point weighted by `1 / t^2`, so a 4 KiB message counts as much as a 64 MiB one: buckets span
that range); a negative intercept is replaced by the smallest size's time, with the slope refitted
through it. The profile's headline `latency_s` and `bus_bytes_per_s` are the
all-gather's (the collective FSDP issues most).

Overlap share: with `c` the compute loop alone, `m` the collective alone and `b` both at once,
`(c + m - b) / min(c, m)` of the shorter one ran in parallel with the other (1: fully hidden, 0: the
two took as long as one after the other), clamped to [0, 1].
"""

from __future__ import annotations

from simplefsdp.calibrate.timings import Measurements
from simplefsdp.passes.cost import DeviceProfile

__all__ = ["fit_alpha_beta", "overlap_share", "profile_from"]


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of `t = alpha + x / bandwidth` through `points` `(x, t)`."""
    if len(points) < 2:
        raise ValueError(f"need at least two sizes to fit latency and bandwidth, got {len(points)}")
    weights = [1.0 / t**2 for _, t in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / total
    mean_t = sum(w * t for w, (_, t) in zip(weights, points, strict=True)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True))
    slope = sum(w * (x - mean_x) * (t - mean_t) for w, (x, t) in zip(weights, points, strict=True)) / spread
    alpha = mean_t - slope * mean_x
    if alpha < 0:  # pin the intercept at the smallest message's time, refit the slope through it
        x0, t0 = min(points)
        alpha = t0
        rest = [(x - x0, t - t0) for x, t in points if x > x0]
        slope = sum(x * t for x, t in rest) / sum(x * x for x, _ in rest)
    if slope <= 0:
        raise ValueError(f"the times do not grow with the size: {points}")
    return alpha, 1.0 / slope


def overlap_share(compute_s: float, comm_s: float, both_s: float) -> float:
    """See the module docstring."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


def profile_from(measured: Measurements, *, name: str) -> DeviceProfile:
    """The profile the measurements fit."""
    world = measured.world_size
    fits = {}
    for kind, points in measured.collectives.items():
        factor = 2.0 if kind == "all_reduce" else 1.0
        fits[kind] = fit_alpha_beta([(factor * (world - 1) / world * size, t) for size, t in points])
    return DeviceProfile(
        name=name,
        latency_s=fits["all_gather"][0],
        bus_bytes_per_s=fits["all_gather"][1],
        flops_per_s=2 * measured.matmul_n**3 / measured.matmul_s,
        memory_bytes_per_s=measured.copy_bytes / measured.copy_s,
        overlap=overlap_share(measured.overlap_compute_s, measured.overlap_comm_s, measured.overlap_both_s),
        collectives=tuple((kind, alpha, bandwidth) for kind, (alpha, bandwidth) in sorted(fits.items())),
    )
