"""Rank functions for `test_checkpoint_ranks.py`: a small wrapped model with a 0-dim parameter,
saved and loaded while one rank alone meets a fault (a file it cannot read, a stale directory listing).

The faults are simulated in the faulty rank's process only (mocks of `open` and `Path.iterdir`),
as on a shared filesystem where one node's view differs: a permission or I/O error on one host,
an NFS directory cache that does not yet show a file another node wrote.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import simplefsdp
from simplefsdp import checkpoint
from simplefsdp.checkpoint.manifest import MANIFEST_NAME
from tests.simplefsdp import _ckpt as ckpt

TIMEOUT = timedelta(seconds=60)  # the checkpoint functions' barrier timeout: a hang fails, never stalls
OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


class Gained(nn.Module):
    """A linear layer scaled by a learned scalar: a 0-dim parameter next to sharded ones."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.gain


def build(optimizer: str = "AdamW") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model wrapped FULL_SHARD over every rank, and its optimizer (state still empty)."""
    torch.manual_seed(0)
    model = simplefsdp.wrap(Gained(), ckpt.mesh("FULL_SHARD"), passes=None)
    return model, OPTIMIZERS[optimizer](model.parameters())


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, *, seed: int) -> None:
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@contextlib.contextmanager
def _unreadable(path: Path) -> Iterator[None]:
    """Opening `path` in this process fails with EACCES; every other file opens as usual."""
    real_open, real_path_open = builtins.open, Path.open

    def refuse(target: Any) -> None:
        if Path(target) == path:
            raise PermissionError(errno.EACCES, f"Permission denied (simulated on rank {dist.get_rank()})", str(path))

    def fake_open(file, *args, **kwargs):
        refuse(file)
        return real_open(file, *args, **kwargs)

    def fake_path_open(self, *args, **kwargs):
        refuse(self)
        return real_path_open(self, *args, **kwargs)

    with mock.patch.object(builtins, "open", fake_open), mock.patch.object(Path, "open", fake_path_open):
        yield


@contextlib.contextmanager
def _stale_listing(name: str) -> Iterator[None]:
    """This process's listings of an unfinished checkpoint (`*.tmp`) lack `name`, as a stale NFS
    directory cache would before it shows a file another node wrote."""
    real_iterdir = Path.iterdir

    def fake_iterdir(self):
        return (p for p in real_iterdir(self) if not (self.name.endswith(".tmp") and p.name == name))

    with mock.patch.object(Path, "iterdir", fake_iterdir):
        yield


def save_with_stale_listing(root: str, *, name: str, rank: int) -> tuple[list[str], list[str], int]:
    """Save step 1 while `rank`'s listing of the directory lacks `name`; then load it, verified.

    Returns (the files the manifest lists, the files in the checkpoint, the step loaded)."""
    model, optimizer = build()
    train_step(model, optimizer, seed=1)
    with _stale_listing(name) if dist.get_rank() == rank else contextlib.nullcontext():
        path = checkpoint.save_checkpoint(root, step=1, model=model, optimizer=optimizer, timeout=TIMEOUT)
    listed = sorted(json.loads((path / MANIFEST_NAME).read_text())["files"])
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST_NAME)
    loaded = checkpoint.load_checkpoint(path, model=model, optimizer=optimizer, fallback=False, timeout=TIMEOUT)
    return listed, on_disk, loaded.step


def save_with_unreadable_file(root: str, *, name: str, rank: int) -> tuple[str, list[str]]:
    """Save step 1, then step 2 while `rank` cannot open `name` of it. Returns the error message
    and the checkpoints then listed (step 2 must not be among them)."""
    model, optimizer = build()
    train_step(model, optimizer, seed=1)
    checkpoint.save_checkpoint(root, step=1, model=model, optimizer=optimizer, timeout=TIMEOUT)
    unfinished = Path(root) / "step_000000002.tmp"
    try:
        with _unreadable(unfinished / name) if dist.get_rank() == rank else contextlib.nullcontext():
            checkpoint.save_checkpoint(root, step=2, model=model, optimizer=optimizer, timeout=TIMEOUT)
    except checkpoint.CheckpointError as err:
        return str(err), [p.name for p in checkpoint.list_checkpoints(root)]
    return "saved", [p.name for p in checkpoint.list_checkpoints(root)]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {fqn: ckpt.full(p) for fqn, p in model.named_parameters()}


def load_with_unreadable_file(root: str, *, name: str, rank: int) -> tuple[int, tuple[str, ...], bool]:
    """Save steps 1 and 2; on `rank` only, `name` of step 2 cannot be opened; load the newest good one.

    Returns (the step loaded, what was skipped, whether the parameters are step 1's)."""
    model, optimizer = build()
    train_step(model, optimizer, seed=1)
    checkpoint.save_checkpoint(root, step=1, model=model, optimizer=optimizer, timeout=TIMEOUT)
    at_step_1 = _params(model)
    train_step(model, optimizer, seed=2)
    newest = checkpoint.save_checkpoint(root, step=2, model=model, optimizer=optimizer, timeout=TIMEOUT)
    fresh, fresh_optimizer = build()
    fault = _unreadable(newest / name) if dist.get_rank() == rank else contextlib.nullcontext()
    with fault:
        loaded = checkpoint.load_checkpoint(root, model=fresh, optimizer=fresh_optimizer, timeout=TIMEOUT)
    restored = _params(fresh)
    return loaded.step, loaded.skipped, all(torch.equal(restored[k], v) for k, v in at_step_1.items())


def _describe(value: Any) -> tuple:
    """What must survive a checkpoint of one optimizer state entry, the value aside."""
    if isinstance(value, DTensor):
        return ("DTensor", value.dtype, tuple(value.shape), tuple(value.placements), value.device)
    if isinstance(value, torch.Tensor):
        return ("Tensor", value.dtype, tuple(value.shape), value.device)
    return (type(value).__name__, value)


def optimizer_state_roundtrip(root: str, *, optimizer: str) -> tuple[dict, dict, list[str]]:
    """Step, save, load into a fresh model and optimizer. Returns each state entry described before
    the save and after the load (by "<fqn>.<name>"), and the entries whose values differ."""
    model, opt = build(optimizer)
    train_step(model, opt, seed=1)
    checkpoint.save_checkpoint(root, step=1, model=model, optimizer=opt, timeout=TIMEOUT)
    fresh, fresh_opt = build(optimizer)
    checkpoint.load_checkpoint(root, model=fresh, optimizer=fresh_opt, timeout=TIMEOUT)
    described, values = [], []
    for m, o in ((model, opt), (fresh, fresh_opt)):
        names = {id(p): fqn for fqn, p in m.named_parameters()}
        state = {f"{names[id(p)]}.{k}": v for p, entries in o.state.items() for k, v in entries.items()}
        described.append({key: _describe(v) for key, v in state.items()})
        values.append({key: ckpt.full(v) if isinstance(v, torch.Tensor) else v for key, v in state.items()})
    before, after = values
    differ = [k for k, v in before.items() if k not in after or not torch.equal(torch.as_tensor(v), after[k])]
    return described[0], described[1], differ


def save_state_unlike_parameter(root: str) -> str:
    """Save with a DTensor optimizer state entry laid out unlike its parameter; the error message."""
    model, optimizer = build()
    train_step(model, optimizer, seed=1)
    weight = dict(model.named_parameters())["linear.weight"]  # the sharded DTensor (the attribute is gathered)
    optimizer.state[weight]["replicated"] = weight.detach().redistribute(placements=[Replicate()])
    try:
        checkpoint.save_checkpoint(root, step=1, model=model, optimizer=optimizer, timeout=TIMEOUT)
    except ValueError as err:
        return str(err)
    return "saved"
