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

Wake-up and drift: the points `(idle seconds, extra seconds)` (the idle stretch is compute) are
fitted to `extra = wake_s * (1 - exp(-idle / tau)) + drift * idle` ([Note: what a training step
adds] in `passes/cost.py`): for each `tau` of a geometric grid from 0.1 ms to 100 ms the best
`wake_s, drift >= 0` is a linear least squares (a term that would go negative is dropped and the
other refitted alone), and the triple with the smallest squared error wins (deterministic; noise
around zero fits no extra at all). The longest idle stretch measured bounds the drift's charge
(`DeviceProfile.drift_span_s`): the line is not extrapolated past its data.

Launch: per kind, `seconds + bytes * seconds_per_byte` through the `(full buffer bytes, seconds)`
points by `fit_launch` (relative error, both terms >= 0; times that do not grow fit a constant).
Copy-op calls: per op, `seconds + members * seconds_per_tensor` through the `(member tensors,
seconds)` points, by the same `fit_launch`.

Step probe ([Note: what a collective costs a step] in `step_probe.py`): `measured - predicted =
outside + a * collectives + b * exposed waits + c * hidden collectives` by least squares through
the probe's steps (five plans), every term >= 0 -- what each collective, each wait with no compute
since its launch, and each collective with compute between its launch and its wait, cost a real
compiled step beyond what the rest of the profile charges. Every collective is exposed or hidden,
so `b` and `c` are one signed term: where an exposed wait costs more than a hidden collective the
fit is `a, b`, where less (a collective run behind compute costs more: [Note: what a training step
adds] in `passes/cost.py`) it is `a, c`; a candidate with a term that would go negative is dropped,
and each term alone is weighed too. Plans that cannot tell collectives from waits apart (two plans,
or the exposed waits a fixed share of the collectives) charge it all per collective. No probe, no
charge.

Compute ([Note: compute as compiled] in `step_probe.py`): `compute_scale = measured / roofline`
seconds of the probe's compiled forward and backward; not probed (a GPU), 1.

Host tier (beside a GPU only): `host_link_bytes_per_s` is the slower direction of a pinned copy,
`host_memory_bytes_per_s` the bytes a CPU AdamW step reads and writes (7 x 4 per fp32 element) per
second of it -- what `inspect/offload_cost.py` charges the host step at. A CPU has none: there the
host is the device, and offload moves nothing.

Optimizer: `seconds = tensors * tensor_s + tensors * elements * element_s` through the measured
shapes (least squares over them; two shapes: the exact solution), each term clamped at zero.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from simplefsdp.gloo import is_gloo
from simplefsdp.passes.cost import DeviceProfile

if TYPE_CHECKING:  # timings.py uses the fit to decide when to time again
    from simplefsdp.calibrate.timings import Measurements

__all__ = [
    "compute_scale",
    "fit_alpha_beta",
    "fit_launch",
    "fit_optimizer",
    "fit_step_probe",
    "fit_wake",
    "overlap_share",
    "profile_from",
]

_TAUS = tuple(1e-4 * 10 ** (i / 16) for i in range(49))  # 0.1 ms .. 100 ms


