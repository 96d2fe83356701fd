"""Validate `simplefsdp inspect`'s dry run: predicted vs measured step time on 2 gloo CPU ranks.

    python bench/inspect_validate.py            # ~5-10 minutes on 2 cores

1. Calibrate a device profile on this machine inside the two ranks (one thread each, as they
   train), with `simplefsdp calibrate`'s own measurements (`simplefsdp.calibrate.measure`).
2. For each configuration: measure the median step (forward + backward + SGD step) of a wrapped,
   `torch.compile`d (inductor) Llama-style model, FULL_SHARD fp32; then predict the same step with
   `dry_run(..., world_size=2, device=<calibrated profile>)` in this (parent) process, on meta.
3. Print the table: measured, predicted, error per configuration.

The dry run costs the *unfused* post-grad graph op by op with a roofline; inductor fuses
pointwise ops and gloo's threads share the 2 cores with compute, so errors here are expected to be
large-ish: they say how far to trust the model on this machine, not on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import spawn

import simplefsdp
from simplefsdp.calibrate import measure, profile_from
from simplefsdp.inspect import dry_run
from simplefsdp.inspect.shapes import ModelShape
from simplefsdp.models import Transformer, TransformerArgs
from simplefsdp.passes.cost import DeviceProfile

_SMALL = TransformerArgs(vocab_size=1024, dim=256, n_layers=4, n_heads=8, ffn_dim=688)
_MEDIUM = TransformerArgs(vocab_size=2048, dim=512, n_layers=4, n_heads=8, ffn_dim=1376, max_seq_len=128)
_WIDE = TransformerArgs(vocab_size=2048, dim=1024, n_layers=2, n_heads=16, ffn_dim=2752, max_seq_len=128)
CONFIGS = {  # name: (model, batch, sequence, passes on)
    "d256 L4 b2x64, passes": (_SMALL, 2, 64, True),
    "d256 L4 b2x64, no passes": (_SMALL, 2, 64, False),
    "d512 L4 b4x128, passes": (_MEDIUM, 4, 128, True),
    "d512 L4 b4x128, no passes": (_MEDIUM, 4, 128, False),
    "d1024 L2 b2x128, passes": (_WIDE, 2, 128, True),
}


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(name: str, steps: int) -> float:
    args, batch, seq, passes = CONFIGS[name]
    torch.manual_seed(0)
    model = simplefsdp.wrap(Transformer(args), passes=simplefsdp.PassConfig() if passes else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))

    def step() -> None:
        logits = compiled(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile + warm up
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, steps: int, results: dict) -> None:
    torch.set_num_threads(1)
    calibration = measure(device=torch.device("cpu"))
    measured = {name: _measure(name, steps) for name in CONFIGS}
    if rank == 0:
        results.update(calibration=calibration, measured=measured)


def _predict(name: str, profile: DeviceProfile) -> float:
    args, batch, seq, passes = CONFIGS[name]
    shape = ModelShape(
        name=name, args=dataclasses.replace(args, max_seq_len=max(seq, args.max_seq_len)), batch=batch, seq=seq
    )
    result = dry_run(
        shape,
        world_size=2,
        device=profile,
        mp_policy=simplefsdp.MixedPrecisionPolicy(),
        passes=simplefsdp.PassConfig() if passes else None,
        optimizer="sgd",
    )
    return result.step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    results = spawn(_worker, args.steps, world=2)
    profile = profile_from(results["calibration"], name="cpu-calibrated")
    print(f"calibrated profile: {profile}")
    print("\n| configuration | measured (median) | predicted | error |")
    print("|---|---|---|---|")
    for name, measured in results["measured"].items():
        predicted = _predict(name, profile)
        error = 100 * (predicted - measured) / measured
        print(f"| {name} | {measured * 1e3:.1f} ms | {predicted * 1e3:.1f} ms | {error:+.0f}% |")


if __name__ == "__main__":
    main()
