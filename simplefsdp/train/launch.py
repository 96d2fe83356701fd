"""Start the ranks of `simplefsdp train`: the ones torchrun gave, or spawn them here.

    outcome = launch(config)   # rank 0's TrainOutcome

Under torchrun (RANK, WORLD_SIZE and LOCAL_RANK set) this process is one rank: it joins the group
torchrun describes (env:// rendezvous) and trains. Otherwise it spawns `config.nproc` ranks itself
(2 on the CPU, one per GPU), joined through a file in a temporary directory. CUDA ranks use NCCL
and one GPU each (`cuda:LOCAL_RANK`); CPU ranks use gloo.

[Note: compile threads when spawning on the CPU]
Every spawned rank compiles its own graphs; by default inductor starts a pool of compile workers
per process sized to the machine, so N ranks on a small machine fight N pools for its cores.
Spawned CPU ranks get `TORCHINDUCTOR_COMPILE_THREADS=1` and an equal share of the cores for
intra-op threads, unless the environment already sets the variable. Under torchrun the user's
environment is left as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simplefsdp.train.config import ConfigError, TrainConfig, check_world
from simplefsdp.train.loop import TrainOutcome, check_fresh_start, train

__all__ = ["RankFailedError", "launch", "under_torchrun"]

logger = logging.getLogger(__name__)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SPAWN_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


class RankFailedError(RuntimeError):
    """A spawned rank raised; the message holds its error and traceback."""


def under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_ENV)


def _device(config: TrainConfig, local_rank: int) -> torch.device:
    if config.device_type() == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda: no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if rank == 0:
        logging.getLogger("simplefsdp.train").setLevel(logging.INFO)


def _run_rank(config: TrainConfig, local_rank: int, **init: object) -> TrainOutcome:
    device = _device(config, local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **init)
    try:
        check_world(config, dist.get_world_size())
        return train(config, device=device)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, init_file: str, config: TrainConfig, results: mp.Queue) -> None:
    _setup_logging(rank)
    if config.device_type() == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    try:
        outcome = _run_rank(config, rank, init_method=f"file://{init_file}", rank=rank, world_size=world)
    except BaseException as err:
        results.put((rank, err if isinstance(err, ConfigError) else None, traceback.format_exc()))
        raise
    if rank == 0:
        results.put((rank, outcome, None))


@contextlib.contextmanager
def _spawn_env(config: TrainConfig) -> Iterator[None]:
    """See [Note: compile threads when spawning on the CPU]."""
    added = {k: v for k, v in _SPAWN_ENV.items() if k not in os.environ} if config.device_type() == "cpu" else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _first_failure(results: mp.Queue) -> tuple[int, object, str] | None:
    failures = []
    with contextlib.suppress(queue.Empty):
        while True:
            rank, value, text = results.get(timeout=1.0)
            if text is not None:
                failures.append((rank, value, text))
    return min(failures, key=lambda f: f[0]) if failures else None


def launch(config: TrainConfig) -> TrainOutcome | None:
    """Train on the torchrun ranks or on spawned ones; rank 0's outcome (None on the other torchrun ranks)."""
    if under_torchrun():
        _setup_logging(int(os.environ["RANK"]))
        outcome = _run_rank(config, int(os.environ["LOCAL_RANK"]))
        return outcome if int(os.environ["RANK"]) == 0 else None
    cuda = config.device_type() == "cuda"
    world = config.nproc or (torch.cuda.device_count() if cuda else 2)
    check_world(config, world)
    check_fresh_start(config)  # fail before spawning; the ranks check again (under torchrun too)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    logger.info("spawning %d ranks (%s)", world, "nccl" if cuda else "gloo")
    with tempfile.TemporaryDirectory(prefix="simplefsdp-train-") as tmp, _spawn_env(config):
        try:
            mp.start_processes(
                _spawned, args=(world, os.path.join(tmp, "pg"), config, results), nprocs=world, start_method="spawn"
            )
        except mp.ProcessException as err:
            failure = _first_failure(results)
            if failure is None:
                raise RankFailedError(str(err)) from None
            rank, config_error, text = failure
            if isinstance(config_error, ConfigError):
                raise config_error from None
            raise RankFailedError(f"rank {rank} failed:\n{text}") from None
    rank, outcome, _ = results.get(timeout=60)
    return outcome