def _weighted_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points` `(x, t)`, each weighted by
    `1 / t^2` (relative error); slope 0 where every x is the same."""
    weights = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    total = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / total
    mean_t = sum(w * t for w, (_, t) in zip(weights, points, strict=True)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True))
    if not spread:
        return mean_t, 0.0
    slope = sum(w * (x - mean_x) * (t - mean_t) for w, (x, t) in zip(weights, points, strict=True)) / spread
    return mean_t - slope * mean_x, slope


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of `t = alpha + x / bandwidth` through `points` `(x, t)`."""
    if len(points) < 2:
        raise ValueError(f"need at least two sizes to fit latency and bandwidth, got {len(points)}")
    alpha, slope = _weighted_line(points)
    if alpha < 0:  # pin the intercept at the smallest message's time, refit the slope through it
        x0, t0 = min(points)
        alpha = t0
        rest = [(x - x0, t - t0) for x, t in points if x > x0]
        slope = sum(x * t for x, t in rest) / sum(x * x for x, _ in rest)
    if slope <= 0:
        raise ValueError(f"the times do not grow with the size: {points}")
    return alpha, 1.0 / slope


def fit_launch(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds, seconds per byte) of `t = seconds + bytes * per_byte` through `points` `(bytes, t)`
    (or any other size: the copy-op calls fit seconds per member tensor the same way),
    both >= 0: the relative-error line of `fit_alpha_beta`, except that times which do not grow
    with the size fit a constant (their weighted mean), not an error -- an all-gather's launch costs
    about the same at every size -- and a line through a negative intercept is refitted through 0."""
    if not points:
        return 0.0, 0.0
    intercept, slope = _weighted_line(points)
    if slope <= 0:
        return max(0.0, _weighted_line([(0.0, t) for _, t in points])[0]), 0.0
    if intercept < 0:
        weights = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
        rows = list(zip(weights, points, strict=True))
        return 0.0, sum(w * x * t for w, (x, t) in rows) / sum(w * x * x for w, (x, _) in rows)
    return intercept, slope


def overlap_share(compute_s: float, comm_s: float, both_s: float) -> float:
    """See the module docstring."""
    return min(1.0, max(0.0, (compute_s + comm_s - both_s) / min(compute_s, comm_s)))


def _nonnegative_pair(f: list[float], g: list[float], y: list[float]) -> tuple[float, float]:
    """(a, b) >= 0 minimising the squared error of `a * f + b * g` against `y`."""
    ff, gg, fg = sum(x * x for x in f), sum(x * x for x in g), sum(x * z for x, z in zip(f, g, strict=True))
    fy, gy = sum(x * t for x, t in zip(f, y, strict=True)), sum(x * t for x, t in zip(g, y, strict=True))
    det = ff * gg - fg * fg
    if det > 0:
        a, b = (fy * gg - gy * fg) / det, (ff * gy - fg * fy) / det
        if a >= 0 and b >= 0:
            return a, b

    def error(a: float, b: float) -> float:
        return sum((a * x + b * z - t) ** 2 for x, z, t in zip(f, g, y, strict=True))

    alone = [(max(0.0, fy / ff) if ff else 0.0, 0.0), (0.0, max(0.0, gy / gg) if gg else 0.0)]
    return min(alone, key=lambda pair: error(*pair))


def fit_wake(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(wake_s, tau_s, drift) through `points` `(idle seconds, extra seconds)`; see the module docstring."""
    if not points:
        return 0.0, 1e-3, 0.0
    extras = [e for _, e in points]
    idles = [idle for idle, _ in points]
    best = None
    for tau in _TAUS:
        shape = [-math.expm1(-idle / tau) for idle in idles]
        wake, drift = _nonnegative_pair(shape, idles, extras)
        error = sum((wake * f + drift * i - e) ** 2 for f, i, e in zip(shape, idles, extras, strict=True))
        if best is None or error < best[0] - 1e-30:
            best = (error, wake, tau, drift)
    return best[1], best[2], best[3]


def fit_optimizer(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(seconds per tensor, seconds per element) through `points` `(tensors, elements each, seconds)`."""
    if len(points) < 2:
        raise ValueError(f"need at least two shapes to fit an optimizer's cost, got {len(points)}")
    rows = [(float(n), float(n * e), t) for n, e, t in points]
    a11 = sum(x * x for x, _, _ in rows)
    a12 = sum(x * y for x, y, _ in rows)
    a22 = sum(y * y for _, y, _ in rows)
    b1 = sum(x * t for x, _, t in rows)
    b2 = sum(y * t for _, y, t in rows)
    det = a11 * a22 - a12 * a12
    if det <= 0:
        raise ValueError(f"the optimizer shapes must differ in elements per tensor: {points}")
    per_tensor, per_element = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if per_tensor < 0:  # all of it per element
        return 0.0, b2 / a22
    if per_element < 0:
        return b1 / a11, 0.0
    return per_tensor, per_element


def _slope(xs: list[float], rs: list[float]) -> float:
    """The least-squares slope of `rs` over `xs` with an intercept, clamped at 0 (0 if `xs` is constant)."""
    mean_x, mean_r = sum(xs) / len(xs), sum(rs) / len(rs)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    return max(0.0, sum((x - mean_x) * (r - mean_r) for x, r in zip(xs, rs, strict=True)) / spread)


def _slopes(x: list[float], y: list[float], rs: list[float]) -> tuple[float, float] | None:
    """The least-squares slopes of `rs` over `x` and `y` together, with an intercept; None where the
    two do not separate (one a constant or an affine function of the other)."""
    cx, cy, cr = ([v - sum(vs) / len(vs) for v in vs] for vs in (x, y, rs))
    s_xx, s_yy = sum(v * v for v in cx), sum(v * v for v in cy)
    s_xy = sum(u * v for u, v in zip(cx, cy, strict=True))
    det = s_xx * s_yy - s_xy * s_xy
    if not det > 1e-9 * max(s_xx * s_yy, 1.0):
        return None
    s_xr = sum(u * v for u, v in zip(cx, cr, strict=True))
    s_yr = sum(u * v for u, v in zip(cy, cr, strict=True))
    return (s_yy * s_xr - s_xy * s_yr) / det, (s_xx * s_yr - s_xy * s_xr) / det


def fit_step_probe(points: list[tuple[int, int, float, float]]) -> tuple[float, float, float]:
    """(seconds per collective, per exposed wait, per hidden collective) through `points`
    `(collectives, of which exposed, predicted s, measured s)`: `measured - predicted = outside + a *
    collectives + b * exposed + c * hidden` (hidden = collectives - exposed) by least squares, every
    term >= 0 and at most one of `b`, `c` non-zero (the two are one signed quantity: see the module
    docstring). Candidates: `a` with `b`, `a` with `c`, each term alone, none; one with a term that
    would go negative is dropped, and of the rest the smallest squared error wins, the first in that
    order on a tie. (0, 0, 0) without two plans that differ."""
    if len(points) < 2:
        return 0.0, 0.0, 0.0
    ns = [float(n) for n, _, _, _ in points]
    es = [float(e) for _, e, _, _ in points]
    hs = [n - e for n, e in zip(ns, es, strict=True)]
    rs = [m - p for _, _, p, m in points]

    def error(a: float, b: float, c: float) -> float:
        left = [r - a * n - b * e - c * h for n, e, h, r in zip(ns, es, hs, rs, strict=True)]
        mean = sum(left) / len(left)
        return sum((x - mean) ** 2 for x in left)

    fits = []
    for second, place in ((es, 1), (hs, 2)):  # both at once where the plans separate them
        both = _slopes(ns, second, rs)
        if both is not None and min(both) >= 0:
            fit = [both[0], 0.0, 0.0]
            fit[place] = both[1]
            fits.append(tuple(fit))
    fits += [(_slope(ns, rs), 0.0, 0.0), (0.0, _slope(es, rs), 0.0), (0.0, 0.0, _slope(hs, rs)), (0.0, 0.0, 0.0)]
    least = min(error(*fit) for fit in fits)
    return next(fit for fit in fits if error(*fit) <= least * (1 + 1e-9) + 1e-18)


def compute_scale(probe: tuple[float, float] | None) -> float:
    """Wall seconds per roofline second of `probe` `(roofline seconds, measured seconds)`; see the
    module docstring."""
    if probe is None:
        return 1.0
    roofline, measured = probe
    if not roofline > 0 or not measured > 0:
        raise ValueError(f"compiled compute: roofline {roofline} s and measured {measured} s must both be > 0")
    return measured / roofline


def profile_from(measured: Measurements, *, name: str) -> DeviceProfile:
    """The profile the measurements fit."""
    world = measured.world_size
    fits = {}
    for kind, points in measured.collectives.items():
        factor = 2.0 if kind == "all_reduce" else 1.0
        try:
            fits[kind] = fit_alpha_beta([(factor * (world - 1) / world * size, t) for size, t in points])
        except ValueError as error:
            raise ValueError(f"{kind}: {error}; was the machine busy? calibrate again on a quieter one") from None
    wake_s, wake_tau_s, drift = fit_wake(measured.wake)
    per_collective, per_exposed_wait, per_hidden = fit_step_probe(measured.step_probe)
    return DeviceProfile(
        name=name,
        backend="gloo" if is_gloo(measured.backend) else measured.backend,
        latency_s=fits["all_gather"][0],
        bus_bytes_per_s=fits["all_gather"][1],
        flops_per_s=2 * measured.matmul_n**3 / measured.matmul_s,
        memory_bytes_per_s=measured.copy_bytes / measured.copy_s,
        overlap=overlap_share(measured.overlap_compute_s, measured.overlap_comm_s, measured.overlap_both_s),
        collectives=tuple((kind, alpha, bandwidth) for kind, (alpha, bandwidth) in sorted(fits.items())),
        wake_s=wake_s,
        wake_tau_s=wake_tau_s,
        drift=drift,
        drift_span_s=max((idle for idle, _ in measured.wake), default=None),
        optimizers=tuple((opt, *fit_optimizer(points)) for opt, points in sorted(measured.optimizers.items())),
        staging=tuple(sorted(measured.staging.items())),
        launch=tuple(
            (kind, *fit_launch([(float(b), t) for b, t in points]))
            for kind, points in sorted(measured.launches.items())
        ),
        copy_ops=tuple(
            (op, *fit_launch([(float(members), t) for members, t in points]))
            for op, points in sorted(measured.copy_calls.items())
        ),
        capacity_bytes=measured.capacity_bytes,
        step_collective_s=per_collective,
        step_exposed_wait_s=per_exposed_wait,
        step_hidden_s=per_hidden,
        compute_scale=compute_scale(measured.compute_probe),
        **_host_tier(measured),
    )


# AdamW over fp32: reads master, gradient and its two moments, writes master and moments
_ADAMW_BYTES_PER_ELEMENT = 7 * 4


def _host_tier(measured: Measurements) -> dict:
    """The profile's host tier from what was measured beside a GPU; none measured, none given."""
    if measured.host_copy is None or measured.host_adamw is None:
        return {}
    nbytes, to_device_s, to_host_s = measured.host_copy
    elements, step_s = measured.host_adamw
    return {
        "host_link_bytes_per_s": nbytes / max(to_device_s, to_host_s),
        "host_memory_bytes_per_s": _ADAMW_BYTES_PER_ELEMENT * elements / step_s,
        "host_capacity_bytes": measured.host_capacity_bytes,
    }
