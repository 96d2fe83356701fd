"""`inspect_model`: capture a wrapped model's step and derive the bucket table, schedule and memory."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx

from simplefsdp.inspect.buckets import BucketRow, bucket_table, module_summary
from simplefsdp.inspect.capture import StepCapture, capture_step, default_loss
from simplefsdp.inspect.memory import MemoryEstimate, estimate_memory
from simplefsdp.inspect.schedule import StepSchedule, simulate_step
from simplefsdp.inspect.timeline import save_html, save_png
from simplefsdp.passes import cost
from simplefsdp.passes.backend import simulating

__all__ = ["Report", "analyse", "builtin_profile_note", "inspect_model", "resolve_profile"]


def resolve_profile(device: str | cost.DeviceProfile) -> cost.DeviceProfile:
    """A profile object as is, the named one of `cost.PROFILES`, or the one in a profile file."""
    return device if isinstance(device, cost.DeviceProfile) else cost.profile(device)


def builtin_profile_note(profile: cost.DeviceProfile) -> str | None:
    """A warning when `profile` is one of the built-in ones (datasheet numbers, not a measurement)."""
    if profile != cost.PROFILES.get(profile.name):
        return None
    return (
        f"predictions use the built-in {profile.name!r} profile (datasheet numbers, not measured on your "
        "machines); `simplefsdp calibrate` on the target measures one"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    capture: StepCapture
    buckets: list[BucketRow]
    schedule: StepSchedule
    memory: MemoryEstimate

    def graph_text(self, phase: str) -> str:
        """The post-pass FX graph of `phase` ("forward" / "backward") as readable Python."""
        graph = getattr(self.capture, phase)
        return fx.GraphModule(torch.nn.Module(), graph).print_readable(print_output=False)

    def summary(self) -> dict[str, Any]:
        """The headline numbers, JSON-ready."""
        return {
            "profile": self.schedule.device.name,
            "world_size": self.capture.world_size,
            "step_ms": self.schedule.step_s * 1e3,
            "exposed_comm_pct": self.schedule.exposed_pct,
            "peak_memory_bytes_per_rank": self.memory.peak_bytes,
            "collectives": len(self.buckets),
        }

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        """Write graphs, inductor code (if captured), the tables as JSON and both timeline pictures."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        for phase in ("forward", "backward"):
            written[f"{phase}_graph"] = out / f"{phase}_graph.py"
            written[f"{phase}_graph"].write_text(self.graph_text(phase))
            code = getattr(self.capture, f"{phase}_code")
            if code is not None:
                written[f"{phase}_code"] = out / f"{phase}_inductor_code.py"
                written[f"{phase}_code"].write_text(code)
        tables = {
            "summary": self.summary(),
            "buckets": [
                {**dataclasses.asdict(row), "dtype": str(row.dtype), "modules": module_summary(row.modules)}
                for row in self.buckets
            ],
            "schedule": [{**dataclasses.asdict(event), "status": event.status} for event in self.schedule.comm],
            "memory": dataclasses.asdict(self.memory) | {"peak_bytes": self.memory.peak_bytes},
        }
        written["tables"] = out / "inspect.json"
        written["tables"].write_text(json.dumps(tables, indent=1, default=str))
        written["timeline_png"] = save_png(self.schedule, out / "timeline.png")
        written["timeline_html"] = save_html(self.schedule, out / "timeline.html")
        return written


def analyse(
    capture: StepCapture, *, device: cost.DeviceProfile, optimizer: str = "adamw", buckets: bool = True
) -> Report:
    """The bucket table (left empty with `buckets=False`), schedule and memory of a captured step
    (its post-pass graphs) on `device`."""
    return Report(
        capture=capture,
        buckets=bucket_table(capture) if buckets else [],
        schedule=simulate_step(
            capture.forward, capture.backward, device=device, model=capture.model, optimizer=optimizer
        ),
        memory=estimate_memory(capture, optimizer=optimizer, staging=dict(device.staging)),
    )


def inspect_model(
    model: torch.nn.Module,
    example_input: Any,
    *,
    device: str | cost.DeviceProfile = "h100",
    optimizer: str = "adamw",
    code: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
) -> Report:
    """Capture one training step of `model` (wrapped by `simplefsdp.wrap`) on `example_input` and
    analyse it for the device profile `device` (see `capture_step` for `code` and `loss_fn`).

    Runs under whatever process group the model was wrapped on (the fake one for a dry run: the pass
    then issues collectives as on the backend the profile describes, see `passes/backend.py`)."""
    profile = resolve_profile(device)
    with simulating(profile.backend):
        captured = capture_step(model, example_input, loss_fn=loss_fn, code=code)
    return analyse(captured, device=profile, optimizer=optimizer)
